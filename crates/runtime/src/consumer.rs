//! The consumer loop every service uses to take work from a stream.
//!
//! Rules, in the manner of vector's NATS source:
//! - a message is acked only after its handler returned `Ok` — that is, after the work it
//!   caused is durable;
//! - a handler's `Retry` naks with a growing delay; on the last allowed delivery the
//!   message goes to the dead-letter subject instead, with the reason, and is terminated;
//! - a handler's `DeadLetter` (input that can never succeed) goes there at once;
//! - at most `concurrency` messages are in hand at a time;
//! - a broken subscription is rebuilt with backoff; shutdown stops pulling and waits for
//!   the handlers in flight.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arl_schemas::{DecodeError, Domain, Event};
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{self, pull};
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tracing::Instrument;

use crate::metrics::{ConsumerLabel, ConsumerOutcome};
use crate::{Bus, BusError, Shutdown, headers};

/// What to consume and how.
#[derive(Clone, Debug)]
pub struct ConsumerSpec {
    pub domain: Domain,
    /// Durable consumer name: the service's name.
    pub durable: String,
    /// Subjects (built by `arl_schemas::Namespace`) this consumer takes.
    pub filter_subjects: Vec<String>,
    /// Deliveries before a failing message is dead-lettered.
    pub max_deliver: i64,
    /// How long a handler may hold a message before the server redelivers it.
    pub ack_wait: Duration,
    /// Delay before redelivery after the n-th failure (the last entry repeats).
    pub retry_backoff: Vec<Duration>,
    pub concurrency: usize,
    /// Set to 1 for strictly ordered delivery: the server hands out the next message only
    /// after the current one is acked (a nak'd message comes back before later ones).
    pub max_ack_pending: Option<i64>,
    /// While a handler runs, tell the server every `ack_wait / 3` that it is still in
    /// progress, so a message held for a long time (until a training step that uses it
    /// commits) is not redelivered. A crashed process stops the signal: then it is.
    pub keep_alive: bool,
}

impl ConsumerSpec {
    pub fn new(domain: Domain, durable: impl Into<String>, filter_subjects: Vec<String>) -> Self {
        Self {
            domain,
            durable: durable.into(),
            filter_subjects,
            max_deliver: 5,
            ack_wait: Duration::from_secs(30),
            retry_backoff: vec![
                Duration::from_millis(200),
                Duration::from_secs(1),
                Duration::from_secs(5),
            ],
            concurrency: 16,
            max_ack_pending: None,
            keep_alive: false,
        }
    }

    /// A consumer of event `E` of every run in namespace `ns`, on `E`'s stream.
    pub fn for_event<E: Event>(ns: &arl_schemas::Namespace, durable: impl Into<String>) -> Self {
        Self::new(E::DOMAIN, durable, vec![E::filter(ns)])
    }

    /// Every run's end (`run.completed`, `run.failed`, `run.cancelled`), one at a time and
    /// kept alive while handled: what a service that holds something per run lets go on.
    /// Read the run with [`Delivery::ended_run`].
    pub fn run_ends(ns: &arl_schemas::Namespace, durable: impl Into<String>) -> Self {
        use arl_schemas::events::{RunCancelledV1, RunCompletedV1, RunFailedV1};
        let mut spec = Self::for_event::<RunCompletedV1>(ns, durable)
            .and_event::<RunFailedV1>(ns)
            .and_event::<RunCancelledV1>(ns)
            .ordered();
        spec.keep_alive = true;
        spec
    }

    /// Also takes event `E`, which must live in the same stream.
    pub fn and_event<E: Event>(mut self, ns: &arl_schemas::Namespace) -> Self {
        assert_eq!(
            E::DOMAIN,
            self.domain,
            "{} is not in this consumer's stream",
            E::TYPE
        );
        self.filter_subjects.push(E::filter(ns));
        self
    }

    /// Up to `capacity` messages held at once, each kept alive until its handler returns —
    /// for handlers that wait for a batch to be committed.
    pub fn held(mut self, capacity: usize) -> Self {
        self.concurrency = capacity;
        self.max_ack_pending = i64::try_from(capacity).ok();
        self.keep_alive = true;
        self
    }

