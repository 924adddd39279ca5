//! Image builds on Kubernetes: a missing cluster image is built by a `batch/v1` Job
//! labelled `type=image-build` that runs rootless BuildKit daemonless
//! (`buildctl-daemonless.sh build …`, which starts its own buildkitd in the pod) over a
//! build context the image builder wrote on a shared volume, and pushes to the registry.
//!
//! [`JobBuilds::build`] owns one build from start to end:
//! 1. create the Job (`backoffLimit: 0`: a failed build is reported, not retried;
//!    `activeDeadlineSeconds`: the build's time limit, enforced by Kubernetes;
//!    `ttlSecondsAfterFinished`: a Job this builder could not delete goes away anyway);
//! 2. poll it, with backoff, until it has `Complete` or `Failed` — and, until its pod has
//!    started, the pod too: one still `Pending` (an image it cannot pull, no node that fits)
//!    after the pending timeout is given up with its waiting reason;
//! 3. on failure, read the last lines of the build pod's log (the pod found by `job-name`);
//! 4. delete the Job (propagation `Background`, its pod with it), unless it failed and
//!    failed Jobs are kept for debugging.
//!
//! What the Job needs from the cluster: the context volume's claim (mounted read-only,
//! this build's folder as a `subPath`), optionally a `kubernetes.io/dockerconfigjson`
//! Secret with the registry's credentials, and nodes that allow a container with seccomp
//! and AppArmor `Unconfined` — BuildKit's rootless mode needs both to create its own user
//! and mount namespaces (`--oci-worker-no-process-sandbox`: no PID namespace of its own).
//! What the image builder's service account needs: `create`, `get`, `delete` on
//! `jobs.batch`, `list` on `pods` and `get` on `pods/log`, in the build namespace. A 403 says
//! which of these is missing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    AppArmorProfile, Container, EmptyDirVolumeSource, EnvVar, KeyToPath,
    PersistentVolumeClaimVolumeSource, Pod, PodSpec, PodTemplateSpec, SeccompProfile,
    SecretVolumeSource, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};

use arl_schemas::{RunId, TaskId};

use crate::buildkit::build_args;

/// The label every build Job and its pod carry.
pub const TYPE_LABEL: (&str, &str) = ("type", "image-build");
pub const MANAGED_BY_LABEL: (&str, &str) = ("app.kubernetes.io/managed-by", "arl-imagebuilder");
pub const RUN_LABEL: &str = "arl.dev/run";
pub const TASK_LABEL: &str = "arl.dev/task";
/// The build container's name (its log is the build log).
pub const CONTAINER: &str = "buildkit";
/// Where the build's context folder is mounted in the pod.
pub const CONTEXT_MOUNT: &str = "/workspace";
/// The rootless image's user (`user`, UID 1000): its home holds BuildKit's state and the
/// docker config buildctl reads credentials from.
const BUILDKIT_UID: i64 = 1000;
const BUILDKIT_HOME: &str = "/home/user";
/// Lines of the build log kept in a failure.
const LOG_TAIL_LINES: i64 = 40;
/// API errors in a row (other than 403/404) a watch rides out before it gives up.
const TRANSIENT_ERRORS: u32 = 5;
/// How long past its own deadline a Job may stay unfinished before this builder stops
/// waiting for Kubernetes to say so.
const DEADLINE_GRACE: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum JobBuildError {
    #[error(
        "the image builder's service account may not {verb} {resource} in namespace {namespace}: \
         grant it `{verb}` on `{resource}` there (a Role bound to the account; build Jobs need \
         create/get/delete on jobs.batch, list on pods, get on pods/log). The API said: {message}"
    )]
    Forbidden {
        verb: &'static str,
        resource: &'static str,
        namespace: String,
        message: String,
    },
    #[error("build Job {job} failed ({reason}): {message}")]
    Failed {
        job: String,
        reason: String,
        message: String,
        log_tail: String,
    },
    #[error("build Job {job} ran past its {}s deadline", .limit.as_secs())]
    Timeout {
        job: String,
        limit: Duration,
        log_tail: String,
    },
    #[error(
        "build Job {job}'s pod did not start within {}s: {reason}{}{message}",
        .limit.as_secs(), if .message.is_empty() { "" } else { ": " }
    )]
    NotStarted {
        job: String,
        limit: Duration,
        /// The pod's waiting reason (`ImagePullBackOff`, `Unschedulable`, …).
        reason: String,
        message: String,
    },
    #[error("build Job {job}: the Kubernetes API failed to {verb} {resource}: {source}")]
    Api {
        job: String,
        verb: &'static str,
        resource: &'static str,
        #[source]
        source: kube::Error,
    },
}

