//! `arl-exporter` as a hosted service: its flags and how it starts.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::kafka::{Compression, ProducerSettings, parse_pairs, read_properties};
use crate::metrics::ExporterMetrics;
use crate::pipeline::Exporter as Pipeline;
use crate::selection::{KeyBy, LlmCalls, Selection, SelectionFlags};

/// `arl-exporter`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Kafka's bootstrap servers, `host:port[,host:port…]`.
    #[arg(long, env = "ARL_KAFKA_BROKERS")]
    kafka_brokers: String,

    /// Event types to export, comma-separated (`trial.finished,reward.scored,train.step`),
    /// or `all`.
    #[arg(long, env = "ARL_EXPORT_EVENTS", default_value = "all")]
    events: String,

    /// Runs to export, comma-separated run ids, or `all` (every run, present and future).
    #[arg(long, env = "ARL_EXPORT_RUNS", default_value = "all")]
    runs: String,

    /// A topic is named this prefix and the event type (`arl.trial.finished`) unless
    /// `--topic` names it.
    #[arg(long, default_value = "arl.")]
    topic_prefix: String,

    /// The topic of one event type, `EVENT_TYPE=TOPIC`; repeatable.
    #[arg(long = "topic")]
    topics: Vec<String>,

    /// The record key: the run id, or the trial id for a trial's events (the run id for
    /// the rest). Kafka keeps each key's records in order.
    #[arg(long, value_enum, default_value = "run")]
    key: KeyBy,

    /// `llm.call` whole, or trimmed of its conversation, token ids and log-probabilities.
    #[arg(long, value_enum, default_value = "full")]
    llm_calls: LlmCalls,

    /// Record batch compression.
    #[arg(long, value_enum, default_value = "lz4")]
    kafka_compression: Compression,

    /// The idempotent producer (`on`); `off` only for a broker that lacks it.
    #[arg(long, default_value = "on", value_parser = on_off)]
    kafka_idempotence: bool,

    /// A librdkafka property passed through, `KEY=VALUE` (SASL and TLS: `security.protocol`,
    /// `sasl.mechanism`, `sasl.username`, `ssl.ca.location`, …); repeatable; wins over the file.
    #[arg(long = "kafka-config")]
    kafka_config: Vec<String>,

    /// A properties file of librdkafka settings (`key=value` lines), for secrets such as
    /// `sasl.password` kept off the command line.
    #[arg(long, env = "ARL_KAFKA_CONFIG_FILE")]
    kafka_config_file: Option<PathBuf>,

    /// Events out and not yet confirmed by Kafka, per stream: what a stall holds back, and
    /// the most a restart may send twice.
    #[arg(long, default_value_t = 1000)]
    window: usize,

    /// Seconds before JetStream offers an unconfirmed event again (the exporter skips the
    /// repeat of an event it still holds).
    #[arg(long, default_value_t = 60)]
    ack_wait_s: u64,

    /// The durable consumers' name: two exporters (to two clusters) need two names.
    #[arg(long, default_value = "exporter")]
    durable: String,
}

fn on_off(value: &str) -> Result<bool, String> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("{other:?}: expected on or off")),
    }
}

impl Args {
    fn producer(&self) -> Result<ProducerSettings, StartError> {
        let mut passthrough = BTreeMap::new();
        if let Some(file) = &self.kafka_config_file {
            read_properties(file, &mut passthrough)?;
        }
        parse_pairs(
            self.kafka_config.iter().map(String::as_str),
            &mut passthrough,
        )?;
        let settings = ProducerSettings {
            brokers: self.kafka_brokers.clone(),
            compression: self.kafka_compression,
            idempotence: self.kafka_idempotence,
            passthrough,
        };
        // librdkafka checks every property at creation: a typo fails the start, not later.
        drop(settings.producer()?);
        Ok(settings)
    }

    fn selection(&self) -> Result<Selection, StartError> {
        Ok(Selection::new(&SelectionFlags {
            events: &self.events,
            runs: &self.runs,
            topic_prefix: &self.topic_prefix,
            topics: &self.topics,
            key_by: self.key,
            llm_calls: self.llm_calls,
        })?)
    }
}

/// The exporter, for `arl_runtime::host`.
pub struct Exporter;

impl Service for Exporter {
    const NAME: &'static str = "exporter";
    const ABOUT: &'static str = "ARL exporter: the run's events to Kafka topics";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        if args.window == 0 {
            return Err("--window must be at least 1".into());
        }
        let pipeline = Pipeline {
            selection: Arc::new(args.selection()?),
            producer: args.producer()?,
            durable: args.durable.clone(),
            window: args.window,
            ack_wait: Duration::from_secs(args.ack_wait_s.max(1)),
            metrics: ExporterMetrics::new(&ctx.metrics),
            bus: ctx.bus,
        };
        tracing::info!(
            events = pipeline.selection.events().len(),
            streams = pipeline.feeds().len(),
            "exporting"
        );
        ctx.shutdown.spawn(pipeline.run(ctx.shutdown.clone()));
        Ok(Ops::Host(Readiness::always()))
    }
}