    /// One message at a time, in stream order — for handlers that fold events into state.
    pub fn ordered(mut self) -> Self {
        self.concurrency = 1;
        self.max_ack_pending = Some(1);
        self
    }

    fn retry_delay(&self, attempt: i64) -> Duration {
        let index = usize::try_from(attempt.saturating_sub(1)).unwrap_or(0);
        self.retry_backoff
            .get(index)
            .or(self.retry_backoff.last())
            .copied()
            .unwrap_or(Duration::from_secs(1))
    }
}

/// One message handed to a handler.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub subject: String,
    pub headers: Option<HeaderMap>,
    pub payload: Bytes,
    /// 1 on first delivery.
    pub attempt: i64,
    pub stream_sequence: u64,
    /// When JetStream stored the message (the server's clock, not the publisher's).
    pub published: SystemTime,
}

impl Delivery {
    /// A JetStream message with its metadata (the error when it carries none).
    pub(crate) fn of(message: &jetstream::Message) -> Result<Self, async_nats::Error> {
        let info = message.info()?;
        Ok(Delivery {
            subject: message.subject.to_string(),
            headers: message.headers.clone(),
            payload: message.payload.clone(),
            attempt: info.delivered,
            stream_sequence: info.stream_sequence,
            published: SystemTime::from(info.published),
        })
    }

    /// Decodes the payload as `E`, refusing a message whose headers name another type.
    pub fn decode<E: Event>(&self) -> Result<E, DecodeError> {
        if let Some((found_type, found_version)) = headers::event_type(self.headers.as_ref())
            && (found_type != E::TYPE || found_version != E::VERSION)
        {
            return Err(DecodeError::WrongType {
                expected_type: E::TYPE,
                expected_version: E::VERSION,
                found_type,
                found_version,
            });
        }
        E::decode(&self.payload)
    }

    /// Decodes a `train.step` of the version its `Arl-Version` header names; without
    /// headers, as the newest version it parses as.
    pub fn decode_train_step(&self) -> Result<arl_schemas::events::TrainStep, DecodeError> {
        use arl_schemas::events::{TrainStep, TrainStepV2};
        self.decode_versioned::<TrainStepV2, _>(TrainStep::decode)
    }

    /// Decodes a `weights.published` of either version as version 2 (version 1 upgraded:
    /// its `file://` uri becomes a folder location).
    pub fn decode_weights_published(
        &self,
    ) -> Result<arl_schemas::events::WeightsPublishedV2, DecodeError> {
        use arl_schemas::events::WeightsPublishedV2;
        self.decode_versioned::<WeightsPublishedV2, _>(WeightsPublishedV2::read)
    }

    /// Decodes an event published in several versions (`Newest` the newest) with `read`,
    /// given the version its `Arl-Version` header names; without headers, as the newest
    /// version it parses as.
    fn decode_versioned<Newest: Event, T>(
        &self,
        read: fn(u32, &[u8]) -> Result<T, DecodeError>,
    ) -> Result<T, DecodeError> {
        let version = match headers::event_type(self.headers.as_ref()) {
            Some((found_type, found_version)) if found_type != Newest::TYPE => {
                return Err(DecodeError::WrongType {
                    expected_type: Newest::TYPE,
                    expected_version: Newest::VERSION,
                    found_type,
                    found_version,
                });
            }
            Some((_, version)) => version,
            None => {
                return (1..Newest::VERSION)
                    .rev()
                    .fold(read(Newest::VERSION, &self.payload), |newest, older| {
                        newest.or_else(|e| read(older, &self.payload).map_err(|_| e))
                    });
            }
        };
        read(version, &self.payload)
    }

    /// The run a delivery of [`ConsumerSpec::run_ends`] ended.
    pub fn ended_run(&self) -> Result<arl_schemas::RunId, DecodeError> {
        use arl_schemas::events::{RunCancelledV1, RunCompletedV1, RunFailedV1};
        Ok(match self.event_type().as_deref() {
            Some(RunFailedV1::TYPE) => self.decode::<RunFailedV1>()?.run_id,
            Some(RunCancelledV1::TYPE) => self.decode::<RunCancelledV1>()?.run_id,
            _ => self.decode::<RunCompletedV1>()?.run_id,
        })
    }

