//! Image builds as Kubernetes Jobs, against recorded API exchanges: kube's client over
//! `tower-test`'s mock service, answered here the way an API server answers (Job and pod
//! objects, `Status` errors), every request recorded and checked.
//!
//! - a build that succeeds: the Job the builder creates (labels, rootless BuildKit command,
//!   security context, volumes), polled until `Complete`, then deleted;
//! - a build that fails: `image.failed`-worthy error with the build pod's log tail;
//! - a Job past its deadline: a timeout;
//! - a pod that never starts (an image it cannot pull, no node that fits);
//! - a 403 from RBAC: which verb on which resource the service account lacks;
//! - a passing API error while watching: ridden out;
//! - the whole service on a real nats-server and a real registry: `image.ready` pinned by
//!   the digest of what the "Job" pushed, and `image.failed` with the log tail.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_imagebuilder::jobs::{JobBuild, JobBuildError, JobBuilds, JobConfig, Polling};
use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::load_instances;
use arl_imagebuilder::registry::Registry;
use arl_imagebuilder::service::{Builds, Cluster, ImageBuilder, Recipes};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{
    EnvironmentLocation, EnvironmentRef, ImageFailedV1, ImageFailureReason, ImageReadyV1, Split,
    TaskBatchV1, TaskKind, TaskRef,
};
use arl_schemas::{Domain, Event, RunId, TaskId};
use arl_testkit::{NatsServer, test_namespace, wait_for};
use hyper::{Request, Response};
use kube::client::Body;
use serde_json::{Value, json};

mod common;
use common::LocalRegistry;

const NAMESPACE: &str = "builds";
const JOBS: &str = "/apis/batch/v1/namespaces/builds/jobs";
const PODS: &str = "/api/v1/namespaces/builds/pods";

/// One request the builder sent.
#[derive(Clone, Debug)]
struct Exchange {
    method: String,
    path: String,
    query: String,
    body: Value,
}

impl Exchange {
    fn is(&self, method: &str, path: &str) -> bool {
        self.method == method && self.path == path
    }
}

/// An answer: a status and a body (JSON, or the text of a log).
struct Reply {
    status: u16,
    body: Vec<u8>,
}

fn ok(value: Value) -> Reply {
    Reply {
        status: 200,
        body: serde_json::to_vec(&value).unwrap(),
    }
}

fn text(log: &str) -> Reply {
    Reply {
        status: 200,
        body: log.as_bytes().to_vec(),
    }
}

/// The API server's 403 for a service account without the RBAC rule.
fn forbidden(verb: &str, resource: &str, group: &str) -> Reply {
    Reply {
        status: 403,
        body: serde_json::to_vec(&json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{resource} is forbidden: User \"system:serviceaccount:arl:imagebuilder\" cannot {verb} resource \"{resource}\" in API group \"{group}\" in the namespace \"{NAMESPACE}\""),
            "reason": "Forbidden", "details": {"kind": resource, "group": group}, "code": 403
        }))
        .unwrap(),
    }
}

fn not_found() -> Reply {
    Reply {
        status: 404,
        body: serde_json::to_vec(&json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "not found", "reason": "NotFound", "code": 404
        }))
        .unwrap(),
    }
}

fn job(name: &str, status: Value) -> Value {
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"type": "image-build"}},
        "status": status
    })
}

fn condition(kind: &str, reason: &str, message: &str) -> Value {
    json!({"conditions": [{"type": kind, "status": "True", "reason": reason, "message": message}]})
}

fn pods(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": items})
}

fn pod(job: &str, status: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{job}-x7k2p"), "namespace": NAMESPACE, "labels": {"job-name": job}},
        "status": status
    })
}

fn running(job: &str) -> Value {
    pod(job, json!({"phase": "Running"}))
}

fn deleted(name: &str) -> Value {
    job(name, json!({}))
}

/// The mock API server: answers each request with `answer` and records it.
struct MockApi {
    exchanges: Arc<Mutex<Vec<Exchange>>>,
}

