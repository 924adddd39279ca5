//! Least privilege on the bus: for each service (and the CLI), the subjects it may
//! publish and subscribe to, as nats-server permissions. A service may publish only the
//! events it owns (the trainer alone `weights.published`, the rollout alone
//! `trajectory.ready` and `trial.finished`, the CLI `run.requested`), read only the streams
//! and buckets it consumes, and receive replies only on its own inbox prefix
//! (`_INBOX_<role>.`), so no one reads another's lease grants or trial keys.
//! `arl nats-config` turns this into a nats-server configuration; `arl up --least-privilege`
//! runs on it.

use crate::namespace::{Bucket, Domain, Namespace, ObjectStore};

/// Who connects to the bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Controller,
    Dataset,
    Imagebuilder,
    Sandbox,
    Inference,
    Proxy,
    Reward,
    Rollout,
    Trainer,
    Evaluator,
    Exporter,
    Cli,
}

impl Role {
    pub const ALL: [Role; 12] = [
        Role::Controller,
        Role::Dataset,
        Role::Imagebuilder,
        Role::Sandbox,
        Role::Inference,
        Role::Proxy,
        Role::Reward,
        Role::Rollout,
        Role::Trainer,
        Role::Evaluator,
        Role::Exporter,
        Role::Cli,
    ];

    /// The role's name: its user's name and its inbox prefix's suffix.
    pub fn name(self) -> &'static str {
        match self {
            Role::Controller => "controller",
            Role::Dataset => "dataset",
            Role::Imagebuilder => "imagebuilder",
            Role::Sandbox => "sandbox",
            Role::Inference => "inference",
            Role::Proxy => "proxy",
            Role::Reward => "reward",
            Role::Rollout => "rollout",
            Role::Trainer => "trainer",
            Role::Evaluator => "evaluator",
            Role::Exporter => "exporter",
            Role::Cli => "cli",
        }
    }

    /// The role of a service binary (`arl-rollout` → rollout, `arl` → the CLI).
    pub fn of_binary(binary: &str) -> Option<Role> {
        let name =
            binary
                .strip_prefix("arl-")
                .unwrap_or(if binary == "arl" { "cli" } else { binary });
        Role::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Where this role's replies arrive; its client must use this inbox prefix.
    pub fn inbox_prefix(self) -> String {
        format!("_INBOX_{}", self.name())
    }
}

/// Subjects a role may publish and subscribe to (nats-server wildcards).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
    /// The role answers requests (it may publish to the reply subject of a request it got).
    pub answers_requests: bool,
}

impl Permissions {
    fn publish(&mut self, subject: impl Into<String>) {
        self.publish.push(subject.into());
    }

    fn subscribe(&mut self, subject: impl Into<String>) {
        self.subscribe.push(subject.into());
    }

    /// JetStream consumers on stream `s` (create, info, next, delete; acks).
    fn consume(&mut self, s: &str) {
        for pattern in [
            format!("$JS.API.CONSUMER.*.{s}"),
            format!("$JS.API.CONSUMER.*.{s}.>"),
            format!("$JS.API.CONSUMER.*.*.{s}.>"),
            format!("$JS.API.DIRECT.GET.{s}"),
            format!("$JS.API.DIRECT.GET.{s}.>"),
            format!("$JS.API.STREAM.MSG.GET.{s}"),
            format!("$JS.ACK.{s}.>"),
            format!("$JS.FC.{s}.>"),
        ] {
            self.publish(pattern);
        }
    }
}

