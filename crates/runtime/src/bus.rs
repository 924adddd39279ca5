//! The NATS connection, JetStream provisioning and typed publishing.
//!
//! Every service gets one [`Bus`]. It reconnects by itself when the server restarts, and
//! [`Bus::publish`] does not return until JetStream has stored the event — retrying with the
//! same `Nats-Msg-Id` until then, so a publish that raced a server restart is stored
//! exactly once.

use std::time::{Duration, Instant};

use arl_schemas::{Bucket, Domain, Event, Namespace, ObjectStore, RunId};
use async_nats::HeaderMap;
use async_nats::jetstream::{self, kv, object_store, stream};
use bytes::Bytes;
use tokio::io::AsyncReadExt;

use crate::headers;
use crate::metrics::{EventTypeLabel, Metrics};
use crate::run_watch::RunWatch;

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error(
        "cannot connect to NATS at {url}: {source}; start a server (`nats-server -js`) or set NATS_URL"
    )]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    #[error("NATS credentials or TLS settings for {url}: {reason}")]
    Auth { url: String, reason: String },
    #[error("cannot provision {what}: {reason}")]
    Provision { what: String, reason: String },
    #[error(
        "the NATS server at {url}: {problem}; run `make deps` (it installs a current \
         nats-server into ~/.cache/arl/tools/bin, which `arl up` finds) or point NATS_URL at \
         a server {min} or newer"
    )]
    UnsupportedServer {
        url: String,
        problem: String,
        min: crate::nats_server::Version,
    },
    #[error("cannot encode {event_type}: {source}")]
    Encode {
        event_type: &'static str,
        source: serde_json::Error,
    },
    #[error("publish to {subject} was not acknowledged within {waited:?}: {last_error}")]
    PublishTimeout {
        subject: String,
        waited: Duration,
        last_error: String,
    },
    #[error("publish to {subject} refused: {reason}")]
    PublishRefused { subject: String, reason: String },
    #[error(
        "{event_type} is {bytes} bytes, over the {limit}-byte limit of one event (NATS's max_payload and the streams' max_msg_size)"
    )]
    TooLarge {
        event_type: &'static str,
        bytes: usize,
        limit: usize,
    },
    #[error(
        "publish to {subject} refused: its stream is full ({reason}); consumers must catch up \
         or the operator must raise --stream-max-bytes (ARL_STREAM_MAX_BYTES)"
    )]
    StreamFull { subject: String, reason: String },
    #[error("reading back {filter}: {reason}")]
    Replay { filter: String, reason: String },
    #[error("reading message {sequence} of stream {stream}: {reason}")]
    ReadAt {
        stream: String,
        sequence: u64,
        reason: String,
    },
    #[error("ordered feed {durable} of stream {stream}: {reason}")]
    Feed {
        stream: String,
        durable: String,
        reason: String,
    },
    #[error("key-value {bucket}: {reason}")]
    KeyValue { bucket: String, reason: String },
    #[error("object store {store}, object {name}: {reason}")]
    Object {
        store: String,
        name: String,
        reason: String,
    },
}

/// Where JetStream stored a published message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    pub stream: String,
    pub sequence: u64,
    /// True when JetStream already held a message with the same id.
    pub duplicate: bool,
}

/// How to reach NATS.
#[derive(Clone, Debug)]
pub struct BusConfig {
    pub url: String,
    pub namespace: Namespace,
    /// Shown in the server's connection list.
    pub client_name: String,
    /// Services wait for a server that is not up yet; the CLI fails fast.
    pub wait_for_server: bool,
    /// How long a publish keeps retrying before it reports failure.
    pub publish_timeout: Duration,
    /// Credentials and TLS.
    pub auth: crate::auth::NatsAuth,
    /// Copies JetStream keeps of every stream, bucket and object store (3 in a cluster
    /// of three NATS servers, 1 on one server).
    pub stream_replicas: usize,
    /// Bytes each event stream may hold; a full stream refuses new events
    /// ([`BusError::StreamFull`]) rather than dropping old ones. None: only the age limit.
    pub stream_max_bytes: Option<u64>,
}

impl BusConfig {
    pub fn new(
        url: impl Into<String>,
        namespace: Namespace,
        client_name: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            namespace,
            client_name: client_name.into(),
            wait_for_server: true,
            publish_timeout: Duration::from_secs(60),
            auth: crate::auth::NatsAuth::default(),
            stream_replicas: 1,
            stream_max_bytes: None,
        }
    }
}

/// A connection to NATS and JetStream, scoped to one namespace. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Bus {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    namespace: Namespace,
    metrics: Metrics,
    publish_timeout: Duration,
    /// Copies of each stream, bucket and object store it provisions.
    stream_replicas: usize,
    /// Bytes each event stream may hold (None: no limit but age).
    stream_max_bytes: Option<u64>,
    /// The client name given at connect ("arl-rollout"): who speaks in `run.failed`.
    client_name: std::sync::Arc<str>,
    /// The server's URL without credentials, for errors.
    shown_url: std::sync::Arc<str>,
    /// Registered datasets read so far, by digest: immutable, so never stale; a few
    /// runs' worth, so thousands of trials of a run read the object store once.
    manifests: std::sync::Arc<
        std::sync::Mutex<Vec<std::sync::Arc<arl_schemas::dataset::DatasetManifestV1>>>,
    >,
    /// The process's one watch of `ARL_RUN_STATE`, started by the first wait.
    run_watch: std::sync::Arc<tokio::sync::OnceCell<std::sync::Arc<RunWatch>>>,
}