impl MockApi {
    fn start<F, Fut>(mut answer: F) -> (kube::Client, Self)
    where
        F: FnMut(Exchange) -> Fut + Send + 'static,
        Fut: Future<Output = Reply> + Send,
    {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let exchanges = Arc::new(Mutex::new(Vec::new()));
        let recorded = exchanges.clone();
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let (parts, body) = request.into_parts();
                let body = body.collect_bytes().await.unwrap();
                let exchange = Exchange {
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_owned(),
                    query: parts.uri.query().unwrap_or_default().to_owned(),
                    body: serde_json::from_slice(&body).unwrap_or(Value::Null),
                };
                recorded.lock().unwrap().push(exchange.clone());
                let reply = answer(exchange).await;
                send.send_response(
                    Response::builder()
                        .status(reply.status)
                        .header("content-type", "application/json")
                        .body(Body::from(reply.body))
                        .unwrap(),
                );
            }
        });
        (kube::Client::new(service, NAMESPACE), Self { exchanges })
    }

    fn exchanges(&self) -> Vec<Exchange> {
        self.exchanges.lock().unwrap().clone()
    }

    /// `METHOD path` of each request, repeated polls collapsed into one.
    fn calls(&self) -> Vec<String> {
        let mut calls: Vec<String> = Vec::new();
        for e in self.exchanges() {
            let call = format!("{} {}", e.method, e.path);
            if calls.last() != Some(&call) {
                calls.push(call);
            }
        }
        calls
    }
}

fn config() -> JobConfig {
    JobConfig {
        namespace: NAMESPACE.into(),
        buildkit_image: "moby/buildkit:v0.23.0-rootless".into(),
        contexts_claim: "arl-build-contexts".into(),
        registry_secret: Some("registry-push".into()),
        insecure_registry: true,
        timeout: Duration::from_secs(1800),
        pending_timeout: Duration::from_millis(300),
        ttl_after_finished: Duration::from_secs(3600),
        keep_failed: false,
        polling: Polling {
            first: Duration::from_millis(5),
            max: Duration::from_millis(20),
        },
    }
}

const NAME: &str = "arl-build-django--django-9296-0a1b2c3d";
const REFERENCE: &str = "registry:5000/swebench/django__django-9296:latest";

async fn build(jobs: &JobBuilds) -> Result<(), JobBuildError> {
    let run = RunId::new("run-7").unwrap();
    let task = TaskId::new("django__django-9296").unwrap();
    jobs.build(&JobBuild {
        name: NAME,
        reference: REFERENCE,
        run: &run,
        task: &task,
    })
    .await
}

/// Answers for a Job that runs, then ends with `outcome` (a Job status) on the third look,
/// its pod's log being `log`.
fn finishing(
    outcome: Value,
    log: &'static str,
) -> impl FnMut(Exchange) -> std::future::Ready<Reply> {
    let mut looks = 0;
    move |e: Exchange| {
        let job_path = format!("{JOBS}/{NAME}");
        let reply = if e.is("POST", JOBS) {
            ok(e.body.clone())
        } else if e.is("GET", &job_path) {
            looks += 1;
            ok(job(
                NAME,
                if looks < 3 {
                    json!({"active": 1})
                } else {
                    outcome.clone()
                },
            ))
        } else if e.is("GET", PODS) {
            ok(pods(vec![running(NAME)]))
        } else if e.is("GET", &format!("{PODS}/{NAME}-x7k2p/log")) {
            text(log)
        } else if e.is("DELETE", &job_path) {
            ok(deleted(NAME))
        } else {
            not_found()
        };
        std::future::ready(reply)
    }
}