    /// The `Arl-Type` header, if present.
    pub fn event_type(&self) -> Option<String> {
        headers::event_type(self.headers.as_ref()).map(|(t, _)| t)
    }
}

/// Any error, kept whole (its sources too) for the log and the dead letter.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a handler failed. Which kind an error is decides what happens to the message; the
/// error itself travels with it, sources and all (`From` impls sort the common ones: a bus
/// error is transient, a message that does not decode never will).
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Transient (bus or disk trouble): try again later.
    #[error(transparent)]
    Retry(BoxError),
    /// The message can never be handled: park it on the dead-letter subject now.
    #[error(transparent)]
    DeadLetter(BoxError),
    /// The run the message belongs to has no state (not written yet, or deleted mid-run):
    /// retried like `Retry`; on the last delivery the service gives the run up — it
    /// publishes `run.failed` with the reason — and the message is dead-lettered.
    #[error("{reason}")]
    RunGone {
        run: arl_schemas::RunId,
        reason: String,
    },
}

impl HandlerError {
    /// Transient: the message comes back after a delay.
    pub fn retry(error: impl Into<BoxError>) -> Self {
        HandlerError::Retry(error.into())
    }

    /// Never handleable: the message is parked with the reason.
    pub fn dead_letter(error: impl Into<BoxError>) -> Self {
        HandlerError::DeadLetter(error.into())
    }

    /// A handler that panicked: its message is parked with the panic's text (a bug, so
    /// redelivering it would only panic again).
    pub fn panicked(panic: &(dyn std::any::Any + Send)) -> Self {
        let text = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-text panic payload".to_owned());
        HandlerError::DeadLetter(format!("the handler panicked: {text}").into())
    }
}

/// A message that does not decode never will: it is dead-lettered with the reason.
impl From<arl_schemas::DecodeError> for HandlerError {
    fn from(err: arl_schemas::DecodeError) -> Self {
        HandlerError::DeadLetter(Box::new(err))
    }
}

impl From<BusError> for HandlerError {
    /// Transient trouble is retried; an event that can never be stored is not.
    fn from(err: BusError) -> Self {
        match err {
            BusError::TooLarge { .. } => HandlerError::DeadLetter(Box::new(err)),
            other => HandlerError::Retry(Box::new(other)),
        }
    }
}

