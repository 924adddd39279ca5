//! Subject, stream, consumer and bucket names. Every name used on the bus is built here;
//! call sites never `format!` a subject.
//!
//! Subjects are `{prefix}arl.<domain>.<run_id>.<event>`, never a token per trial or other
//! entity (nats-server keeps state per subject for as long as a stream holds its
//! messages); streams are `{PREFIX}ARL_<DOMAIN>`.
//! The prefix isolates tests (and tenants) that share one NATS server.

use crate::ids::RunId;

/// The parts of the pipeline, one stream each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Domain {
    Run,
    Task,
    Image,
    Sandbox,
    Trial,
    Llm,
    Trajectory,
    Reward,
    Train,
    Weights,
    Eval,
    DeadLetter,
}

impl Domain {
    pub const ALL: [Domain; 12] = [
        Domain::Run,
        Domain::Task,
        Domain::Image,
        Domain::Sandbox,
        Domain::Trial,
        Domain::Llm,
        Domain::Trajectory,
        Domain::Reward,
        Domain::Train,
        Domain::Weights,
        Domain::Eval,
        Domain::DeadLetter,
    ];

    /// The subject token of the domain.
    pub fn token(self) -> &'static str {
        match self {
            Domain::Run => "run",
            Domain::Task => "task",
            Domain::Image => "image",
            Domain::Sandbox => "sandbox",
            Domain::Trial => "trial",
            Domain::Llm => "llm",
            Domain::Trajectory => "trajectory",
            Domain::Reward => "reward",
            Domain::Train => "train",
            Domain::Weights => "weights",
            Domain::Eval => "eval",
            Domain::DeadLetter => "dlq",
        }
    }

    fn stream_suffix(self) -> &'static str {
        match self {
            Domain::Run => "RUNS",
            Domain::Task => "TASKS",
            Domain::Image => "IMAGES",
            Domain::Sandbox => "SANDBOXES",
            Domain::Trial => "TRIALS",
            Domain::Llm => "LLM_CALLS",
            Domain::Trajectory => "TRAJECTORIES",
            Domain::Reward => "REWARDS",
            Domain::Train => "TRAIN",
            Domain::Weights => "WEIGHTS",
            Domain::Eval => "EVALS",
            Domain::DeadLetter => "DLQ",
        }
    }
}

/// Key-value buckets that hold state services must find again after a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bucket {
    /// The controller's view of each run, keyed by run id.
    RunState,
    /// The evaluator's tally of each evaluation, keyed `<run_id>.<step>`.
    EvalState,
    /// The rollout service's record of each trial (attempt, phase), keyed by trial id, and
    /// failed groups, keyed `group.<run_id>.<step>.<split>.<task index>`.
    Trials,
    /// Live trainers' announcements ([`crate::state::TrainerAnnouncementV1`]), keyed by
    /// instance; entries expire [`crate::state::TRAINER_TTL_SECONDS`] after their last refresh.
    Trainers,
}

/// JetStream object stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectStore {
    /// Registered datasets ([`crate::dataset::DatasetManifestV1`]), named by digest.
    Datasets,
    /// Policy versions for engines on other machines: one object per file of a version
    /// folder, named [`ObjectStore::weights_object`]. The trainer writes (and prunes) it,
    /// engines read it.
    Weights,
}

impl ObjectStore {
    pub const ALL: [ObjectStore; 2] = [ObjectStore::Datasets, ObjectStore::Weights];

    fn suffix(self) -> &'static str {
        match self {
            ObjectStore::Datasets => "ARL_DATASETS",
            ObjectStore::Weights => "ARL_WEIGHTS",
        }
    }

    /// `<run_id>/<policy_version>/`: the objects of one policy version in `ARL_WEIGHTS`.
    pub fn weights_prefix(run_id: &RunId, policy_version: u64) -> String {
        format!("{run_id}/{policy_version}/")
    }

    /// `<run_id>/<policy_version>/<file>`: one file of a policy version in `ARL_WEIGHTS`.
    pub fn weights_object(run_id: &RunId, policy_version: u64, file: &str) -> String {
        format!("{}{file}", Self::weights_prefix(run_id, policy_version))
    }
}

impl Bucket {
    fn suffix(self) -> &'static str {
        match self {
            Bucket::RunState => "ARL_RUN_STATE",
            Bucket::EvalState => "ARL_EVAL_STATE",
            Bucket::Trials => "ARL_TRIALS",
            Bucket::Trainers => "ARL_TRAINERS",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "namespace prefix {0:?} is invalid: use 1-32 lowercase ASCII letters, digits or '_', starting with a letter"
)]
pub struct NamespaceError(String);

