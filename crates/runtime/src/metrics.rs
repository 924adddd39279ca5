//! Prometheus metrics. One registry per process; services add their own families next to
//! the runtime's, under the `arl_` prefix, and families that keep an ecosystem's names
//! (the engine's `vllm:` ones, which vLLM dashboards already chart) without it. Label
//! values come from small fixed sets (consumer names, event types, outcomes, the served
//! model's name) — never ids or error text.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConsumerOutcome {
    pub consumer: String,
    /// `ok`, `retry`, `dead_letter`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConsumerLabel {
    pub consumer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventTypeLabel {
    pub event_type: &'static str,
}

/// The process-wide registry plus the runtime's own metric families.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// `arl_`-prefixed families.
    registry: Arc<Mutex<Registry>>,
    /// Families named as another tool names them (no prefix).
    foreign: Arc<Mutex<Registry>>,
    pub messages_handled: Family<ConsumerOutcome, Counter>,
    pub handler_seconds: Family<ConsumerLabel, Histogram>,
    pub events_published: Family<EventTypeLabel, Counter>,
    pub publish_retries: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("arl");
        let messages_handled = Family::<ConsumerOutcome, Counter>::default();
        let handler_seconds = Family::<ConsumerLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 4.0, 10))
        });
        let events_published = Family::<EventTypeLabel, Counter>::default();
        let publish_retries = Counter::default();
        registry.register(
            "messages_handled",
            "Messages a consumer finished, by outcome",
            messages_handled.clone(),
        );
        registry.register(
            "handler_seconds",
            "Time a consumer's handler took per message",
            handler_seconds.clone(),
        );
        registry.register(
            "events_published",
            "Events published, by type",
            events_published.clone(),
        );
        registry.register(
            "publish_retries",
            "Publishes repeated because no acknowledgement came back",
            publish_retries.clone(),
        );
        Self {
            registry: Arc::new(Mutex::new(registry)),
            foreign: Arc::new(Mutex::new(Registry::default())),
            messages_handled,
            handler_seconds,
            events_published,
            publish_retries,
        }
    }

    /// Adds a service's own metric family.
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .register(name, help, metric);
    }

    /// Adds a family under exactly `name` (no `arl_` prefix): for names another tool's
    /// users already chart, such as vLLM's `vllm:time_to_first_token_seconds`.
    pub fn register_foreign(&self, name: &str, help: &str, metric: impl Metric) {
        self.foreign
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .register(name, help, metric);
    }

    /// Adds families whose values are read at scrape time (gauges of live state), under
    /// the names the collector gives them (no prefix).
    pub fn register_foreign_collector(&self, collector: impl Collector) {
        self.foreign
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .register_collector(Box::new(collector));
    }

    /// The OpenMetrics text exposition of every registered metric.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        let encoded = {
            let registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
            let foreign = self.foreign.lock().unwrap_or_else(PoisonError::into_inner);
            encode_registry(&mut text, &registry)
                .and_then(|()| encode_registry(&mut text, &foreign))
                .and_then(|()| encode_eof(&mut text))
        };
        if let Err(err) = encoded {
            tracing::error!(%err, "cannot encode metrics");
        }
        text
    }
}