#[tokio::test]
async fn a_build_job_runs_rootless_buildkit_and_is_deleted_when_it_succeeded() {
    let (client, api) = MockApi::start(finishing(
        condition(
            "Complete",
            "CompletionsReached",
            "Reached expected number of succeeded pods",
        ),
        "",
    ));
    let jobs = JobBuilds::new(client, config());
    build(&jobs).await.unwrap();

    assert_eq!(
        api.calls(),
        [
            format!("POST {JOBS}"),
            format!("GET {JOBS}/{NAME}"),
            format!("GET {PODS}"),
            format!("GET {JOBS}/{NAME}"),
            format!("DELETE {JOBS}/{NAME}"),
        ],
        "{:#?}",
        api.exchanges()
    );
    let exchanges = api.exchanges();
    // The pod is looked up by the label the Job controller gives it, until it has started.
    let pod_lookups: Vec<&Exchange> = exchanges.iter().filter(|e| e.path == PODS).collect();
    assert_eq!(pod_lookups.len(), 1, "{pod_lookups:#?}");
    assert!(
        pod_lookups[0]
            .query
            .contains(&format!("labelSelector=job-name%3D{NAME}")),
        "{}",
        pod_lookups[0].query
    );
    let delete = exchanges.last().unwrap();
    assert_eq!(delete.body["propagationPolicy"], "Background", "{delete:?}");

    let created = &exchanges[0].body;
    assert_eq!(created["apiVersion"], "batch/v1");
    assert_eq!(created["kind"], "Job");
    assert_eq!(created["metadata"]["name"], NAME);
    let labels = json!({
        "type": "image-build",
        "app.kubernetes.io/managed-by": "arl-imagebuilder",
        "arl.dev/run": "run-7",
        "arl.dev/task": "django__django-9296",
    });
    assert_eq!(created["metadata"]["labels"], labels);
    assert_eq!(
        created["metadata"]["annotations"]["arl.dev/image"],
        REFERENCE
    );
    let spec = &created["spec"];
    assert_eq!(spec["backoffLimit"], 0);
    assert_eq!(spec["activeDeadlineSeconds"], 1800);
    assert_eq!(spec["ttlSecondsAfterFinished"], 3600);
    assert_eq!(spec["template"]["metadata"]["labels"], labels);
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["restartPolicy"], "Never");
    assert_eq!(pod["automountServiceAccountToken"], false);
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let container = &containers[0];
    assert_eq!(container["name"], "buildkit");
    assert_eq!(container["image"], "moby/buildkit:v0.23.0-rootless");
    assert_eq!(container["command"], json!(["buildctl-daemonless.sh"]));
    assert_eq!(
        container["args"],
        json!([
            "build",
            "--frontend",
            "dockerfile.v0",
            "--local",
            "context=/workspace",
            "--local",
            "dockerfile=/workspace",
            "--output",
            format!("type=image,name={REFERENCE},push=true,registry.insecure=true"),
        ])
    );
    assert_eq!(
        container["env"],
        json!([
            {"name": "BUILDKITD_FLAGS", "value": "--oci-worker-no-process-sandbox"},
            {"name": "DOCKER_CONFIG", "value": "/home/user/.docker"},
        ])
    );
    assert_eq!(
        container["securityContext"],
        json!({
            "runAsUser": 1000, "runAsGroup": 1000,
            "seccompProfile": {"type": "Unconfined"},
            "appArmorProfile": {"type": "Unconfined"},
        })
    );
    assert_eq!(
        container["volumeMounts"],
        json!([
            {"name": "context", "mountPath": "/workspace", "subPath": NAME, "readOnly": true},
            {"name": "buildkit-state", "mountPath": "/home/user/.local/share/buildkit"},
            {"name": "registry-auth", "mountPath": "/home/user/.docker", "readOnly": true},
        ])
    );
    assert_eq!(
        pod["volumes"],
        json!([
            {"name": "context", "persistentVolumeClaim": {"claimName": "arl-build-contexts", "readOnly": true}},
            {"name": "buildkit-state", "emptyDir": {}},
            {"name": "registry-auth", "secret": {"secretName": "registry-push", "items": [{"key": ".dockerconfigjson", "path": "config.json"}]}},
        ])
    );
}

#[tokio::test]
async fn a_failed_build_job_is_reported_with_its_log_tail() {
    let log = "#7 [3/4] RUN [\"/bin/bash\", \"/opt/arl-setup.sh\"]\n#7 12.3 ERROR: No matching distribution found for Django==9.9\nerror: failed to solve: process \"/bin/bash /opt/arl-setup.sh\" did not complete successfully: exit code: 1\n";
    let (client, api) = MockApi::start(finishing(
        condition(
            "Failed",
            "BackoffLimitExceeded",
            "Job has reached the specified backoff limit",
        ),
        log,
    ));
    let jobs = JobBuilds::new(client, config());
    let error = build(&jobs).await.unwrap_err();
    assert!(matches!(error, JobBuildError::Failed { .. }), "{error:?}");
    assert!(
        error.to_string().contains("BackoffLimitExceeded"),
        "{error}"
    );
    assert_eq!(error.log_tail(), log.trim_end());
    let logs = api
        .exchanges()
        .into_iter()
        .find(|e| e.path.ends_with("/log"))
        .unwrap();
    assert_eq!(logs.path, format!("{PODS}/{NAME}-x7k2p/log"));
    assert!(logs.query.contains("container=buildkit"), "{}", logs.query);
    assert!(logs.query.contains("tailLines=40"), "{}", logs.query);
    assert_eq!(
        api.calls().last().unwrap(),
        &format!("DELETE {JOBS}/{NAME}")
    );

    // Kept for debugging when asked: read, reported, not deleted.
    let (client, api) = MockApi::start(finishing(
        condition("Failed", "BackoffLimitExceeded", "backoff limit"),
        log,
    ));
    let jobs = JobBuilds::new(
        client,
        JobConfig {
            keep_failed: true,
            ..config()
        },
    );
    let error = build(&jobs).await.unwrap_err();
    assert_eq!(error.log_tail(), log.trim_end());
    assert!(
        api.exchanges().iter().all(|e| e.method != "DELETE"),
        "{:#?}",
        api.calls()
    );
}