/// The root of all names. `Namespace::default()` is production (no prefix).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Namespace {
    /// Lowercase prefix without the trailing dot, e.g. `t3f9a`.
    prefix: Option<String>,
}

impl Namespace {
    /// A namespace whose every subject starts with `{prefix}.` and every stream with
    /// `{PREFIX}_`.
    pub fn with_prefix(prefix: &str) -> Result<Self, NamespaceError> {
        let valid = (1..=32).contains(&prefix.len())
            && prefix.starts_with(|c: char| c.is_ascii_lowercase())
            && prefix
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !valid {
            return Err(NamespaceError(prefix.to_owned()));
        }
        Ok(Self {
            prefix: Some(prefix.to_owned()),
        })
    }

    /// Reads an optional prefix, as given by `--prefix`/`ARL_PREFIX` (empty means none).
    pub fn from_option(prefix: Option<&str>) -> Result<Self, NamespaceError> {
        match prefix {
            None | Some("") => Ok(Self::default()),
            Some(p) => Self::with_prefix(p),
        }
    }

    pub fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    pub(crate) fn subject_root(&self) -> String {
        match &self.prefix {
            Some(p) => format!("{p}.arl"),
            None => "arl".to_owned(),
        }
    }

    fn upper_prefix(&self) -> String {
        match &self.prefix {
            Some(p) => format!("{}_", p.to_ascii_uppercase()),
            None => String::new(),
        }
    }

    /// `arl.<domain>.<run_id>.<event>`.
    pub fn event_subject(&self, domain: Domain, run_id: &RunId, event: &str) -> String {
        format!(
            "{}.{}.{}.{}",
            self.subject_root(),
            domain.token(),
            run_id,
            event
        )
    }

    /// `arl.<domain>.*.<event>`: one event kind of every run.
    pub fn event_filter(&self, domain: Domain, event: &str) -> String {
        format!("{}.{}.*.{}", self.subject_root(), domain.token(), event)
    }

    /// `arl.<domain>.<run_id>.>`: every event of one run in a domain.
    pub fn run_filter(&self, domain: Domain, run_id: &RunId) -> String {
        format!("{}.{}.{}.>", self.subject_root(), domain.token(), run_id)
    }

    /// `arl.<domain>.>`: what the domain's stream captures.
    pub fn stream_subjects(&self, domain: Domain) -> String {
        format!("{}.{}.>", self.subject_root(), domain.token())
    }

    /// `ARL_<DOMAIN>`.
    pub fn stream(&self, domain: Domain) -> String {
        format!("{}ARL_{}", self.upper_prefix(), domain.stream_suffix())
    }

    /// `arl.dlq.<stream>.<consumer>`: where a consumer parks messages it gave up on.
    pub fn dead_letter_subject(&self, stream: &str, consumer: &str) -> String {
        format!(
            "{}.{}.{}.{}",
            self.subject_root(),
            Domain::DeadLetter.token(),
            stream,
            consumer
        )
    }