impl JobBuildError {
    /// The last lines of the build log, where the build got that far.
    pub fn log_tail(&self) -> &str {
        match self {
            Self::Failed { log_tail, .. } | Self::Timeout { log_tail, .. } => log_tail,
            _ => "",
        }
    }
}

/// How often a running Job is looked at: `first` after creating it, doubling up to `max`.
#[derive(Clone, Copy, Debug)]
pub struct Polling {
    pub first: Duration,
    pub max: Duration,
}

impl Default for Polling {
    fn default() -> Self {
        Self {
            first: Duration::from_secs(1),
            max: Duration::from_secs(10),
        }
    }
}

#[derive(Clone, Debug)]
pub struct JobConfig {
    /// The namespace build Jobs run in.
    pub namespace: String,
    /// A rootless BuildKit image (`moby/buildkit:v0.23.0-rootless`).
    pub buildkit_image: String,
    /// The PersistentVolumeClaim holding the contexts folder; the Job mounts its build's
    /// folder (`<claim root>/<build name>`) read-only.
    pub contexts_claim: String,
    /// A `kubernetes.io/dockerconfigjson` Secret with the registry's credentials.
    pub registry_secret: Option<String>,
    /// The registry is reached over plain HTTP.
    pub insecure_registry: bool,
    /// The build's time limit (`activeDeadlineSeconds`).
    pub timeout: Duration,
    /// How long the build pod may stay unstarted (pending, pulling, unschedulable).
    pub pending_timeout: Duration,
    /// `ttlSecondsAfterFinished`: Kubernetes removes a finished Job after this.
    pub ttl_after_finished: Duration,
    /// Failed Jobs stay (until their TTL) for `kubectl logs`/`describe`.
    pub keep_failed: bool,
    pub polling: Polling,
}

/// One build: its name (the Job's, and its context folder's under the contexts volume),
/// the reference it pushes, and the run and task it is for (labels).
#[derive(Clone, Copy, Debug)]
pub struct JobBuild<'a> {
    pub name: &'a str,
    pub reference: &'a str,
    pub run: &'a RunId,
    pub task: &'a TaskId,
}

/// Image builds as Kubernetes Jobs, in one namespace.
#[derive(Clone)]
pub struct JobBuilds {
    jobs: Api<Job>,
    pods: Api<Pod>,
    config: JobConfig,
}

impl std::fmt::Debug for JobBuilds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobBuilds")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A fresh build name for `instance`: `arl-build-<instance>-<8 hex>`, a valid Job name
/// (a DNS label of at most 63 characters, as the `job-name` label it becomes requires).
pub fn build_name(instance: &str) -> String {
    let slug: String = instance
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let slug: String = slug.trim_matches('-').chars().take(44).collect();
    let slug = slug.trim_end_matches('-');
    let unique = uuid::Uuid::new_v4().simple().to_string();
    let unique = &unique[..8];
    if slug.is_empty() {
        format!("arl-build-{unique}")
    } else {
        format!("arl-build-{slug}-{unique}")
    }
}