/// Messages kept per stream; old ones go first. Trajectories and LLM calls are large, so
/// streams are bounded by age and bytes rather than kept forever.
const STREAM_MAX_AGE: Duration = Duration::from_secs(14 * 24 * 3600);
/// The largest event stored: NATS's default `max_payload`, and every stream's
/// `max_msg_size`. A larger one is refused before it is sent ([`BusError::TooLarge`]), so
/// a huge diff or LLM call becomes a classed failure, never a retry loop.
pub const MAX_EVENT_BYTES: usize = 1 << 20;
/// Consumers one stream may hold. Stated rather than left to the server (whose default
/// is 1,000 since nats-server 2.15). What ARL holds per stream does not grow with trials in
/// flight: each service's durable consumers, one run-state watch per process
/// ([`Bus::await_run_state`]), and replay readers that delete theirs when done
/// ([`Bus::replay`]).
const STREAM_MAX_CONSUMERS: i32 = 4_096;
/// Window within which a repeated `Nats-Msg-Id` is dropped as a duplicate, for the events
/// of a run and its steps (few): as long as one may be published again, a trainer training
/// a step again after a restart included (no `weights.published` twice). The server holds
/// every id of a window in memory (~150 bytes each; see ARCHITECTURE.md's capacity model).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(10 * 60);
/// The window of the per-trial events (trials, their LLM calls, sandbox leases, grades,
/// trajectories: nearly every message, so nearly all of the server's id memory). NATS's
/// own default. Such an event is published again by a publish retried (at most the
/// publish timeout, 60 s) or by a handler redelivered after its replica died (the
/// consumer's `ack_wait`, 30–60 s, after the death). Their consumers are idempotent by the
/// trial's record in `ARL_TRIALS` and the trainer's slot admission, so a copy stored after
/// a longer outage is a duplicate in the stream, never one trained on or counted; LLM
/// calls are read at the stream sequence the proxy reported, never by scanning.
const PER_TRIAL_DUPLICATE_WINDOW: Duration = Duration::from_secs(2 * 60);

/// Whether a bucket's records expire once settled ([`Bus::settle_record`]): trial records,
/// one per trial attempt of every run.
fn expiring_records(bucket: Bucket) -> bool {
    bucket == Bucket::Trials
}

/// How long the marker of an expired record is kept (JetStream's limit markers, which
/// per-message TTL needs; nothing reads them). The shortest there is: nats-server 2.15
/// stored a rolled-up record's TTL as at least this.
const EXPIRED_RECORD_MARKER_TTL: Duration = Duration::from_secs(1);

/// The de-duplication window of a domain's stream.
pub fn duplicate_window(domain: Domain) -> Duration {
    match domain {
        Domain::Trial | Domain::Llm | Domain::Sandbox | Domain::Reward | Domain::Trajectory => {
            PER_TRIAL_DUPLICATE_WINDOW
        }
        Domain::Run
        | Domain::Task
        | Domain::Image
        | Domain::Train
        | Domain::Weights
        | Domain::Eval
        | Domain::DeadLetter => DUPLICATE_WINDOW,
    }
}