/// An error and its sources, one line: what a log or a dead letter says.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Wrappers that print their source already are not repeated.
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Consumes until shutdown. Handlers run on tasks tracked by `shutdown`.
pub async fn run_consumer<H, Fut>(bus: Bus, spec: ConsumerSpec, handler: H, shutdown: Shutdown)
where
    H: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let spec = Arc::new(spec);
    let permits = Arc::new(Semaphore::new(spec.concurrency.max(1)));
    let mut rebuild_delay = Duration::from_millis(100);

    while !shutdown.is_triggered() {
        let messages = match subscribe(&bus, &spec).await {
            Ok(messages) => {
                rebuild_delay = Duration::from_millis(100);
                messages
            }
            Err(err) => {
                tracing::warn!(consumer = %spec.durable, error = %err, "cannot subscribe; retrying");
                tokio::select! {
                    () = shutdown.triggered() => break,
                    () = tokio::time::sleep(rebuild_delay) => {}
                }
                rebuild_delay = (rebuild_delay * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        tokio::pin!(messages);
        loop {
            let permit = tokio::select! {
                () = shutdown.triggered() => break,
                permit = permits.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
            };
            let next = tokio::select! {
                () = shutdown.triggered() => break,
                next = messages.next() => next,
            };
            match next {
                None => {
                    tracing::warn!(consumer = %spec.durable, "message stream ended; resubscribing");
                    break;
                }
                Some(Err(err)) => {
                    use pull::MessagesErrorKind as Kind;
                    let rebuild = matches!(
                        err.kind(),
                        Kind::ConsumerDeleted | Kind::NoResponders | Kind::RequestLimitExceeded
                    );
                    tracing::warn!(consumer = %spec.durable, error = %err, rebuild, "message stream error");
                    if rebuild {
                        break;
                    }
                }
                Some(Ok(message)) => {
                    let (bus, spec, handler) = (bus.clone(), spec.clone(), handler.clone());
                    shutdown.spawn(async move {
                        handle_message(&bus, &spec, handler.as_ref(), message).await;
                        drop(permit);
                    });
                }
            }
        }
    }
    tracing::info!(consumer = %spec.durable, "consumer stopped pulling");
}

async fn subscribe(
    bus: &Bus,
    spec: &ConsumerSpec,
) -> Result<pull::Stream, Box<dyn std::error::Error + Send + Sync>> {
    let stream_name = bus.namespace().stream(spec.domain);
    let config = pull::Config {
        durable_name: Some(spec.durable.clone()),
        filter_subjects: spec.filter_subjects.clone(),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: spec.ack_wait,
        max_deliver: spec.max_deliver,
        deliver_policy: consumer::DeliverPolicy::All,
        max_ack_pending: spec.max_ack_pending.unwrap_or(1000),
        ..Default::default()
    };
    let consumer: jetstream::consumer::Consumer<pull::Config> = bus
        .jetstream()
        .create_consumer_on_stream(config, stream_name)
        .await?;
    let batch = spec.concurrency.clamp(1, 256);
    Ok(consumer
        .stream()
        .max_messages_per_batch(batch)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await?)
}

/// Runs `work`, sending in-progress acks for `message` until it finishes.
async fn keep_alive<T>(
    message: &jetstream::Message,
    ack_wait: Duration,
    work: impl Future<Output = T>,
) -> T {
    tokio::pin!(work);
    let period = (ack_wait / 3).max(Duration::from_millis(100));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    loop {
        tokio::select! {
            result = &mut work => return result,
            _ = ticks.tick() => {
                if let Err(err) = message.ack_with(AckKind::Progress).await {
                    tracing::warn!(error = %err, "cannot extend a held message's ack deadline");
                }
            }
        }
    }
}

async fn handle_message<H, Fut>(
    bus: &Bus,
    spec: &ConsumerSpec,
    handler: &H,
    message: jetstream::Message,
) where
    H: Fn(Delivery) -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let delivery = match Delivery::of(&message) {
        Ok(delivery) => delivery,
        Err(err) => {
            tracing::warn!(error = %err, "message without JetStream metadata; skipping");
            return;
        }
    };
    let attempt = delivery.attempt;
    let span = tracing::info_span!(
        "consume",
        otel.name = format!("consume {}", spec.durable).as_str(),
        consumer = %spec.durable,
        subject = %delivery.subject,
        attempt,
        otel.kind = "consumer",
    );
    if let Some(headers) = delivery.headers.as_ref() {
        crate::telemetry::set_parent_from_headers(&span, headers);
    }
    let started = Instant::now();
    // A panicking handler fails its message into the dead-letter stream with the panic's
    // text; the consumer goes on with the next one.
    let work = std::panic::AssertUnwindSafe(handler(delivery.clone()))
        .catch_unwind()
        .map(|outcome| outcome.unwrap_or_else(|panic| Err(HandlerError::panicked(panic.as_ref()))))
        .instrument(span.clone());
    let result = if spec.keep_alive {
        keep_alive(&message, spec.ack_wait, work).await
    } else {
        work.await
    };
    bus.metrics()
        .handler_seconds
        .get_or_create(&ConsumerLabel {
            consumer: spec.durable.clone(),
        })
        .observe(started.elapsed().as_secs_f64());

    let outcome = async {
        match result {
            Ok(()) => {
                settle(&message, AckKind::Ack).await;
                "ok"
            }
            Err(error @ (HandlerError::Retry(_) | HandlerError::RunGone { .. }))
                if attempt < spec.max_deliver =>
            {
                let reason = match &error {
                    HandlerError::Retry(error) => chain(error.as_ref()),
                    other => other.to_string(),
                };
                let delay = spec.retry_delay(attempt);
                tracing::warn!(%reason, attempt, ?delay, "handler failed; will retry");
                settle(&message, AckKind::Nak(Some(delay))).await;
                "retry"
            }
            Err(HandlerError::RunGone { run, reason }) => {
                let reason = format!("gave up after {attempt} deliveries: {reason}");
                give_up_run(bus, &run, &reason).await;
                dead_letter(bus, spec, &message, &delivery, &reason).await;
                "dead_letter"
            }
            Err(HandlerError::Retry(error)) => {
                let reason = format!(
                    "gave up after {attempt} deliveries: {}",
                    chain(error.as_ref())
                );
                dead_letter(bus, spec, &message, &delivery, &reason).await;
                "dead_letter"
            }
            Err(HandlerError::DeadLetter(error)) => {
                let reason = chain(error.as_ref());
                dead_letter(bus, spec, &message, &delivery, &reason).await;
                "dead_letter"
            }
        }
    }
    .instrument(span)
    .await;
    bus.metrics()
        .messages_handled
        .get_or_create(&ConsumerOutcome {
            consumer: spec.durable.clone(),
            outcome,
        })
        .inc();
}

/// Tells everyone that this service gave up on a run: `run.failed` with the reason. A
/// failed publish is logged; the dead letter that follows still keeps the message.
async fn give_up_run(bus: &Bus, run: &arl_schemas::RunId, reason: &str) {
    let failed = arl_schemas::events::RunFailedV1 {
        run_id: run.clone(),
        failed_at: chrono::Utc::now(),
        service: bus.service_name().to_owned(),
        reason: reason.to_owned(),
    };
    if let Err(err) = bus.publish(&failed).await {
        tracing::error!(error = %err, %run, "cannot publish run.failed");
    }
}

async fn dead_letter(
    bus: &Bus,
    spec: &ConsumerSpec,
    message: &jetstream::Message,
    delivery: &Delivery,
    reason: &str,
) {
    match park(bus, spec.domain, &spec.durable, delivery, reason).await {
        Ok(()) => settle(message, AckKind::Term).await,
        // Not parked: leave it to be redelivered rather than lose it.
        Err(err) => {
            tracing::error!(error = %err, "cannot dead-letter; leaving message for redelivery");
            settle(message, AckKind::Nak(Some(Duration::from_secs(5)))).await;
        }
    }
}

/// Copies `delivery` to the dead-letter stream with `reason` (consumer `durable` of
/// `domain`'s stream gave up on it); the caller settles the original.
pub(crate) async fn park(
    bus: &Bus,
    domain: Domain,
    durable: &str,
    delivery: &Delivery,
    reason: &str,
) -> Result<(), BusError> {
    let stream = bus.namespace().stream(domain);
    let subject = bus.namespace().dead_letter_subject(&stream, durable);
    let mut headers = delivery.headers.clone().unwrap_or_default();
    // The dead-letter copy must not be de-duplicated against the original.
    headers.insert(
        headers::MSG_ID,
        format!("dlq:{stream}:{durable}:{}", delivery.stream_sequence).as_str(),
    );
    headers.insert(headers::DEAD_LETTER_REASON, truncate(reason, 1024).as_str());
    headers.insert(headers::ORIGINAL_SUBJECT, delivery.subject.as_str());
    tracing::error!(%reason, %subject, "dead-lettering message");
    bus.publish_bytes(subject, headers, delivery.payload.clone())
        .await
        .map(|_| ())
}

async fn settle(message: &jetstream::Message, kind: AckKind) {
    // A lost ack only means a redelivery, which handlers are written to absorb.
    if let Err(err) = message.double_ack_with(kind).await {
        tracing::warn!(error = %err, "acknowledgement not confirmed; the message may be redelivered");
    }
}

fn truncate(text: &str, max: usize) -> String {
    let single_line = text.replace(['\r', '\n'], " ");
    crate::text::head(&single_line, max).to_owned()
}