#[tokio::test]
async fn a_build_job_past_its_deadline_is_a_timeout() {
    let (client, api) = MockApi::start(finishing(
        condition(
            "Failed",
            "DeadlineExceeded",
            "Job was active longer than specified deadline",
        ),
        "#9 exporting layers\n",
    ));
    let jobs = JobBuilds::new(client, config());
    let error = build(&jobs).await.unwrap_err();
    assert!(matches!(error, JobBuildError::Timeout { .. }), "{error:?}");
    assert!(error.to_string().contains("1800s deadline"), "{error}");
    assert_eq!(error.log_tail(), "#9 exporting layers");
    assert_eq!(
        api.calls().last().unwrap(),
        &format!("DELETE {JOBS}/{NAME}")
    );
}

#[tokio::test]
async fn a_pod_that_never_starts_is_given_up_with_its_waiting_reason() {
    let pull_backoff = json!({
        "phase": "Pending",
        "containerStatuses": [{
            "name": "buildkit", "image": "moby/buildkit:v0.23.0-rootless", "imageID": "",
            "ready": false, "restartCount": 0,
            "state": {"waiting": {
                "reason": "ImagePullBackOff",
                "message": "Back-off pulling image \"moby/buildkit:v0.23.0-rootless\""
            }}
        }]
    });
    let unschedulable = json!({
        "phase": "Pending",
        "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient memory."
        }]
    });
    for (status, reason, message) in [
        (pull_backoff, "ImagePullBackOff", "Back-off pulling image"),
        (unschedulable, "Unschedulable", "3 Insufficient memory"),
    ] {
        let (client, api) = MockApi::start(move |e: Exchange| {
            let job_path = format!("{JOBS}/{NAME}");
            let reply = if e.is("POST", JOBS) {
                ok(e.body.clone())
            } else if e.is("GET", &job_path) {
                ok(job(NAME, json!({"active": 1})))
            } else if e.is("GET", PODS) {
                ok(pods(vec![pod(NAME, status.clone())]))
            } else if e.is("DELETE", &job_path) {
                ok(deleted(NAME))
            } else {
                not_found()
            };
            std::future::ready(reply)
        });
        let jobs = JobBuilds::new(client, config());
        let started = std::time::Instant::now();
        let error = build(&jobs).await.unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(300));
        let JobBuildError::NotStarted {
            reason: got_reason,
            message: got_message,
            ..
        } = &error
        else {
            panic!("{error:?}")
        };
        assert_eq!(got_reason, reason);
        assert!(got_message.contains(message), "{got_message}");
        assert!(error.to_string().contains(reason), "{error}");
        // Given up and cleaned up: no log to read from a pod that never ran.
        assert!(api.exchanges().iter().all(|e| !e.path.ends_with("/log")));
        assert_eq!(
            api.calls().last().unwrap(),
            &format!("DELETE {JOBS}/{NAME}")
        );
    }
}

#[tokio::test]
async fn a_passing_api_error_during_the_watch_is_ridden_out() {
    let mut succeed = finishing(condition("Complete", "CompletionsReached", ""), "");
    let mut looks = 0;
    let (client, api) = MockApi::start(move |e: Exchange| {
        if e.is("GET", &format!("{JOBS}/{NAME}")) {
            looks += 1;
            if looks == 1 {
                return std::future::ready(Reply {
                    status: 503,
                    body: b"upstream connect error".to_vec(),
                });
            }
        }
        succeed(e)
    });
    let jobs = JobBuilds::new(client, config());
    build(&jobs).await.unwrap();
    assert_eq!(
        api.calls().last().unwrap(),
        &format!("DELETE {JOBS}/{NAME}")
    );
}

