//! An ordered, durable read of one stream, for a service that forwards events to another
//! system (the Kafka exporter). Messages come in stream order, each handed out once, and
//! an acknowledgement covers every message before it (`AckPolicy::All`): the consumer's
//! ack floor means exactly "forwarded up to here".
//!
//! Opening a feed re-creates its durable consumer from that floor, so whatever was
//! delivered but not acknowledged when the last holder stopped comes again, first and in
//! order: at least once, never reordered. A durable has one holder at a time.
//!
//! Backpressure: at most `window` messages are out unacknowledged; past that the server
//! delivers nothing more until the holder acknowledges. A message held longer than
//! `ack_wait` is redelivered by the server; the feed drops such repeats of what it already
//! handed out (the holder still has them), so a stalled destination never reorders.

use std::sync::Arc;
use std::time::Duration;

use arl_schemas::Domain;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::consumer::{self, Consumer, pull};
use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;

use crate::consumer::park;
use crate::{Bus, BusError, Delivery};

/// What a feed reads.
#[derive(Clone, Debug)]
pub struct FeedSpec {
    pub domain: Domain,
    /// The durable consumer's name: where the feed's position is kept.
    pub durable: String,
    /// Subjects of the domain's stream to read (built by `arl_schemas::Namespace`).
    pub filter_subjects: Vec<String>,
    /// Messages out and not yet acknowledged, at most.
    pub window: usize,
    /// How long the server waits for an acknowledgement before it delivers again.
    pub ack_wait: Duration,
}

/// How far a feed is behind its stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedLag {
    /// Matching messages not yet delivered.
    pub pending: u64,
    /// Delivered, not yet acknowledged.
    pub unacknowledged: u64,
}

impl FeedLag {
    pub fn total(&self) -> u64 {
        self.pending + self.unacknowledged
    }
}

/// A feed's stream and durable: what its errors name.
#[derive(Debug)]
struct Names {
    stream: String,
    durable: String,
}

impl Names {
    fn error(&self, reason: String) -> BusError {
        BusError::Feed {
            stream: self.stream.clone(),
            durable: self.durable.clone(),
            reason,
        }
    }
}

/// One open feed: [`Feed::next`] in a loop, [`FeedMessage::ack`] once forwarded.
pub struct Feed {
    bus: Bus,
    domain: Domain,
    names: Arc<Names>,
    consumer: Consumer<pull::Config>,
    messages: pull::Stream,
    /// The stream sequence of the last message handed out.
    last_sequence: u64,
}

/// A message of a feed, with what acknowledges it.
pub struct FeedMessage {
    pub delivery: Delivery,
    message: jetstream::Message,
    names: Arc<Names>,
}

impl FeedMessage {
    /// Acknowledges this message and every earlier one of the feed, confirmed by the
    /// server (a lost acknowledgement only means the next holder starts earlier).
    pub async fn ack(&self) -> Result<(), BusError> {
        self.message
            .double_ack_with(AckKind::Ack)
            .await
            .map_err(|e| {
                self.names
                    .error(format!("acknowledgement not confirmed: {e}"))
            })
    }
}

