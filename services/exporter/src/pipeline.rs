//! The export loop. A session is one producer and one feed per stream; each feed runs a
//! reader (feed → record → producer queue, in stream order) and an acknowledger (Kafka's
//! delivery reports in the same order → JetStream acknowledgements). The channel between
//! them is the window: when Kafka stalls, reports stop, the channel fills, the reader
//! stops pulling, and the feed's unacknowledged messages stay with the server.
//!
//! A record Kafka refuses for good (too large, invalid) is parked on the dead-letter
//! stream and the export goes on. Anything else that stops a feed — a fatal producer
//! error, an unknown or forbidden topic, a broken feed — ends the session without
//! acknowledging past the last delivered event; the next session, after a pause, starts
//! every feed again from its acknowledged floor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arl_runtime::feed::{DeadLetters, Feed, FeedMessage, FeedSpec};
use arl_runtime::{Bus, BusError, Shutdown};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tokio::sync::mpsc;

use crate::kafka::{Failure, KafkaSettingsError, ProducerSettings, judge};
use crate::metrics::ExporterMetrics;
use crate::record::{Record, record};
use crate::selection::Selection;

/// How long a stopping exporter waits for Kafka to confirm what it already sent (what
/// stays unconfirmed is sent again by the next exporter: duplicates, never loss).
const DRAIN: Duration = Duration::from_secs(10);
/// How often each feed's lag is read for the metric.
const LAG_PERIOD: Duration = Duration::from_secs(2);
/// Acknowledge at least this often on a steady stream (each acknowledgement covers every
/// event before it).
const ACK_EVERY: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Settings(#[from] KafkaSettingsError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("the feed of {0} ended; it is opened again")]
    FeedEnded(String),
    #[error("Kafka cannot take events of {stream}: {error}")]
    Kafka { stream: String, error: KafkaError },
    #[error("the Kafka producer failed for good ({code:?}): {reason}")]
    Fatal {
        code: RDKafkaErrorCode,
        reason: String,
    },
    #[error("a feed's task failed: {0}")]
    TaskFailed(String),
}

/// Everything an export needs, fixed for the exporter's life.
pub struct Exporter {
    pub bus: Bus,
    pub selection: Arc<Selection>,
    pub producer: ProducerSettings,
    /// The durable consumers' name (one per stream).
    pub durable: String,
    /// Events out and not yet confirmed by Kafka, per stream.
    pub window: usize,
    pub ack_wait: Duration,
    pub metrics: ExporterMetrics,
}

impl Exporter {
    pub fn feeds(&self) -> Vec<FeedSpec> {
        self.selection.feeds(
            self.bus.namespace(),
            &self.durable,
            self.window,
            self.ack_wait,
        )
    }

    /// Sessions until shutdown, each started after the last one failed, with a growing
    /// pause (1 s to 30 s).
    pub async fn run(self, shutdown: Shutdown) {
        let mut pause = Duration::from_secs(1);
        while !shutdown.is_triggered() {
            let started = Instant::now();
            match self.session(&shutdown).await {
                Ok(()) => break,
                Err(err) => {
                    self.metrics.restarts.inc();
                    tracing::error!(error = %err, ?pause, "export stopped; starting over from the last acknowledged event");
                }
            }
            if started.elapsed() > Duration::from_secs(60) {
                pause = Duration::from_secs(1);
            }
            tokio::select! {
                () = shutdown.triggered() => break,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(30));
        }
        tracing::info!("exporter stopped");
    }

    /// One producer, one feed per stream, until shutdown (Ok) or the first failure.
    pub async fn session(&self, shutdown: &Shutdown) -> Result<(), ExportError> {
        let producer = self.producer.producer()?;
        let mut feeds = Vec::new();
        for spec in self.feeds() {
            feeds.push(Feed::open(&self.bus, spec).await?);
        }
        // A fatal producer error fails every feed's deliveries; it is also watched here so
        // that a session ends on one even while nothing is being sent.
        let fatal = watch_fatal(producer.clone(), shutdown.clone());
        let streams = feeds.into_iter().map(|feed| {
            forward(
                feed,
                producer.clone(),
                self.selection.clone(),
                self.bus.namespace().clone(),
                self.metrics.clone(),
                self.window,
                shutdown.clone(),
            )
        });
        let all = first_failure(streams);
        tokio::select! {
            result = all => result,
            err = fatal => Err(err),
        }
    }
}