#[tokio::test]
async fn a_403_says_which_permission_the_service_account_lacks() {
    // No `create` on jobs: reported at once, nothing else asked.
    let (client, api) =
        MockApi::start(|_e: Exchange| std::future::ready(forbidden("create", "jobs", "batch")));
    let jobs = JobBuilds::new(client, config());
    let error = build(&jobs).await.unwrap_err();
    let JobBuildError::Forbidden { verb, resource, .. } = &error else {
        panic!("{error:?}")
    };
    assert_eq!((*verb, *resource), ("create", "jobs.batch"));
    let message = error.to_string();
    assert!(
        message.contains("may not create jobs.batch in namespace builds"),
        "{message}"
    );
    assert!(
        message.contains("grant it `create` on `jobs.batch`"),
        "{message}"
    );
    assert!(
        message.contains("cannot create resource \"jobs\""),
        "the API's own words: {message}"
    );
    assert_eq!(api.calls(), [format!("POST {JOBS}")]);

    // No `list` on pods: the watch stops there, and the Job is still cleaned up.
    let (client, api) = MockApi::start(|e: Exchange| {
        let job_path = format!("{JOBS}/{NAME}");
        let reply = if e.is("POST", JOBS) {
            ok(e.body.clone())
        } else if e.is("GET", &job_path) {
            ok(job(NAME, json!({"active": 1})))
        } else if e.is("GET", PODS) {
            forbidden("list", "pods", "")
        } else if e.is("DELETE", &job_path) {
            ok(deleted(NAME))
        } else {
            not_found()
        };
        std::future::ready(reply)
    });
    let jobs = JobBuilds::new(client, config());
    let error = build(&jobs).await.unwrap_err();
    assert!(
        error
            .to_string()
            .contains("may not list pods in namespace builds"),
        "{error}"
    );
    assert_eq!(
        api.calls(),
        [
            format!("POST {JOBS}"),
            format!("GET {JOBS}/{NAME}"),
            format!("GET {PODS}"),
            format!("DELETE {JOBS}/{NAME}"),
        ]
    );
}