impl Namespace {
    /// What `role` may do on the bus in this namespace.
    pub fn permissions(&self, role: Role) -> Permissions {
        let mut p = Permissions::default();
        let root = self.subject_root();
        let event = |domain: Domain, name: &str| self.event_filter(domain, name);
        let stream = |domain: Domain| self.stream(domain);
        let kv = |bucket: Bucket| self.bucket(bucket);
        // Every client: JetStream's account and stream info, its own inbox, dead letters
        // of its consumers, and (idempotent) provisioning of ARL's streams and buckets.
        p.publish("$JS.API.INFO");
        p.publish("$JS.API.STREAM.INFO.*");
        p.publish("$JS.API.STREAM.NAMES");
        p.subscribe(format!("{}.>", role.inbox_prefix()));
        p.publish(format!("{root}.dlq.>"));
        for domain in Domain::ALL {
            p.publish(format!("$JS.API.STREAM.CREATE.{}", stream(domain)));
        }
        for bucket in [
            Bucket::RunState,
            Bucket::EvalState,
            Bucket::Trials,
            Bucket::Trainers,
        ] {
            p.publish(format!("$JS.API.STREAM.CREATE.KV_{}", kv(bucket)));
        }
        for store in ObjectStore::ALL {
            p.publish(format!(
                "$JS.API.STREAM.CREATE.OBJ_{}",
                self.object_store(store)
            ));
        }
        let objects = self.object_store(ObjectStore::Datasets);
        // Reading the registered datasets (every role but the CLI, the sandbox and the proxy).
        let read_datasets = |p: &mut Permissions| p.consume(&format!("OBJ_{objects}"));
        // Policy versions in the object store: the trainer writes and prunes them, engines
        // read them; no one else touches them.
        let weights = self.object_store(ObjectStore::Weights);
        let read_weights = |p: &mut Permissions| p.consume(&format!("OBJ_{weights}"));
        let read_kv =
            |p: &mut Permissions, bucket: Bucket| p.consume(&format!("KV_{}", kv(bucket)));
        let write_kv = |p: &mut Permissions, bucket: Bucket| {
            p.consume(&format!("KV_{}", kv(bucket)));
            p.publish(format!("$KV.{}.>", kv(bucket)));
        };
        let sandbox_rpc = format!("{root}.rpc.sandbox.>");
        let proxy_rpc = format!("{root}.rpc.proxy.>");
        match role {
            Role::Controller => {
                // The controller provisions: it may change a stream's configuration (and
                // turn on per-message TTL in a trial-record bucket made without it).
                for domain in Domain::ALL {
                    p.publish(format!("$JS.API.STREAM.UPDATE.{}", stream(domain)));
                }
                p.publish(format!("$JS.API.STREAM.UPDATE.KV_{}", kv(Bucket::Trials)));
                for name in [
                    "accepted",
                    "rejected",
                    "progress",
                    "completed",
                    "failed",
                    "cancelled",
                ] {
                    p.publish(event(Domain::Run, name));
                }
                for domain in [
                    Domain::Run,
                    Domain::Task,
                    Domain::Train,
                    Domain::Trial,
                    Domain::Weights,
                    Domain::Eval,
                    Domain::Reward,
                ] {
                    p.consume(&stream(domain));
                }
                write_kv(&mut p, Bucket::RunState);
                read_kv(&mut p, Bucket::Trainers);
                read_datasets(&mut p);
            }
            Role::Dataset => {
                p.publish(event(Domain::Task, "batch"));
                p.publish(event(Domain::Task, "dataset"));
                p.publish(event(Domain::Run, "failed"));
                p.consume(&stream(Domain::Run));
                p.consume(&stream(Domain::Train));
                p.consume(&stream(Domain::Task));
                read_kv(&mut p, Bucket::RunState);
                read_datasets(&mut p);
                p.publish(format!("$O.{objects}.>"));
                p.publish(format!("$JS.API.STREAM.PURGE.OBJ_{objects}"));
            }
            Role::Imagebuilder => {
                p.publish(event(Domain::Image, "ready"));
                p.publish(event(Domain::Run, "failed"));
                p.publish(event(Domain::Image, "failed"));
                p.consume(&stream(Domain::Task));
                read_kv(&mut p, Bucket::RunState);
                read_datasets(&mut p);
            }
            Role::Sandbox => {
                for name in ["leased", "released", "failed"] {
                    p.publish(event(Domain::Sandbox, name));
                }
                p.subscribe(sandbox_rpc);
                p.answers_requests = true;
            }
            Role::Inference => {
                p.consume(&stream(Domain::Weights));
                read_weights(&mut p);
                // A run's end: back to the base model for the next run.
                p.consume(&stream(Domain::Run));
            }
            Role::Proxy => {
                p.publish(event(Domain::Llm, "call"));
                p.subscribe(proxy_rpc);
                p.answers_requests = true;
                // Each MCP session of a trial leases a sandbox of its own.
                p.publish(sandbox_rpc.clone());
                // A run's end drops its load (and, with --follow-weights, sends a followed
                // engine back to its base model); the follower loads each published version.
                p.consume(&stream(Domain::Run));
                p.consume(&stream(Domain::Weights));
            }
            Role::Reward => {
                p.publish(event(Domain::Reward, "scored"));
                p.publish(event(Domain::Run, "failed"));
                p.publish(event(Domain::Trial, "failed"));
                p.consume(&stream(Domain::Trial));
                read_kv(&mut p, Bucket::RunState);
                read_kv(&mut p, Bucket::Trials);
                read_datasets(&mut p);
                p.publish(sandbox_rpc);
            }
            Role::Rollout => {
                for name in ["requested", "started", "finished", "failed"] {
                    p.publish(event(Domain::Trial, name));
                }
                p.publish(event(Domain::Trajectory, "ready"));
                p.publish(event(Domain::Run, "failed"));
                // Trials, their calls (read by stream sequence) and their grades:
                // durable hand-offs only, no live subscription.
                for domain in [Domain::Task, Domain::Trial, Domain::Llm, Domain::Reward] {
                    p.consume(&stream(domain));
                }
                write_kv(&mut p, Bucket::Trials);
                read_kv(&mut p, Bucket::RunState);
                read_datasets(&mut p);
                p.publish(sandbox_rpc);
                p.publish(proxy_rpc);
            }
            Role::Trainer => {
                p.publish(event(Domain::Train, "step"));
                p.publish(event(Domain::Weights, "published"));
                p.publish(event(Domain::Run, "failed"));
                // Trajectories, and each step's own task.batch (how many it needs).
                p.consume(&stream(Domain::Trajectory));
                // run.accepted: a resumed run is opened (and its checkpoint published) at once.
                p.consume(&stream(Domain::Run));
                p.consume(&stream(Domain::Task));
                write_kv(&mut p, Bucket::Trainers);
                read_kv(&mut p, Bucket::Trials);
                read_kv(&mut p, Bucket::RunState);
                read_datasets(&mut p);
                read_weights(&mut p);
                p.publish(format!("$O.{weights}.>"));
                p.publish(format!("$JS.API.STREAM.PURGE.OBJ_{weights}"));
            }
            Role::Evaluator => {
                p.publish(event(Domain::Eval, "completed"));
                p.publish(event(Domain::Run, "failed"));
                p.publish(event(Domain::Task, "batch"));
                for domain in [Domain::Task, Domain::Reward, Domain::Trial, Domain::Train] {
                    p.consume(&stream(domain));
                }
                write_kv(&mut p, Bucket::EvalState);
                read_kv(&mut p, Bucket::RunState);
                read_datasets(&mut p);
            }
            Role::Exporter => {
                // Reads any event stream through its own durable feeds (re-created at
                // their ack floor on start), and publishes nothing but dead letters.
                for domain in Domain::ALL {
                    if domain != Domain::DeadLetter {
                        p.consume(&stream(domain));
                    }
                }
            }
            Role::Cli => {
                p.publish(event(Domain::Run, "requested"));
                p.publish(event(Domain::Run, "cancel_requested"));
                for domain in [Domain::Run, Domain::Train, Domain::Eval, Domain::Trial] {
                    p.consume(&stream(domain));
                }
                read_kv(&mut p, Bucket::RunState);
                read_kv(&mut p, Bucket::EvalState);
                read_kv(&mut p, Bucket::Trainers);
            }
        }
        p.publish.sort();
        p.publish.dedup();
        p.subscribe.sort();
        p.subscribe.dedup();
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_alone_publish_their_events() {
        let ns = Namespace::default();
        let may_publish =
            |role: Role, subject: &str| ns.permissions(role).publish.iter().any(|p| p == subject);
        let weights = ns.event_filter(Domain::Weights, "published");
        let trajectory = ns.event_filter(Domain::Trajectory, "ready");
        let finished = ns.event_filter(Domain::Trial, "finished");
        let requested = ns.event_filter(Domain::Run, "requested");
        for role in Role::ALL {
            assert_eq!(
                may_publish(role, &weights),
                role == Role::Trainer,
                "{role:?}"
            );
            assert_eq!(
                may_publish(role, &trajectory),
                role == Role::Rollout,
                "{role:?}"
            );
            assert_eq!(
                may_publish(role, &finished),
                role == Role::Rollout,
                "{role:?}"
            );
            assert_eq!(may_publish(role, &requested), role == Role::Cli, "{role:?}");
        }
        // Only the sandbox service answers leases; only callers may ask.
        let lease = "arl.rpc.sandbox.>";
        assert!(
            ns.permissions(Role::Sandbox)
                .subscribe
                .iter()
                .any(|s| s == lease)
        );
        assert!(
            !ns.permissions(Role::Evaluator)
                .publish
                .iter()
                .any(|s| s == lease)
        );
        assert_eq!(Role::of_binary("arl-rollout"), Some(Role::Rollout));
    }

    #[test]
    fn the_trainer_alone_writes_weights_objects_and_engines_read_them() {
        let ns = Namespace::with_prefix("t1").unwrap();
        let store = ns.object_store(ObjectStore::Weights);
        assert_eq!(store, "T1_ARL_WEIGHTS");
        let writes = format!("$O.{store}.>");
        let purges = format!("$JS.API.STREAM.PURGE.OBJ_{store}");
        // An object is read through a consumer on its stream and by direct gets.
        let reads = [
            format!("$JS.API.CONSUMER.*.OBJ_{store}"),
            format!("$JS.API.DIRECT.GET.OBJ_{store}.>"),
        ];
        for role in Role::ALL {
            let p = ns.permissions(role);
            let may = |subject: &str| p.publish.iter().any(|s| s == subject);
            assert_eq!(may(&writes), role == Role::Trainer, "{role:?} writes");
            assert_eq!(may(&purges), role == Role::Trainer, "{role:?} purges");
            for read in &reads {
                assert_eq!(
                    may(read),
                    matches!(role, Role::Trainer | Role::Inference),
                    "{role:?} reads {read}"
                );
            }
            // No wildcard grants a write by the back door.
            assert!(
                !p.publish
                    .iter()
                    .any(|s| s == "$O.>" || s == ">" || s == "$O.*.>"),
                "{role:?}: {:?}",
                p.publish
            );
            // Provisioning is idempotent and open to all: every service creates what is
            // missing at start.
            assert!(
                may(&format!("$JS.API.STREAM.CREATE.OBJ_{store}")),
                "{role:?}"
            );
        }
        // The engine writes nothing there; the datasets store is not the weights store.
        let datasets = ns.object_store(ObjectStore::Datasets);
        assert!(
            !ns.permissions(Role::Trainer)
                .publish
                .contains(&format!("$O.{datasets}.>"))
        );
        assert_eq!(Role::of_binary("arl"), Some(Role::Cli));
    }
}