/// `value` as a label value: at most 63 of `[A-Za-z0-9._-]`, starting and ending
/// alphanumeric.
pub fn label_value(value: &str) -> String {
    let mapped: String = value
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// Where a Job stands.
enum JobState {
    Running,
    Succeeded,
    Failed { reason: String, message: String },
}

fn job_state(job: &Job) -> JobState {
    let Some(status) = &job.status else {
        return JobState::Running;
    };
    // Since Kubernetes 1.31, `SuccessCriteriaMet` / `FailureTarget` come first, once the
    // outcome is decided; `Complete` / `Failed` follow once the pod is gone.
    for condition in status.conditions.iter().flatten() {
        if condition.status != "True" {
            continue;
        }
        match condition.type_.as_str() {
            "Complete" | "SuccessCriteriaMet" => return JobState::Succeeded,
            "Failed" | "FailureTarget" => {
                return JobState::Failed {
                    reason: condition.reason.clone().unwrap_or_default(),
                    message: condition.message.clone().unwrap_or_default(),
                };
            }
            _ => {}
        }
    }
    if status.succeeded.unwrap_or(0) > 0 {
        JobState::Succeeded
    } else {
        JobState::Running
    }
}

/// Whether the build pod has started, and if not, why (its waiting reason).
enum PodStart {
    Started,
    Waiting { reason: String, message: String },
}

fn pod_start(pods: &[Pod]) -> PodStart {
    let Some(pod) = pods.last() else {
        return PodStart::Waiting {
            reason: "NoPod".into(),
            message: "the Job has created no pod (a quota or an admission policy may refuse it: \
                      `kubectl describe job`)"
                .into(),
        };
    };
    let status = pod.status.clone().unwrap_or_default();
    if matches!(
        status.phase.as_deref(),
        Some("Running" | "Succeeded" | "Failed")
    ) {
        return PodStart::Started;
    }
    let waiting = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .find_map(|c| c.state.as_ref()?.waiting.clone());
    if let Some(waiting) = waiting {
        return PodStart::Waiting {
            reason: waiting.reason.unwrap_or_else(|| "Waiting".into()),
            message: waiting.message.unwrap_or_default(),
        };
    }
    let unscheduled = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    match unscheduled {
        Some(condition) => PodStart::Waiting {
            reason: condition
                .reason
                .clone()
                .unwrap_or_else(|| "Unschedulable".into()),
            message: condition.message.clone().unwrap_or_default(),
        },
        None => PodStart::Waiting {
            reason: "Pending".into(),
            message: String::new(),
        },
    }
}

impl JobBuilds {
    pub fn new(client: kube::Client, config: JobConfig) -> Self {
        Self {
            jobs: Api::namespaced(client.clone(), &config.namespace),
            pods: Api::namespaced(client, &config.namespace),
            config,
        }
    }

    pub fn config(&self) -> &JobConfig {
        &self.config
    }

    /// Builds and pushes `build.reference` in a Job; returns when the Job has succeeded,
    /// or why not. The Job is gone afterwards (unless it failed and failed Jobs are kept).
    pub async fn build(&self, build: &JobBuild<'_>) -> Result<(), JobBuildError> {
        let job = self.job(build);
        self.jobs
            .create(&PostParams::default(), &job)
            .await
            .map_err(|e| self.api_error(build.name, "create", "jobs.batch", e))?;
        tracing::info!(
            job = build.name,
            reference = build.reference,
            "build Job created"
        );
        let outcome = match self.watch(build.name).await {
            Err(JobBuildError::Failed {
                job,
                reason,
                message,
                ..
            }) => Err(JobBuildError::Failed {
                log_tail: self.log_tail(&job).await,
                job,
                reason,
                message,
            }),
            Err(JobBuildError::Timeout { job, limit, .. }) => Err(JobBuildError::Timeout {
                log_tail: self.log_tail(&job).await,
                job,
                limit,
            }),
            other => other,
        };
        if outcome.is_err() && self.config.keep_failed {
            tracing::info!(job = build.name, "failed build Job kept for debugging");
        } else {
            self.delete(build.name).await;
        }
        outcome
    }

    /// Polls the Job (and, until it has started, its pod) until it has an outcome.
    async fn watch(&self, name: &str) -> Result<(), JobBuildError> {
        let started = Instant::now();
        let mut delay = self.config.polling.first;
        let mut pod_started = false;
        let mut errors = 0;
        loop {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(self.config.polling.max);
            match self.look(name, &mut pod_started, started).await {
                Ok(Some(outcome)) => return outcome,
                Ok(None) => errors = 0,
                Err(error @ (JobBuildError::Forbidden { .. } | JobBuildError::Failed { .. })) => {
                    return Err(error);
                }
                Err(error) => {
                    errors += 1;
                    if errors >= TRANSIENT_ERRORS {
                        return Err(error);
                    }
                    tracing::warn!(job = name, %error, "build Job watch: retrying");
                }
            }
            if started.elapsed() > self.config.timeout + DEADLINE_GRACE {
                return Err(JobBuildError::Timeout {
                    job: name.to_owned(),
                    limit: self.config.timeout,
                    log_tail: String::new(),
                });
            }
        }
    }

    /// One look at the Job: its outcome once it has one.
    async fn look(
        &self,
        name: &str,
        pod_started: &mut bool,
        started: Instant,
    ) -> Result<Option<Result<(), JobBuildError>>, JobBuildError> {
        let job = self.jobs.get(name).await.map_err(|e| match e {
            kube::Error::Api(status) if status.code == 404 => JobBuildError::Failed {
                job: name.to_owned(),
                reason: "Deleted".into(),
                message: "the Job was deleted while it ran".into(),
                log_tail: String::new(),
            },
            e => self.api_error(name, "get", "jobs.batch", e),
        })?;
        match job_state(&job) {
            JobState::Succeeded => return Ok(Some(Ok(()))),
            JobState::Failed { reason, message } if reason == "DeadlineExceeded" => {
                tracing::debug!(job = name, message, "build Job past its deadline");
                return Ok(Some(Err(JobBuildError::Timeout {
                    job: name.to_owned(),
                    limit: self.config.timeout,
                    log_tail: String::new(),
                })));
            }
            JobState::Failed { reason, message } => {
                return Ok(Some(Err(JobBuildError::Failed {
                    job: name.to_owned(),
                    reason,
                    message,
                    log_tail: String::new(),
                })));
            }
            JobState::Running => {}
        }
        if *pod_started {
            return Ok(None);
        }
        let pods = self
            .pods
            .list(&ListParams::default().labels(&format!("job-name={name}")))
            .await
            .map_err(|e| self.api_error(name, "list", "pods", e))?;
        match pod_start(&pods.items) {
            PodStart::Started => *pod_started = true,
            PodStart::Waiting { reason, message }
                if started.elapsed() >= self.config.pending_timeout =>
            {
                return Ok(Some(Err(JobBuildError::NotStarted {
                    job: name.to_owned(),
                    limit: self.config.pending_timeout,
                    reason,
                    message,
                })));
            }
            PodStart::Waiting { .. } => {}
        }
        Ok(None)
    }

    /// The last lines of the build pod's log; what went wrong instead when it cannot be read
    /// (the failure is reported either way).
    async fn log_tail(&self, name: &str) -> String {
        let pods = match self
            .pods
            .list(&ListParams::default().labels(&format!("job-name={name}")))
            .await
        {
            Ok(pods) => pods,
            Err(e) => {
                return format!(
                    "(no build log: {})",
                    self.api_error(name, "list", "pods", e)
                );
            }
        };
        let Some(pod) = pods.items.last().and_then(|p| p.metadata.name.clone()) else {
            return "(no build log: the Job has no pod)".into();
        };
        let params = LogParams {
            container: Some(CONTAINER.into()),
            tail_lines: Some(LOG_TAIL_LINES),
            ..LogParams::default()
        };
        match self.pods.logs(&pod, &params).await {
            Ok(log) => log.trim_end().to_owned(),
            Err(e) => format!(
                "(no build log: {})",
                self.api_error(name, "get", "pods/log", e)
            ),
        }
    }

    /// Deletes the Job and, in the background, its pod. A Job that cannot be deleted is left
    /// to its TTL; the build's outcome stands.
    async fn delete(&self, name: &str) {
        match self.jobs.delete(name, &DeleteParams::background()).await {
            Ok(_) => tracing::debug!(job = name, "build Job deleted"),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => {
                let error = self.api_error(name, "delete", "jobs.batch", e);
                tracing::warn!(job = name, %error, "build Job left to its TTL");
            }
        }
    }

    fn api_error(
        &self,
        job: &str,
        verb: &'static str,
        resource: &'static str,
        error: kube::Error,
    ) -> JobBuildError {
        match error {
            kube::Error::Api(status) if status.code == 403 => JobBuildError::Forbidden {
                verb,
                resource,
                namespace: self.config.namespace.clone(),
                message: status.message,
            },
            source => JobBuildError::Api {
                job: job.to_owned(),
                verb,
                resource,
                source,
            },
        }
    }

    /// The Job for `build`.
    pub fn job(&self, build: &JobBuild<'_>) -> Job {
        let config = &self.config;
        let labels = BTreeMap::from([
            (TYPE_LABEL.0.to_owned(), TYPE_LABEL.1.to_owned()),
            (MANAGED_BY_LABEL.0.to_owned(), MANAGED_BY_LABEL.1.to_owned()),
            (RUN_LABEL.to_owned(), label_value(build.run.as_str())),
            (TASK_LABEL.to_owned(), label_value(build.task.as_str())),
        ]);
        let mut volumes = vec![
            Volume {
                name: "context".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: config.contexts_claim.clone(),
                    read_only: Some(true),
                }),
                ..Volume::default()
            },
            // buildkitd's state (layers, cache): the pod's own, gone with it.
            Volume {
                name: "buildkit-state".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            },
        ];
        let mut mounts = vec![
            VolumeMount {
                name: "context".into(),
                mount_path: CONTEXT_MOUNT.into(),
                sub_path: Some(build.name.to_owned()),
                read_only: Some(true),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "buildkit-state".into(),
                mount_path: format!("{BUILDKIT_HOME}/.local/share/buildkit"),
                ..VolumeMount::default()
            },
        ];
        let mut env = vec![EnvVar {
            name: "BUILDKITD_FLAGS".into(),
            value: Some("--oci-worker-no-process-sandbox".into()),
            ..EnvVar::default()
        }];
        if let Some(secret) = &config.registry_secret {
            volumes.push(Volume {
                name: "registry-auth".into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(secret.clone()),
                    items: Some(vec![KeyToPath {
                        key: ".dockerconfigjson".into(),
                        path: "config.json".into(),
                        mode: None,
                    }]),
                    ..SecretVolumeSource::default()
                }),
                ..Volume::default()
            });
            mounts.push(VolumeMount {
                name: "registry-auth".into(),
                mount_path: format!("{BUILDKIT_HOME}/.docker"),
                read_only: Some(true),
                ..VolumeMount::default()
            });
            env.push(EnvVar {
                name: "DOCKER_CONFIG".into(),
                value: Some(format!("{BUILDKIT_HOME}/.docker")),
                ..EnvVar::default()
            });
        }
        let container = Container {
            name: CONTAINER.into(),
            image: Some(config.buildkit_image.clone()),
            command: Some(vec!["buildctl-daemonless.sh".into()]),
            args: Some(build_args(
                CONTEXT_MOUNT,
                build.reference,
                config.insecure_registry,
            )),
            env: Some(env),
            volume_mounts: Some(mounts),
            // BuildKit's rootless mode: its own user (UID 1000 in the image), and no seccomp
            // or AppArmor confinement, which would refuse the namespaces and mounts
            // rootlesskit makes.
            security_context: Some(SecurityContext {
                run_as_user: Some(BUILDKIT_UID),
                run_as_group: Some(BUILDKIT_UID),
                seccomp_profile: Some(SeccompProfile {
                    type_: "Unconfined".into(),
                    localhost_profile: None,
                }),
                app_armor_profile: Some(AppArmorProfile {
                    type_: "Unconfined".into(),
                    localhost_profile: None,
                }),
                ..SecurityContext::default()
            }),
            ..Container::default()
        };
        Job {
            metadata: ObjectMeta {
                name: Some(build.name.to_owned()),
                namespace: Some(config.namespace.clone()),
                labels: Some(labels.clone()),
                annotations: Some(BTreeMap::from([(
                    "arl.dev/image".to_owned(),
                    build.reference.to_owned(),
                )])),
                ..ObjectMeta::default()
            },
            spec: Some(JobSpec {
                backoff_limit: Some(0),
                active_deadline_seconds: Some(seconds(config.timeout)),
                ttl_seconds_after_finished: Some(
                    i32::try_from(config.ttl_after_finished.as_secs()).unwrap_or(i32::MAX),
                ),
                template: PodTemplateSpec {
                    metadata: Some(ObjectMeta {
                        labels: Some(labels),
                        ..ObjectMeta::default()
                    }),
                    spec: Some(PodSpec {
                        restart_policy: Some("Never".into()),
                        // The build talks to the registry, never to the Kubernetes API.
                        automount_service_account_token: Some(false),
                        containers: vec![container],
                        volumes: Some(volumes),
                        ..PodSpec::default()
                    }),
                },
                ..JobSpec::default()
            }),
            ..Job::default()
        }
    }
}

fn seconds(duration: Duration) -> i64 {
    i64::try_from(duration.as_secs()).unwrap_or(i64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_names_are_job_names() {
        let name = build_name("Django__Django-11880");
        assert!(
            name.starts_with("arl-build-django--django-11880-"),
            "{name}"
        );
        assert_eq!(name.len(), "arl-build-django--django-11880-".len() + 8);
        let long = build_name(&"x".repeat(200));
        assert!(long.len() <= 63, "{long}");
        assert_ne!(build_name("a"), build_name("a"));
        assert!(build_name("__").starts_with("arl-build-"));
        for name in [name, long, build_name("--")] {
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            );
            assert!(!name.ends_with('-'), "{name}");
        }
    }

    #[test]
    fn label_values_are_trimmed_to_what_kubernetes_accepts() {
        assert_eq!(label_value("django__django-11880"), "django__django-11880");
        assert_eq!(label_value("a/b:c"), "a-b-c");
        assert_eq!(label_value("_x_"), "x");
        assert_eq!(label_value(&"y".repeat(100)).len(), 63);
    }
}