/// The service in cluster mode with build Jobs: one task's Job succeeds (and "pushes": the
/// test puts the image into the real registry when the Job is created), the other's fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_reports_job_builds_as_ready_by_digest_or_failed_with_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let registry_process = Arc::new(LocalRegistry::start(dir.path(), None).await);
    let port = registry_process.port;
    let contexts = dir.path().join("contexts");
    std::fs::create_dir_all(&contexts).unwrap();

    // The succeeding build pushes its image when "run"; the context must be there for it.
    let pushed = Arc::new(Mutex::new(None::<String>));
    let contexts_seen = Arc::new(Mutex::new(Vec::<bool>::new()));
    let (client, api) = MockApi::start({
        let (registry_process, pushed, contexts_seen, contexts) = (
            registry_process.clone(),
            pushed.clone(),
            contexts_seen.clone(),
            contexts.clone(),
        );
        move |e: Exchange| {
            let (registry_process, pushed, contexts_seen, contexts) = (
                registry_process.clone(),
                pushed.clone(),
                contexts_seen.clone(),
                contexts.clone(),
            );
            async move {
                let name = e
                    .path
                    .strip_prefix(&format!("{JOBS}/"))
                    .map(str::to_owned)
                    .or_else(|| e.body["metadata"]["name"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                let succeeds = name.contains("9296");
                if e.is("POST", JOBS) {
                    contexts_seen
                        .lock()
                        .unwrap()
                        .push(contexts.join(&name).join("Dockerfile").is_file());
                    if succeeds {
                        let digest = registry_process
                            .push_image("swebench/django__django-9296", None)
                            .await;
                        *pushed.lock().unwrap() = Some(digest);
                    }
                    return ok(e.body.clone());
                }
                if e.method == "GET" && e.path.starts_with(JOBS) {
                    return ok(job(
                        &name,
                        if succeeds {
                            condition("Complete", "CompletionsReached", "")
                        } else {
                            condition("Failed", "BackoffLimitExceeded", "backoff limit")
                        },
                    ));
                }
                if e.method == "GET" && e.path == PODS {
                    let job_name = e.query.rsplit("job-name%3D").next().unwrap_or_default();
                    return ok(pods(vec![pod(job_name, json!({"phase": "Failed"}))]));
                }
                if e.method == "GET" && e.path.ends_with("/log") {
                    return text("error: failed to solve: exit code: 1\n");
                }
                if e.method == "DELETE" {
                    return ok(deleted(&name));
                }
                not_found()
            }
        }
    });

    let server = NatsServer::start().unwrap();
    let bus = Bus::connect(
        BusConfig::new(server.url(), test_namespace(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let swebench = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/swebench");
    let mut recipes = Recipes {
        swebench_dir: swebench.clone(),
        pyenv_root: "/root/.pyenv".into(),
        ..Recipes::default()
    };
    for instance in load_instances(&swebench.join("instances.json")).unwrap() {
        recipes
            .swebench
            .insert(instance.instance_id.clone(), instance);
    }
    let local = Arc::new(LocalBuilder::new(LocalConfig {
        root: dir.path().join("environments"),
        pyenv_root: "/root/.pyenv".into(),
        pip_cache: dir.path().join("pip"),
        timeout: Duration::from_secs(60),
    }));
    let cluster = Cluster {
        registry: Registry::new(&registry_process.base, "swebench", None),
        builds: Builds::Jobs(Arc::new(JobBuilds::new(client, config()))),
        contexts: contexts.clone(),
    };
    let shutdown = Shutdown::new();
    ImageBuilder::new(bus.clone(), local, recipes)
        .with_cluster(cluster)
        .start(&shutdown);
    let run = RunId::new("run-jobs").unwrap();
    let task = |id: &str| TaskRef {
        task_id: TaskId::new(id).unwrap(),
        kind: TaskKind::Swebench,
        dataset_digest: "sha256:test".into(),
        environment: EnvironmentRef {
            name: format!("swebench/{id}"),
            digest: None,
        },
    };
    bus.publish(&TaskBatchV1 {
        run_id: run.clone(),
        step: 1,
        split: Split::Train,
        samples_per_task: 2,
        tasks: vec![task("django__django-9296"), task("django__django-11880")],
    })
    .await
    .unwrap();
    let last = |event: &'static str| {
        let bus = bus.clone();
        let run = run.clone();
        async move {
            let stream = bus
                .jetstream()
                .get_stream(bus.namespace().stream(Domain::Image))
                .await
                .ok()?;
            let message = stream
                .get_last_raw_message_by_subject(&bus.namespace().event_subject(
                    Domain::Image,
                    &run,
                    event,
                ))
                .await
                .ok()?;
            Some(message.payload)
        }
    };
    let ready = wait_for("image.ready", Duration::from_secs(30), || last("ready")).await;
    let ready = ImageReadyV1::decode(&ready).unwrap();
    let digest = pushed.lock().unwrap().clone().unwrap();
    assert_eq!(ready.task_id.as_str(), "django__django-9296");
    assert!(!ready.cached);
    assert_eq!(
        ready.location,
        EnvironmentLocation::OciImage {
            reference: format!("127.0.0.1:{port}/swebench/django__django-9296:latest@{digest}")
        }
    );
    let failed = wait_for("image.failed", Duration::from_secs(30), || last("failed")).await;
    let failed = ImageFailedV1::decode(&failed).unwrap();
    assert_eq!(failed.task_id.as_str(), "django__django-11880");
    assert_eq!(failed.reason, ImageFailureReason::BuildError);
    assert!(
        failed.message.contains("BackoffLimitExceeded"),
        "{}",
        failed.message
    );
    assert_eq!(failed.log_tail, "error: failed to solve: exit code: 1");

    // Each Job saw its context; both Jobs and both contexts are gone.
    assert_eq!(*contexts_seen.lock().unwrap(), [true, true]);
    let exchanges = api.exchanges();
    let created: Vec<&Exchange> = exchanges.iter().filter(|e| e.method == "POST").collect();
    assert_eq!(created.len(), 2);
    for job in created {
        let name = job.body["metadata"]["name"].as_str().unwrap();
        assert!(name.starts_with("arl-build-django--django-"), "{name}");
        assert_eq!(job.body["metadata"]["labels"]["arl.dev/run"], "run-jobs");
        assert!(
            exchanges
                .iter()
                .any(|e| e.is("DELETE", &format!("{JOBS}/{name}"))),
            "{name} not deleted"
        );
    }
    assert_eq!(std::fs::read_dir(&contexts).unwrap().count(), 0);
    shutdown.trigger();
    shutdown.wait().await;
}