impl Bus {
    pub async fn connect(config: BusConfig, metrics: Metrics) -> Result<Self, BusError> {
        let mut options = async_nats::ConnectOptions::new()
            .name(&config.client_name)
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(5))
            .event_callback(|event| async move {
                match event {
                    async_nats::Event::Connected => tracing::info!("connected to NATS"),
                    async_nats::Event::Disconnected => tracing::warn!("disconnected from NATS"),
                    // An authorization or permissions violation: say so, not at debug.
                    async_nats::Event::ServerError(err) => {
                        tracing::error!(%err, "the NATS server refused this client (check its credentials and permissions)")
                    }
                    other => tracing::debug!(event = %other, "NATS event"),
                }
            });
        if config.wait_for_server {
            options = options.retry_on_initial_connect();
        }
        let shown_url = crate::auth::redact_url(&config.url);
        let options = config
            .auth
            .apply(options)
            .await
            .map_err(|err| BusError::Auth {
                url: shown_url.clone(),
                reason: err.to_string(),
            })?;
        let client = options
            .connect(config.url.as_str())
            .await
            .map_err(|source| BusError::Connect {
                url: shown_url.clone(),
                source,
            })?;
        let jetstream = jetstream::new(client.clone());
        Ok(Self {
            client,
            jetstream,
            namespace: config.namespace,
            metrics,
            publish_timeout: config.publish_timeout,
            stream_replicas: config.stream_replicas.max(1),
            stream_max_bytes: config.stream_max_bytes,
            client_name: config.client_name.as_str().into(),
            shown_url: shown_url.as_str().into(),
            manifests: Default::default(),
            run_watch: Default::default(),
        })
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// The service this connection speaks for (its client name, "arl-rollout").
    pub fn service_name(&self) -> &str {
        &self.client_name
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Refuses a server older than ARL needs ([`crate::nats_server::MIN_VERSION`]), whose
    /// JetStream answers the client cannot read. Waits up to 30 s for the first connection
    /// and the server's INFO (a service may start before its server); a server still
    /// unreachable then is left to the caller's next request to report.
    pub async fn check_server(&self) -> Result<(), BusError> {
        // The client may report itself connected a moment before it has stored the
        // server's INFO (an empty version): wait for both.
        let deadline = Instant::now() + Duration::from_secs(30);
        let reported = loop {
            let version = self.client.server_info().version;
            if self.is_connected() && !version.is_empty() {
                break version;
            }
            if Instant::now() > deadline {
                tracing::warn!("the NATS server's version is not known after 30 s; not checked");
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        match crate::nats_server::problem(&reported) {
            None => Ok(()),
            Some(problem) => Err(BusError::UnsupportedServer {
                url: self.shown_url.to_string(),
                problem,
                min: crate::nats_server::MIN_VERSION,
            }),
        }
    }

    /// Creates or updates every stream and bucket of the namespace. Idempotent: every
    /// service calls it at start, in any order.
    pub async fn provision(&self) -> Result<(), BusError> {
        self.check_server().await?;
        for domain in Domain::ALL {
            self.provision_stream(domain).await?;
        }
        self.provision_bucket(Bucket::RunState).await?;
        self.provision_bucket(Bucket::EvalState).await?;
        self.provision_bucket(Bucket::Trials).await?;
        self.provision_bucket(Bucket::Trainers).await?;
        for store in ObjectStore::ALL {
            self.provision_object_store(store).await?;
        }
        Ok(())
    }

    /// An object store's stream is its own (`OBJ_<bucket>`): objects are split into
    /// 128 KiB chunks, each one message, so [`MAX_EVENT_BYTES`] and the event streams'
    /// `max_msg_size` do not apply and a file of any size fits. No age limit: the owner
    /// deletes what it no longer needs (the trainer prunes old weights versions).
    async fn provision_object_store(&self, store: ObjectStore) -> Result<(), BusError> {
        let name = self.namespace.object_store(store);
        let config = object_store::Config {
            bucket: name.clone(),
            storage: stream::StorageType::File,
            num_replicas: self.stream_replicas,
            ..Default::default()
        };
        retry_provision(&name, || async {
            if self.jetstream.get_object_store(&name).await.is_ok() {
                return Ok(());
            }
            self.jetstream
                .create_object_store(config.clone())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .await?;
        Ok(())
    }

    pub(crate) async fn object_store(
        &self,
        store: ObjectStore,
    ) -> Result<object_store::ObjectStore, BusError> {
        let name = self.namespace.object_store(store);
        retry_provision(&name, || self.jetstream.get_object_store(name.clone())).await
    }

    /// Stores `bytes` as object `name`, unless an object of that name is already there
    /// (names are content digests, so an existing one holds the same bytes). Returns
    /// true when this call stored it.
    pub async fn put_object(
        &self,
        store: ObjectStore,
        name: &str,
        bytes: &[u8],
    ) -> Result<bool, BusError> {
        let objects = self.object_store(store).await?;
        let error = |reason: String| BusError::Object {
            store: self.namespace.object_store(store),
            name: name.to_owned(),
            reason,
        };
        match objects.info(name).await {
            Ok(_) => return Ok(false),
            Err(err) if err.kind() == object_store::InfoErrorKind::NotFound => {}
            Err(err) => return Err(error(err.to_string())),
        }
        let mut reader = bytes;
        objects
            .put(name, &mut reader)
            .await
            .map_err(|e| error(e.to_string()))?;
        Ok(true)
    }

    /// The bytes of object `name`, or `None` when there is no such object.
    pub async fn get_object(
        &self,
        store: ObjectStore,
        name: &str,
    ) -> Result<Option<Vec<u8>>, BusError> {
        let objects = self.object_store(store).await?;
        let error = |reason: String| BusError::Object {
            store: self.namespace.object_store(store),
            name: name.to_owned(),
            reason,
        };
        let mut object = match objects.get(name).await {
            Ok(object) => object,
            Err(err) if err.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(error(err.to_string())),
        };
        let mut bytes = Vec::new();
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| error(e.to_string()))?;
        Ok(Some(bytes))
    }

    async fn provision_stream(&self, domain: Domain) -> Result<(), BusError> {
        let name = self.namespace.stream(domain);
        let config = stream::Config {
            name: name.clone(),
            subjects: vec![self.namespace.stream_subjects(domain)],
            storage: stream::StorageType::File,
            num_replicas: self.stream_replicas,
            retention: stream::RetentionPolicy::Limits,
            max_age: STREAM_MAX_AGE,
            duplicate_window: duplicate_window(domain),
            max_message_size: MAX_EVENT_BYTES as i32,
            // Full: refuse new events (publishers back off and retry) rather than drop
            // old ones a consumer has not read yet. JetStream reserves the bytes on disk
            // when the stream is made, so a limit the server cannot hold fails here.
            max_bytes: self
                .stream_max_bytes
                .map_or(-1, |bytes| i64::try_from(bytes).unwrap_or(i64::MAX)),
            discard: stream::DiscardPolicy::New,
            max_consumers: STREAM_MAX_CONSUMERS,
            ..Default::default()
        };
        retry_provision(&name, || async {
            // A stream that is there as configured is left alone: under least privilege
            // (`arl_schemas::permissions`) only the controller may update one.
            let Ok(mut existing) = self.jetstream.get_stream(&name).await else {
                // Missing: create it (another service may do so at the same moment; the
                // retry then finds it).
                return self
                    .jetstream
                    .create_stream(config.clone())
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string());
            };
            let info = existing.info().await.map_err(|e| e.to_string())?;
            let current = &info.config;
            if current.subjects == config.subjects
                && current.max_age == config.max_age
                && current.duplicate_window == config.duplicate_window
                && current.max_message_size == config.max_message_size
                && current.num_replicas == config.num_replicas
                && current.max_bytes == config.max_bytes
                && current.discard == config.discard
                && current.max_consumers == config.max_consumers
            {
                return Ok(());
            }
            self.jetstream
                .update_stream(config.clone())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .await?;
        Ok(())
    }

    async fn provision_bucket(&self, bucket: Bucket) -> Result<(), BusError> {
        let name = self.namespace.bucket(bucket);
        let config = kv::Config {
            bucket: name.clone(),
            history: 16,
            storage: stream::StorageType::File,
            num_replicas: self.stream_replicas,
            // Announcements are alive only while refreshed.
            max_age: if bucket == Bucket::Trainers {
                Duration::from_secs(arl_schemas::state::TRAINER_TTL_SECONDS)
            } else {
                Duration::ZERO
            },
            // Records that expire ([`Bus::settle_record`]) need per-message TTL.
            limit_markers: expiring_records(bucket).then_some(EXPIRED_RECORD_MARKER_TTL),
            ..Default::default()
        };
        retry_provision(&name, || async {
            if self.jetstream.get_key_value(&name).await.is_ok() {
                if expiring_records(bucket) {
                    self.allow_record_ttl(&config).await;
                }
                return Ok(());
            }
            match self.jetstream.create_key_value(config.clone()).await {
                // nats-server 2.10 has no per-message TTL: such records are kept.
                Err(e) if e.kind() == jetstream::context::CreateKeyValueErrorKind::LimitMarkersNotSupported => {
                    let kept = kv::Config {
                        limit_markers: None,
                        ..config.clone()
                    };
                    self.jetstream.create_key_value(kept).await.map(|_| ())
                }
                other => other.map(|_| ()),
            }
            .map_err(|e| e.to_string())
        })
        .await?;
        Ok(())
    }

    /// Turns on per-message TTL in a bucket made without it (before records of it
    /// expired). Under least privilege only the controller may; until it has, settled
    /// records are kept (see [`Bus::settle_record`]).
    async fn allow_record_ttl(&self, config: &kv::Config) {
        let stream = format!("KV_{}", config.bucket);
        // `get_stream` reads the stream's info: its configuration is at hand.
        let allowed = match self.jetstream.get_stream(&stream).await {
            Ok(s) => s.cached_info().config.allow_message_ttl,
            Err(err) => {
                tracing::debug!(%err, %stream, "bucket's stream not read");
                return;
            }
        };
        if !allowed {
            match self.jetstream.update_key_value(config.clone()).await {
                Ok(_) => tracing::info!(bucket = %config.bucket, "per-message TTL turned on"),
                Err(err) => {
                    tracing::debug!(%err, bucket = %config.bucket, "per-message TTL left off")
                }
            }
        }
    }

    /// The keys `bucket` holds a value under (deleted and purged ones left out).
    pub async fn bucket_keys(&self, bucket: Bucket) -> Result<Vec<String>, BusError> {
        self.keys_of(&self.bucket(bucket).await?, bucket).await
    }

    /// [`Bus::bucket_keys`] of a store already opened.
    async fn keys_of(&self, kv: &kv::Store, bucket: Bucket) -> Result<Vec<String>, BusError> {
        use futures::TryStreamExt;
        let error = |reason: String| BusError::KeyValue {
            bucket: self.namespace.bucket(bucket),
            reason: format!("listing its keys: {reason}"),
        };
        kv.keys()
            .await
            .map_err(|e| error(e.to_string()))?
            .try_collect()
            .await
            .map_err(|e| error(e.to_string()))
    }

    /// Every run the run-state bucket holds a state for.
    pub async fn run_ids(&self) -> Result<Vec<RunId>, BusError> {
        Ok(self
            .bucket_keys(Bucket::RunState)
            .await?
            .into_iter()
            .filter_map(|key| RunId::new(key).ok())
            .collect())
    }

    /// The key-value store of a bucket (provisioned by [`Bus::provision`]). Waits for
    /// JetStream if the server is still starting.
    pub async fn bucket(&self, bucket: Bucket) -> Result<kv::Store, BusError> {
        let name = self.namespace.bucket(bucket);
        retry_provision(&name, || self.jetstream.get_key_value(name.clone()))
            .await
            .map_err(|err| BusError::KeyValue {
                bucket: name.clone(),
                reason: format!("{err}; has a service provisioned the namespace?"),
            })
    }

    /// Reads a JSON record of a bucket, lets `change` edit it (`None` = absent; return
    /// false to leave it), and writes it back with compare-and-set, retrying when another
    /// writer got there first. Returns the record as stored.
    pub async fn modify_record<T>(
        &self,
        bucket: Bucket,
        key: &str,
        change: impl FnMut(&mut Option<T>) -> bool,
    ) -> Result<Option<T>, BusError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
    {
        self.write_record(bucket, key, change, None).await
    }

    /// As [`Bus::modify_record`], for a record's last write: its earlier revisions are
    /// rolled up into it, and it expires `keep_for` later (then the key reads as absent and
    /// the server forgets it: records of finished work do not pile up for ever). In a
    /// bucket made without per-message TTL, until the controller has turned it on, the
    /// record is rolled up and kept.
    pub async fn settle_record<T>(
        &self,
        bucket: Bucket,
        key: &str,
        change: impl FnMut(&mut Option<T>) -> bool,
        keep_for: Duration,
    ) -> Result<Option<T>, BusError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
    {
        self.write_record(bucket, key, change, Some(keep_for)).await
    }

    async fn write_record<T>(
        &self,
        bucket: Bucket,
        key: &str,
        mut change: impl FnMut(&mut Option<T>) -> bool,
        expire_after: Option<Duration>,
    ) -> Result<Option<T>, BusError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
    {
        let kv = self.bucket(bucket).await?;
        let error = |reason: String| BusError::KeyValue {
            bucket: self.namespace.bucket(bucket),
            reason: format!("{key}: {reason}"),
        };
        for _ in 0..64 {
            let entry = kv.entry(key).await.map_err(|e| error(e.to_string()))?;
            let (mut record, revision) = match entry {
                Some(entry) if entry.operation == kv::Operation::Put => (
                    Some(
                        serde_json::from_slice::<T>(&entry.value)
                            .map_err(|e| error(format!("unreadable record: {e}")))?,
                    ),
                    entry.revision,
                ),
                Some(entry) => (None, entry.revision),
                None => (None, 0),
            };
            if !change(&mut record) {
                return Ok(record);
            }
            let Some(value) = &record else {
                return Ok(None);
            };
            let body = serde_json::to_vec(value).map_err(|e| error(e.to_string()))?;
            let written = if let Some(keep_for) = expire_after {
                self.write_expiring(bucket, key, revision, body.into(), keep_for)
                    .await
            } else if revision == 0 {
                kv.create(key, body.into()).await.map(|_| ()).map_err(|e| {
                    (
                        e.kind() == kv::CreateErrorKind::AlreadyExists,
                        e.to_string(),
                    )
                })
            } else {
                kv.update(key, body.into(), revision)
                    .await
                    .map(|_| ())
                    .map_err(|e| {
                        (
                            e.kind() == kv::UpdateErrorKind::WrongLastRevision,
                            e.to_string(),
                        )
                    })
            };
            match written {
                Ok(()) => return Ok(record),
                Err((true, _)) => continue,
                Err((false, reason)) => return Err(error(reason)),
            }
        }
        Err(error("too many concurrent writers".into()))
    }

    /// Writes a record over revision `revision` (0: none), rolling up its earlier
    /// revisions, to expire after `keep_for`. Err((true, _)): another writer got there
    /// first.
    async fn write_expiring(
        &self,
        bucket: Bucket,
        key: &str,
        revision: u64,
        body: Bytes,
        keep_for: Duration,
    ) -> Result<(), (bool, String)> {
        use async_nats::header::{
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_TTL, NATS_ROLLUP,
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            revision.to_string().as_str(),
        );
        headers.insert(NATS_ROLLUP, "sub");
        let kept = headers.clone();
        headers.insert(
            NATS_MESSAGE_TTL,
            keep_for.as_secs().max(1).to_string().as_str(),
        );
        let subject = self.namespace.record_subject(bucket, key);
        let publish = async |headers: HeaderMap| {
            let ack = self
                .jetstream
                .publish_with_headers(subject.clone(), headers, body.clone())
                .await
                .map_err(|e| (false, e.to_string()))?;
            ack.await.map(|_| ()).map_err(|e| {
                (
                    e.kind() == jetstream::context::PublishErrorKind::WrongLastSequence,
                    e.to_string(),
                )
            })
        };
        match publish(headers).await {
            // A bucket made before its records expired (per-message TTL off).
            Err((false, reason)) if reason.contains("TTL") => {
                tracing::debug!(%reason, %subject, "record kept: the bucket has no per-message TTL");
                publish(kept).await
            }
            other => other,
        }
    }

    /// Writes (or refreshes) a trainer's announcement in `ARL_TRAINERS`.
    pub async fn announce_trainer(
        &self,
        announcement: &arl_schemas::state::TrainerAnnouncementV1,
    ) -> Result<(), BusError> {
        let kv = self.bucket(Bucket::Trainers).await?;
        let error = |reason: String| BusError::KeyValue {
            bucket: self.namespace.bucket(Bucket::Trainers),
            reason: format!("{}: {reason}", announcement.instance),
        };
        let body = announcement.encode().map_err(|e| error(e.to_string()))?;
        kv.put(&announcement.instance, body.into())
            .await
            .map_err(|e| error(e.to_string()))?;
        Ok(())
    }

    /// The announcements of every live trainer (refreshed within the bucket's TTL).
    pub async fn live_trainers(
        &self,
    ) -> Result<Vec<arl_schemas::state::TrainerAnnouncementV1>, BusError> {
        let kv = self.bucket(Bucket::Trainers).await?;
        let error = |reason: String| BusError::KeyValue {
            bucket: self.namespace.bucket(Bucket::Trainers),
            reason,
        };
        let mut live = Vec::new();
        for key in self.keys_of(&kv, Bucket::Trainers).await? {
            let entry = kv.entry(&key).await.map_err(|e| error(e.to_string()))?;
            if let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) {
                let announcement = arl_schemas::state::TrainerAnnouncementV1::decode(&entry.value)
                    .map_err(|e| error(format!("{key}: unreadable announcement: {e}")))?;
                live.push(announcement);
            }
        }
        Ok(live)
    }

    /// The value under `key` in `bucket`, decoded; None when absent, deleted or purged.
    /// `what` names it in errors ("run X"), `noun` its kind ("state").
    async fn read_value<T, E: std::fmt::Display>(
        &self,
        bucket: Bucket,
        key: &str,
        what: &str,
        noun: &str,
        decode: impl FnOnce(&[u8]) -> Result<T, E>,
    ) -> Result<Option<T>, BusError> {
        let kv = self.bucket(bucket).await?;
        let error = |reason: String| BusError::KeyValue {
            bucket: self.namespace.bucket(bucket),
            reason: format!("{what}: {reason}"),
        };
        let entry = kv.entry(key).await.map_err(|e| error(e.to_string()))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(None);
        };
        decode(&entry.value)
            .map(Some)
            .map_err(|e| error(format!("unreadable {noun}: {e}")))
    }

    /// A JSON record of a bucket (as [`Bus::modify_record`] writes them); None when absent.
    pub async fn get_record<T: serde::de::DeserializeOwned>(
        &self,
        bucket: Bucket,
        key: &str,
    ) -> Result<Option<T>, BusError> {
        self.read_value(bucket, key, key, "record", |bytes| {
            serde_json::from_slice(bytes)
        })
        .await
    }

    /// What a handler needs to know about a run: its state and its spec. A run without a
    /// state waits (retried, then dead-lettered with the reason: a run deleted mid-run
    /// has none); one whose state has no spec was never accepted. Never a default spec.
    pub async fn run_context(
        &self,
        run: &arl_schemas::RunId,
    ) -> Result<crate::RunContext, crate::HandlerError> {
        let state = self
            .run_state(run)
            .await?
            .ok_or_else(|| crate::HandlerError::RunGone {
                run: run.clone(),
                reason: format!(
                    "run {run} has no state in {} (not written yet, or deleted mid-run)",
                    self.namespace.bucket(Bucket::RunState)
                ),
            })?;
        let spec = state.spec.clone().ok_or_else(|| {
            crate::HandlerError::dead_letter(format!(
                "run {run} has no spec in its state (status {}); it was never accepted",
                state.status.as_str()
            ))
        })?;
        Ok(crate::RunContext { state, spec })
    }

    /// A trial's entry in `ARL_TRIALS` (the rollout service's claim on its attempts).
    pub async fn trial_record(
        &self,
        trial: &arl_schemas::TrialId,
    ) -> Result<Option<arl_schemas::state::TrialRecordV2>, BusError> {
        self.read_value(
            Bucket::Trials,
            trial.as_str(),
            &format!("trial {trial}"),
            "record",
            |bytes| serde_json::from_slice(bytes),
        )
        .await
    }

    /// Refuses an event about a trial the rollout service never requested: one whose
    /// attempt was never claimed in `ARL_TRIALS`. Its author is not the rollout service.
    /// `published`: when JetStream stored the event. A done attempt's entry expires
    /// ([`arl_schemas::state::DONE_TRIAL_RECORD_KEPT_SECONDS`] after it was done, which is
    /// after the rollout published its events), so no entry proves "never requested" only
    /// for an event younger than that; an older one (a trainer or grader that was down a
    /// while) is let through rather than lost.
    pub async fn check_requested(
        &self,
        trial: &arl_schemas::TrialId,
        attempt: u32,
        what: &str,
        published: std::time::SystemTime,
    ) -> Result<(), crate::HandlerError> {
        let record = self.trial_record(trial).await?;
        if arl_schemas::state::TrialRecordV2::requested(record.as_ref(), attempt) {
            return Ok(());
        }
        let kept = Duration::from_secs(arl_schemas::state::DONE_TRIAL_RECORD_KEPT_SECONDS);
        let age = published.elapsed().unwrap_or_default();
        if record.is_none() && age >= kept {
            tracing::debug!(%trial, attempt, age_s = age.as_secs(), "{what} older than a done trial's entry lives; its entry may have expired");
            return Ok(());
        }
        Err(crate::HandlerError::dead_letter(format!(
            "{what} for trial {trial} attempt {attempt}, which the rollout service never requested (ARL_TRIALS has {}); refused",
            match record {
                Some(r) => format!("attempt {}", r.attempt),
                None => "no entry".into(),
            }
        )))
    }

    /// The controller's record of a run (`ARL_RUN_STATE`), if it has one (a deleted or
    /// purged run has none).
    pub async fn run_state(
        &self,
        run: &arl_schemas::RunId,
    ) -> Result<Option<arl_schemas::state::RunStateV1>, BusError> {
        self.read_value(
            Bucket::RunState,
            run.as_str(),
            &format!("run {run}"),
            "state",
            arl_schemas::state::RunStateV1::decode,
        )
        .await
    }

    /// Waits until the run's state satisfies `ready` and returns that state — or the
    /// latest one seen, if `limit` passes first (the caller tells by asking `ready`
    /// again). `None`: the run has no state. No polling: every wait in the process shares
    /// one watch of the bucket ([`crate::run_watch`]), so thousands of waiting trials hold
    /// one JetStream consumer, not one each.
    pub async fn await_run_state(
        &self,
        run: &arl_schemas::RunId,
        limit: Duration,
        ready: impl Fn(&arl_schemas::state::RunStateV1) -> bool,
    ) -> Result<Option<arl_schemas::state::RunStateV1>, BusError> {
        let bucket = Bucket::RunState;
        let kv = self.bucket(bucket).await?;
        let watch = self
            .run_watch
            .get_or_init(|| async { RunWatch::start(kv.clone()) })
            .await;
        let mut subscription = watch.subscribe(run.as_str());
        // The state before the subscription: read once, after subscribing, so that no
        // update falls between the two.
        let entry = kv
            .entry(run.as_str())
            .await
            .map_err(|e| BusError::KeyValue {
                bucket: self.namespace.bucket(bucket),
                reason: format!("run {run}: {e}"),
            })?;
        if let Some(entry) = entry {
            watch.apply(&entry);
        }
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let latest = subscription.updates.borrow_and_update().state.clone();
            if latest.as_ref().is_some_and(&ready) {
                return Ok(latest);
            }
            match tokio::time::timeout_at(deadline, subscription.updates.changed()).await {
                Ok(Ok(())) => continue,
                // The limit, or the watch gone with the process's last Bus handle.
                Err(_) | Ok(Err(_)) => return Ok(latest),
            }
        }
    }

    /// How many runs this process's tasks are waiting on ([`Bus::await_run_state`]); for
    /// tests that check waits leave nothing behind.
    pub fn awaited_runs(&self) -> usize {
        self.run_watch
            .get()
            .map_or(0, |watch| watch.awaited_count())
    }

    /// A registered dataset (`ARL_DATASETS`) by digest, if there is one (read once per
    /// process and digest).
    pub async fn dataset_manifest(
        &self,
        digest: &str,
    ) -> Result<Option<std::sync::Arc<arl_schemas::dataset::DatasetManifestV1>>, BusError> {
        let cached = {
            let manifests = self.manifests.lock().unwrap_or_else(|e| e.into_inner());
            manifests.iter().find(|m| m.digest == digest).cloned()
        };
        if cached.is_some() {
            return Ok(cached);
        }
        let Some(bytes) = self.get_object(ObjectStore::Datasets, digest).await? else {
            return Ok(None);
        };
        let manifest: arl_schemas::dataset::DatasetManifestV1 = serde_json::from_slice(&bytes)
            .map_err(|e| BusError::Object {
                store: self.namespace.object_store(ObjectStore::Datasets),
                name: digest.to_owned(),
                reason: format!("unreadable manifest: {e}"),
            })?;
        let manifest = std::sync::Arc::new(manifest);
        let mut manifests = self.manifests.lock().unwrap_or_else(|e| e.into_inner());
        if manifests.len() >= 8 {
            manifests.remove(0);
        }
        manifests.push(manifest.clone());
        Ok(Some(manifest))
    }

    /// Publishes a typed event and waits until JetStream has stored it.
    pub async fn publish<E: Event>(&self, event: &E) -> Result<Published, BusError> {
        let body = event.encode().map_err(|source| BusError::Encode {
            event_type: E::TYPE,
            source,
        })?;
        let limit = self.max_event_bytes();
        if body.len() > limit {
            return Err(BusError::TooLarge {
                event_type: E::TYPE,
                bytes: body.len(),
                limit,
            });
        }
        let mut headers = HeaderMap::new();
        headers.insert(headers::MSG_ID, event.message_id().as_str());
        headers.insert(headers::EVENT_TYPE, E::TYPE);
        headers.insert(headers::EVENT_VERSION, E::VERSION.to_string().as_str());
        crate::telemetry::inject_context(&mut headers);
        let published = self
            .publish_bytes(event.subject(&self.namespace), headers, body.into())
            .await?;
        self.metrics
            .events_published
            .get_or_create(&EventTypeLabel {
                event_type: E::TYPE,
            })
            .inc();
        Ok(published)
    }

    /// The largest event this bus stores: [`MAX_EVENT_BYTES`], or the server's smaller
    /// `max_payload`.
    pub fn max_event_bytes(&self) -> usize {
        let server = self.client.server_info().max_payload;
        if server == 0 {
            MAX_EVENT_BYTES
        } else {
            MAX_EVENT_BYTES.min(server)
        }
    }

    /// Reads every stored event of type `E` on subjects matching `filter` in `domain`'s
    /// stream, oldest first. Events that do not decode are skipped with a warning. For
    /// status views, tests, and reads by an exact subject (a trial's calls, a step's
    /// batch); services consume with [`crate::consumer::run_consumer`].
    pub async fn replay<E: Event>(
        &self,
        domain: Domain,
        filter: String,
    ) -> Result<Vec<E>, BusError> {
        use async_nats::jetstream::consumer::{self, pull};
        let fail = |reason: String| BusError::Replay {
            filter: filter.clone(),
            reason,
        };
        let config = pull::Config {
            filter_subject: filter.clone(),
            ack_policy: consumer::AckPolicy::None,
            deliver_policy: consumer::DeliverPolicy::All,
            // Deleted below once read; this bounds the life of one whose reader died.
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        };
        let stream = self.namespace.stream(domain);
        let consumer: consumer::Consumer<pull::Config> = self
            .jetstream
            .create_consumer_on_stream(config, stream.as_str())
            .await
            .map_err(|e| fail(e.to_string()))?;
        let name = consumer.cached_info().name.clone();
        let read = read_all(&consumer, consumer.cached_info().num_pending).await;
        // Streams hold a limited number of consumers (1,000 by default): one left for
        // its 30 s of inactivity per trajectory hand-off capped the trials in flight.
        if let Err(err) = self
            .jetstream
            .delete_consumer_from_stream(&name, stream.as_str())
            .await
        {
            tracing::debug!(%err, consumer = %name, "replay consumer left to expire");
        }
        let messages = read.map_err(fail)?;
        Ok(messages
            .into_iter()
            .filter_map(|message| match E::decode(&message.payload) {
                Ok(event) => Some(event),
                Err(err) => {
                    tracing::warn!(subject = %message.subject, %err, "skipping undecodable event");
                    None
                }
            })
            .collect())
    }

    /// The event stored at `sequence` of `domain`'s stream (where a publish said it was
    /// stored), read without a consumer: an attempt's LLM calls, as the proxy reported them.
    /// An error when the stream no longer holds it or it is not an `E`.
    pub async fn read_at<E: Event>(&self, domain: Domain, sequence: u64) -> Result<E, BusError> {
        let stream = self.namespace.stream(domain);
        let fail = |reason: String| BusError::ReadAt {
            stream: stream.clone(),
            sequence,
            reason,
        };
        let message = self
            .jetstream
            .get_stream_no_info(stream.as_str())
            .await
            .map_err(|e| fail(e.to_string()))?
            .get_raw_message(sequence)
            .await
            .map_err(|e| fail(e.to_string()))?;
        E::decode(&message.payload).map_err(|e| {
            fail(format!(
                "{} is not a {} event: {e}",
                message.subject,
                E::TYPE
            ))
        })
    }

    /// Publishes raw bytes with the given headers, retrying until stored. For events use
    /// [`Bus::publish`]; this exists for dead-lettering and for tests that must send bytes
    /// no typed event would produce.
    pub async fn publish_bytes(
        &self,
        subject: String,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Published, BusError> {
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        loop {
            let attempt = async {
                let ack = self
                    .jetstream
                    .publish_with_headers(subject.clone(), headers.clone(), body.clone())
                    .await
                    .map_err(|err| (err.kind(), err.to_string()))?;
                ack.await.map_err(|err| (err.kind(), err.to_string()))
            };
            let last_error = match attempt.await {
                Ok(ack) => {
                    return Ok(Published {
                        stream: ack.stream,
                        sequence: ack.sequence,
                        duplicate: ack.duplicate,
                    });
                }
                Err((jetstream::context::PublishErrorKind::MaxPayloadExceeded, reason)) => {
                    return Err(BusError::PublishRefused { subject, reason });
                }
                Err((_, reason)) if reason.contains("maximum bytes exceeded") => {
                    return Err(BusError::StreamFull { subject, reason });
                }
                Err((_, reason)) => reason,
            };
            let waited = started.elapsed();
            if waited >= self.publish_timeout {
                return Err(BusError::PublishTimeout {
                    subject,
                    waited,
                    last_error,
                });
            }
            tracing::warn!(%subject, error = %last_error, "publish not acknowledged; retrying");
            self.metrics.publish_retries.inc();
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }
}

/// Every message a fresh replay consumer has pending: `pending` at its creation, then
/// until a delivered message says none is left. (Waiting for an empty fetch instead cost
/// every read its fetch timeout.)
async fn read_all(
    consumer: &jetstream::consumer::Consumer<jetstream::consumer::pull::Config>,
    pending: u64,
) -> Result<Vec<async_nats::Message>, String> {
    use futures::StreamExt;
    let mut messages = Vec::new();
    let mut left = pending;
    while left > 0 {
        let mut batch = consumer
            .fetch()
            .max_messages(left.min(512) as usize)
            .expires(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| e.to_string())?;
        let mut received = 0;
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| e.to_string())?;
            received += 1;
            left = message.info().map_err(|e| e.to_string())?.pending;
            messages.push(message.message);
        }
        if received == 0 {
            return Err(format!(
                "the server delivered nothing in 5 s with {left} events still pending"
            ));
        }
    }
    Ok(messages)
}

async fn retry_provision<T, E, F, Fut>(what: &str, mut create: F) -> Result<T, BusError>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    // JetStream may still be starting (or electing a leader) when a service starts.
    let mut delay = Duration::from_millis(100);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match create().await {
            Ok(value) => return Ok(value),
            Err(err) if Instant::now() < deadline => {
                tracing::warn!(%what, error = %err, "provisioning failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(err) => {
                return Err(BusError::Provision {
                    what: what.to_owned(),
                    reason: err.to_string(),
                });
            }
        }
    }
}