impl Feed {
    /// Opens the feed at its durable's ack floor (the stream's start for a new durable).
    pub async fn open(bus: &Bus, spec: FeedSpec) -> Result<Feed, BusError> {
        let names = Arc::new(Names {
            stream: bus.namespace().stream(spec.domain),
            durable: spec.durable.clone(),
        });
        let (stream, error) = (&names.stream, |reason| names.error(reason));
        let js = bus.jetstream();
        let floor = match js
            .get_consumer_from_stream::<pull::Config, _, _>(&spec.durable, stream)
            .await
        {
            Ok(mut existing) => {
                let info = existing
                    .info()
                    .await
                    .map_err(|e| error(format!("reading its position: {e}")))?;
                let floor = info.ack_floor.stream_sequence;
                js.delete_consumer_from_stream(&spec.durable, stream)
                    .await
                    .map_err(|e| error(format!("re-creating it at {floor}: {e}")))?;
                Some(floor)
            }
            Err(e) if is_not_found(&e) => None,
            Err(e) => return Err(error(format!("looking it up: {e}"))),
        };
        let deliver_policy = match floor {
            Some(floor) if floor > 0 => consumer::DeliverPolicy::ByStartSequence {
                start_sequence: floor + 1,
            },
            _ => consumer::DeliverPolicy::All,
        };
        let config = pull::Config {
            durable_name: Some(spec.durable.clone()),
            filter_subjects: spec.filter_subjects.clone(),
            ack_policy: consumer::AckPolicy::All,
            ack_wait: spec.ack_wait,
            // Never given up on: a message waits for its destination however long it takes.
            max_deliver: -1,
            deliver_policy,
            max_ack_pending: i64::try_from(spec.window.max(1)).unwrap_or(i64::MAX),
            ..Default::default()
        };
        let consumer: Consumer<pull::Config> = js
            .create_consumer_on_stream(config, stream)
            .await
            .map_err(|e| error(format!("creating it: {e}")))?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(spec.window.clamp(1, 512))
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
            .map_err(|e| error(format!("pulling: {e}")))?;
        tracing::info!(stream = %stream, durable = %spec.durable, ?floor, "feed opened");
        Ok(Feed {
            bus: bus.clone(),
            domain: spec.domain,
            names,
            consumer,
            messages,
            last_sequence: floor.unwrap_or(0),
        })
    }

    /// The next message in stream order; `None` when the server ended the pull (open the
    /// feed again). Redeliveries of messages already handed out are skipped.
    pub async fn next(&mut self) -> Option<Result<FeedMessage, BusError>> {
        loop {
            let message = match self.messages.next().await? {
                Ok(message) => message,
                Err(e) => return Some(Err(self.names.error(format!("pulling: {e}")))),
            };
            let delivery = match Delivery::of(&message) {
                Ok(delivery) => delivery,
                Err(e) => {
                    let reason = format!("a message without metadata: {e}");
                    return Some(Err(self.names.error(reason)));
                }
            };
            if delivery.stream_sequence <= self.last_sequence {
                continue;
            }
            self.last_sequence = delivery.stream_sequence;
            return Some(Ok(FeedMessage {
                delivery,
                message,
                names: self.names.clone(),
            }));
        }
    }

    /// What reads the feed's lag while the feed is being read.
    pub fn lag_probe(&self) -> LagProbe {
        LagProbe {
            consumer: self.consumer.clone(),
            names: self.names.clone(),
        }
    }

    /// What parks messages of this feed its destination refuses for good.
    pub fn dead_letters(&self) -> DeadLetters {
        DeadLetters {
            bus: self.bus.clone(),
            domain: self.domain,
            durable: self.names.durable.clone(),
        }
    }

    /// The stream this feed reads (`ARL_TRIALS`).
    pub fn stream(&self) -> &str {
        &self.names.stream
    }
}

fn is_not_found(error: &ConsumerError) -> bool {
    matches!(error.kind(), ConsumerErrorKind::JetStream(e) if e.error_code() == ErrorCode::CONSUMER_NOT_FOUND)
}

/// Reads how far behind its stream a feed is, as the server counts it.
#[derive(Clone)]
pub struct LagProbe {
    consumer: Consumer<pull::Config>,
    names: Arc<Names>,
}

impl LagProbe {
    pub async fn lag(&mut self) -> Result<FeedLag, BusError> {
        let info = self
            .consumer
            .info()
            .await
            .map_err(|e| self.names.error(format!("reading its lag: {e}")))?;
        Ok(FeedLag {
            pending: info.num_pending,
            unacknowledged: u64::try_from(info.num_ack_pending).unwrap_or(0),
        })
    }
}

/// Parks a feed's messages on the dead-letter stream.
#[derive(Clone)]
pub struct DeadLetters {
    bus: Bus,
    domain: Domain,
    durable: String,
}

impl DeadLetters {
    /// Parks `delivery` with `reason`: for a message its destination refuses for good.
    /// It still counts as forwarded once a later acknowledgement covers it.
    pub async fn park(&self, delivery: &Delivery, reason: &str) -> Result<(), BusError> {
        park(&self.bus, self.domain, &self.durable, delivery, reason).await
    }
}