/// The first error of `futures`, or Ok once all finished.
async fn first_failure(
    futures: impl Iterator<
        Item = impl std::future::Future<Output = Result<(), ExportError>> + Send + 'static,
    >,
) -> Result<(), ExportError> {
    let mut set = tokio::task::JoinSet::new();
    for future in futures {
        set.spawn(future);
    }
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(err)) => return Err(err),
            Err(failed) => return Err(ExportError::TaskFailed(failed.to_string())),
        }
    }
    Ok(())
}

async fn watch_fatal(producer: FutureProducer, shutdown: Shutdown) -> ExportError {
    loop {
        if let Some((code, reason)) = producer.client().fatal_error() {
            return ExportError::Fatal { code, reason };
        }
        tokio::select! {
            () = shutdown.triggered() => std::future::pending::<()>().await,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// What the reader hands the acknowledger, in stream order.
struct InFlight {
    message: FeedMessage,
    outcome: Outcome,
    enqueued: Instant,
}

enum Outcome {
    /// In the producer's hands: its delivery report comes later.
    Sent {
        report: DeliveryFuture,
        event_type: &'static str,
    },
    /// Refused for good before Kafka saw it: to be parked with the reason (and its type,
    /// when it got as far as being a record).
    Refused {
        reason: String,
        event_type: Option<&'static str>,
    },
}

/// One feed, until shutdown (Ok, after draining) or its first failure.
async fn forward(
    mut feed: Feed,
    producer: FutureProducer,
    selection: Arc<Selection>,
    ns: arl_schemas::Namespace,
    metrics: ExporterMetrics,
    window: usize,
    shutdown: Shutdown,
) -> Result<(), ExportError> {
    let stream = feed.stream().to_owned();
    // The server hands out at most the window unacknowledged; the channel holds that many.
    let (to_acks, in_flight) = mpsc::channel::<InFlight>(window.max(1));
    let lag = watch_lag(&feed, &stream, &metrics, &shutdown);
    let acks = acknowledge(
        in_flight,
        feed.dead_letters(),
        stream.clone(),
        metrics.clone(),
        shutdown.clone(),
    );
    // The reader stops first (shutdown or failure); its sender goes with it, which lets
    // the acknowledger drain what is in flight.
    let reader = async move {
        // A local of the body, so it is dropped when the body returns (a bare capture would
        // live as long as the finished future, and the acknowledger would wait on it).
        let to_acks = to_acks;
        loop {
            let next = tokio::select! {
                () = shutdown.triggered() => return Ok(()),
                next = feed.next() => next,
            };
            let message = match next {
                None => return Err(ExportError::FeedEnded(stream.clone())),
                Some(Err(err)) => return Err(err.into()),
                Some(Ok(message)) => message,
            };
            let outcome = match record(&selection, &ns, &stream, &message.delivery) {
                Ok(record) => send(&producer, &record, &stream, &shutdown).await?,
                Err(err) => Outcome::Refused {
                    reason: err.to_string(),
                    event_type: None,
                },
            };
            let item = InFlight {
                message,
                outcome,
                enqueued: Instant::now(),
            };
            // Full: Kafka is behind by a whole window; wait here (backpressure).
            if to_acks.send(item).await.is_err() {
                return Ok(());
            }
        }
    };
    // The lag watch never ends on its own: the feed's work decides.
    tokio::select! {
        result = async { tokio::try_join!(reader, acks).map(|_| ()) } => result,
        () = lag => Ok(()),
    }
}

/// Hands `record` to the producer, waiting while its local queue is full.
async fn send(
    producer: &FutureProducer,
    record: &Record,
    stream: &str,
    shutdown: &Shutdown,
) -> Result<Outcome, ExportError> {
    let mut pending = FutureRecord::to(&record.topic)
        .key(record.key.as_bytes())
        .payload(record.value.as_ref())
        .headers(record.kafka_headers());
    loop {
        match producer.send_result(pending) {
            Ok(report) => {
                return Ok(Outcome::Sent {
                    report,
                    event_type: record.event_type,
                });
            }
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                pending = back;
                tokio::select! {
                    () = shutdown.triggered() => {
                        return Err(ExportError::Kafka {
                            stream: stream.to_owned(),
                            error: KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull),
                        });
                    }
                    () = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
            }
            Err((error, _)) => {
                return match judge(&error) {
                    Failure::Record => Ok(Outcome::Refused {
                        reason: refused_by_kafka(&error),
                        event_type: Some(record.event_type),
                    }),
                    Failure::Export => Err(ExportError::Kafka {
                        stream: stream.to_owned(),
                        error,
                    }),
                };
            }
        }
    }
}

/// Delivery reports in stream order → JetStream acknowledgements. Each acknowledgement
/// covers every event before it, so one is sent when the line goes idle or every
/// [`ACK_EVERY`] events, never past an event Kafka has not confirmed.
async fn acknowledge(
    mut in_flight: mpsc::Receiver<InFlight>,
    dead_letters: DeadLetters,
    stream: String,
    metrics: ExporterMetrics,
    shutdown: Shutdown,
) -> Result<(), ExportError> {
    let mut confirmed: Option<FeedMessage> = None;
    let mut unacknowledged = 0usize;
    let drain_deadline = async {
        shutdown.triggered().await;
        tokio::time::sleep(DRAIN).await;
    };
    tokio::pin!(drain_deadline);
    loop {
        let next = tokio::select! {
            next = in_flight.recv() => next,
            () = &mut drain_deadline => break,
        };
        let Some(item) = next else { break };
        // Some(reason, type): the event is parked on the dead-letter stream.
        let refused = match item.outcome {
            Outcome::Sent { report, event_type } => {
                let delivered = tokio::select! {
                    delivered = report => delivered,
                    () = &mut drain_deadline => break,
                };
                match delivered {
                    Ok(Ok(_)) => {
                        metrics.exported(event_type, item.enqueued.elapsed());
                        None
                    }
                    Ok(Err((error, _))) => match judge(&error) {
                        Failure::Record => Some((refused_by_kafka(&error), Some(event_type))),
                        Failure::Export => {
                            ack(&mut confirmed).await;
                            return Err(ExportError::Kafka { stream, error });
                        }
                    },
                    // The producer is gone: the session is ending.
                    Err(_canceled) => break,
                }
            }
            Outcome::Refused { reason, event_type } => Some((reason, event_type)),
        };
        if let Some((reason, event_type)) = refused {
            dead_letters.park(&item.message.delivery, &reason).await?;
            metrics.dead_lettered(event_type.unwrap_or("unrecognised"));
        }
        confirmed = Some(item.message);
        unacknowledged += 1;
        if unacknowledged >= ACK_EVERY || in_flight.is_empty() {
            ack(&mut confirmed).await;
            unacknowledged = 0;
        }
    }
    ack(&mut confirmed).await;
    Ok(())
}

fn refused_by_kafka(error: &KafkaError) -> String {
    format!("Kafka refused it: {error}")
}

async fn ack(confirmed: &mut Option<FeedMessage>) {
    if let Some(message) = confirmed.take()
        && let Err(err) = message.ack().await
    {
        // Only means the next session starts a little earlier (duplicates, not loss).
        tracing::warn!(error = %err, "acknowledgement not confirmed");
    }
}

/// Reads the feed's lag into the metric until shutdown.
fn watch_lag(
    feed: &Feed,
    stream: &str,
    metrics: &ExporterMetrics,
    shutdown: &Shutdown,
) -> impl std::future::Future<Output = ()> + use<> {
    let mut probe = feed.lag_probe();
    let gauge = metrics.lag(stream);
    let shutdown = shutdown.clone();
    async move {
        loop {
            match probe.lag().await {
                Ok(lag) => {
                    gauge.set(i64::try_from(lag.total()).unwrap_or(i64::MAX));
                }
                Err(err) => tracing::debug!(error = %err, "cannot read the feed's lag"),
            }
            tokio::select! {
                () = shutdown.triggered() => std::future::pending::<()>().await,
                () = tokio::time::sleep(LAG_PERIOD) => {}
            }
        }
    }
}
