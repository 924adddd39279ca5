//! The exporter's metrics: events exported and parked by type, delivery time, each feed's
//! lag (what the bus holds that Kafka does not yet have), and restarts.

use std::time::Duration;

use arl_runtime::Metrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub event_type: &'static str,
    /// `exported`, `dead_letter`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabel {
    pub stream: String,
}

#[derive(Clone, Debug)]
pub struct ExporterMetrics {
    events: Family<OutcomeLabel, Counter>,
    delivery_seconds: Histogram,
    lag: Family<StreamLabel, Gauge>,
    pub restarts: Counter,
}

impl ExporterMetrics {
    pub fn new(metrics: &Metrics) -> Self {
        let m = Self {
            events: Family::default(),
            delivery_seconds: Histogram::new(exponential_buckets(0.001, 4.0, 10)),
            lag: Family::default(),
            restarts: Counter::default(),
        };
        metrics.register(
            "exporter_events",
            "Events the exporter finished, by type and outcome (exported to Kafka, or parked on the dead-letter stream)",
            m.events.clone(),
        );
        metrics.register(
            "exporter_delivery_seconds",
            "From handing an event to the producer to Kafka's acknowledgement",
            m.delivery_seconds.clone(),
        );
        metrics.register(
            "exporter_lag_events",
            "Events of a stream selected for export and not yet acknowledged by Kafka",
            m.lag.clone(),
        );
        metrics.register(
            "exporter_restarts",
            "Export sessions that stopped on an error and started over from the last acknowledged event",
            m.restarts.clone(),
        );
        m
    }

    pub fn exported(&self, event_type: &'static str, took: Duration) {
        self.events
            .get_or_create(&OutcomeLabel {
                event_type,
                outcome: "exported",
            })
            .inc();
        self.delivery_seconds.observe(took.as_secs_f64());
    }

    pub fn dead_lettered(&self, event_type: &'static str) {
        self.events
            .get_or_create(&OutcomeLabel {
                event_type,
                outcome: "dead_letter",
            })
            .inc();
    }

    pub fn lag(&self, stream: &str) -> Gauge {
        self.lag
            .get_or_create(&StreamLabel {
                stream: stream.to_owned(),
            })
            .clone()
    }
}