    /// The run id token of an event subject of this namespace, if it is one.
    pub fn run_token<'s>(&self, subject: &'s str) -> Option<&'s str> {
        let root = self.subject_root();
        let rest = subject.strip_prefix(root.as_str())?.strip_prefix('.')?;
        let mut tokens = rest.split('.');
        let _domain = tokens.next()?;
        let run = tokens.next()?;
        tokens.next()?;
        Some(run)
    }

    /// `arl.rpc.sandbox.<instance>.<op>`: request/reply subjects of the sandbox service,
    /// outside every stream. Lease requests go to instance `any` (a queue group); renew
    /// and release go to the instance that granted the lease.
    pub fn sandbox_rpc(&self, instance: &str, op: crate::rpc::SandboxOp) -> String {
        format!(
            "{}.rpc.sandbox.{}.{}",
            self.subject_root(),
            instance,
            op.token()
        )
    }

    /// `arl.rpc.proxy.<instance|any>.<op>`.
    pub fn proxy_rpc(&self, instance: &str, op: crate::rpc::ProxyOp) -> String {
        format!(
            "{}.rpc.proxy.{}.{}",
            self.subject_root(),
            instance,
            op.token()
        )
    }

    pub fn bucket(&self, bucket: Bucket) -> String {
        format!("{}{}", self.upper_prefix(), bucket.suffix())
    }

    /// `$KV.<bucket>.<key>`: where a record of a bucket is written (JetStream's key-value
    /// layout), for writes the key-value API does not offer (a record that expires).
    pub fn record_subject(&self, bucket: Bucket, key: &str) -> String {
        format!("$KV.{}.{key}", self.bucket(bucket))
    }

    pub fn object_store(&self, store: ObjectStore) -> String {
        format!("{}{}", self.upper_prefix(), store.suffix())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn production_names() {
        let ns = Namespace::default();
        let run = RunId::new("run-1").unwrap();
        assert_eq!(
            ns.event_subject(Domain::Run, &run, "requested"),
            "arl.run.run-1.requested"
        );
        assert_eq!(
            ns.event_filter(Domain::Run, "requested"),
            "arl.run.*.requested"
        );
        assert_eq!(ns.stream(Domain::Run), "ARL_RUNS");
        assert_eq!(ns.stream_subjects(Domain::Run), "arl.run.>");
        assert_eq!(ns.bucket(Bucket::RunState), "ARL_RUN_STATE");
        assert_eq!(ns.object_store(ObjectStore::Datasets), "ARL_DATASETS");
        assert_eq!(ns.object_store(ObjectStore::Weights), "ARL_WEIGHTS");
        assert_eq!(
            ObjectStore::weights_object(&run, 12, "model.safetensors"),
            "run-1/12/model.safetensors"
        );
        assert_eq!(
            ns.dead_letter_subject("ARL_RUNS", "controller"),
            "arl.dlq.ARL_RUNS.controller"
        );
    }

    #[test]
    fn a_runs_calls_share_one_subject() {
        use crate::Event;
        use crate::events::{Example, LlmCallV2};
        let ns = Namespace::with_prefix("t7").unwrap();
        let call = LlmCallV2::example();
        let subject = call.subject(&ns);
        assert_eq!(subject, format!("t7.arl.llm.{}.call", call.run_id));
        let matches = |filter: &str| {
            let (f, s): (Vec<&str>, Vec<&str>) =
                (filter.split('.').collect(), subject.split('.').collect());
            f.len() == s.len() && f.iter().zip(&s).all(|(f, s)| *f == "*" || f == s)
        };
        assert!(matches(&LlmCallV2::filter(&ns)));
        assert_eq!(ns.run_token(&subject), Some(call.run_id.as_str()));
        assert!(subject.starts_with(ns.stream_subjects(Domain::Llm).trim_end_matches('>')));
    }

    #[test]
    fn prefixed_names_are_isolated() {
        let ns = Namespace::with_prefix("t42").unwrap();
        let run = RunId::new("r").unwrap();
        assert_eq!(
            ns.event_subject(Domain::Trial, &run, "failed"),
            "t42.arl.trial.r.failed"
        );
        assert_eq!(ns.stream(Domain::Trial), "T42_ARL_TRIALS");
        assert_eq!(ns.bucket(Bucket::RunState), "T42_ARL_RUN_STATE");
        assert_eq!(ns.object_store(ObjectStore::Weights), "T42_ARL_WEIGHTS");
        assert_eq!(ns.run_token("t42.arl.run.r-1.requested"), Some("r-1"));
        assert_eq!(ns.run_token("arl.run.r-1.requested"), None);
        assert_eq!(ns.run_token("t42.arl.run"), None);
    }

    #[test]
    fn rpc_subjects_are_outside_the_streams() {
        let ns = Namespace::default();
        let lease = ns.sandbox_rpc("any", crate::rpc::SandboxOp::Lease);
        assert_eq!(lease, "arl.rpc.sandbox.any.lease");
        for domain in Domain::ALL {
            let captured = ns.stream_subjects(domain);
            assert!(
                !lease.starts_with(captured.trim_end_matches('>')),
                "{captured}"
            );
        }
    }

    #[test]
    fn bad_prefixes_are_refused() {
        for bad in ["", "A", "1x", "a.b", "a-b", &"x".repeat(33)] {
            assert!(Namespace::with_prefix(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            Namespace::from_option(Some("")).unwrap(),
            Namespace::default()
        );
    }

    #[test]
    fn every_domain_has_distinct_names() {
        let ns = Namespace::default();
        let mut streams: Vec<_> = Domain::ALL.iter().map(|d| ns.stream(*d)).collect();
        let mut tokens: Vec<_> = Domain::ALL.iter().map(|d| d.token()).collect();
        streams.sort();
        streams.dedup();
        tokens.sort();
        tokens.dedup();
        assert_eq!(streams.len(), Domain::ALL.len());
        assert_eq!(tokens.len(), Domain::ALL.len());
    }
}
