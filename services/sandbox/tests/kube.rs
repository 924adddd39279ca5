//! The Kubernetes backend against a scripted API server: real HTTP and the exec
//! subresource's websocket protocol (v5.channel.k8s.io), spoken by kube-rs itself. The
//! cluster is the test double: Pods are JSON objects whose status the script decides, and
//! a Pod's "container" is a folder on this machine where exec'd commands run. What is
//! checked is what ARL asks of the cluster and how it reads the answers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::backend::{Activation, Backend, ExecSpec};
use arl_sandbox::config::ResolvedLimits;
use arl_sandbox::kube::{Kube, KubeSettings, OwnerPod};
use arl_sandbox::lease::LeaseRecord;
use arl_sandbox::{SandboxConfig, SandboxService};
use arl_schemas::events::{EnvironmentRef, SandboxBackend};
use arl_schemas::rpc::{LeaseGrantV1, LeaseRequestV1, SandboxLimits, SandboxOp};
use arl_schemas::{LeaseId, RunId};
use arl_testkit::{NatsServer, http, test_namespace, wait_for};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

/// How the scripted cluster treats new Pods.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Script {
    /// Pods run at once.
    Run,
    /// The image cannot be pulled.
    ImagePull,
    /// No node fits: Pending forever.
    Unschedulable,
    /// The service account may not create Pods.
    Forbidden,
    /// The SandboxSet has nothing to give: claims complete with none claimed.
    EmptySet,
}

struct Cluster {
    script: Script,
    pods: BTreeMap<String, Value>,
    /// OpenKruise objects: claims, and the Sandboxes the "controller" binds to them.
    claims: BTreeMap<String, Value>,
    sandboxes: BTreeMap<String, Value>,
    /// (method, path and query) of every request, in order.
    requests: Vec<(String, String)>,
    /// Each Pod's "container": where its commands run.
    containers: BTreeMap<String, PathBuf>,
    root: PathBuf,
}

#[derive(Clone)]
struct FakeApi {
    cluster: Arc<Mutex<Cluster>>,
    addr: SocketAddr,
    _root: Arc<tempfile::TempDir>,
}

impl FakeApi {
    async fn start(script: Script) -> Self {
        let root = Arc::new(tempfile::tempdir().unwrap());
        let cluster = Arc::new(Mutex::new(Cluster {
            script,
            pods: BTreeMap::new(),
            claims: BTreeMap::new(),
            sandboxes: BTreeMap::new(),
            requests: Vec::new(),
            containers: BTreeMap::new(),
            root: root.path().to_path_buf(),
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = cluster.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let cluster = serving.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let cluster = cluster.clone();
                        async move { Ok::<_, Infallible>(answer(cluster, request).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Self {
            cluster,
            addr,
            _root: root,
        }
    }

    fn client(&self) -> kube::Client {
        let url: hyper::Uri = format!("http://{}", self.addr).parse().unwrap();
        let mut config = kube::Config::new(url);
        config.default_namespace = "arl".into();
        kube::Client::try_from(config).unwrap()
    }

    fn backend(&self, instance: &str, owner: Option<OwnerPod>) -> Kube {
        Kube::new(self.client(), self.settings(instance, owner))
    }

    fn settings(&self, instance: &str, owner: Option<OwnerPod>) -> KubeSettings {
        KubeSettings {
            namespace: "arl".into(),
            registry: Some("registry.test:5000".into()),
            images: BTreeMap::new(),
            sandboxsets: BTreeMap::new(),
            instance: instance.into(),
            owner,
            service_account: Some("arl-sandbox-pods".into()),
            runtime_class: None,
            proxy_url: Some("http://arl-proxy.arl.svc:8000/v1".into()),
            default_limits: ResolvedLimits::default(),
            ready_timeout: Duration::from_secs(1),
            image_pull_secrets: vec!["registry".into()],
        }
    }

    fn pods(&self) -> BTreeMap<String, Value> {
        self.cluster.lock().unwrap().pods.clone()
    }

    fn claims(&self) -> BTreeMap<String, Value> {
        self.cluster.lock().unwrap().claims.clone()
    }

    fn sandboxes(&self) -> BTreeMap<String, Value> {
        self.cluster.lock().unwrap().sandboxes.clone()
    }

    /// A backend serving `math` from the SandboxSet `python-pool`.
    fn kruise_backend(&self) -> Kube {
        Kube::new(
            self.client(),
            KubeSettings {
                registry: None,
                sandboxsets: BTreeMap::from([("math".into(), "python-pool".into())]),
                ..self.settings("a", None)
            },
        )
    }

    fn requests(&self) -> Vec<(String, String)> {
        self.cluster.lock().unwrap().requests.clone()
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

fn status_failure(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// The Pod as the cluster reports it now.
fn with_status(mut pod: Value, script: Script) -> Value {
    let container = |state: Value| {
        json!([{"name": "sandbox", "image": pod["spec"]["containers"][0]["image"],
                "imageID": "", "ready": state.get("running").is_some(), "restartCount": 0,
                "state": state}])
    };
    pod["status"] = match script {
        Script::Run | Script::Forbidden | Script::EmptySet => json!({"phase": "Running",
            "containerStatuses": container(json!({"running": {"startedAt": "2026-12-03T00:00:00Z"}}))}),
        Script::ImagePull => json!({"phase": "Pending",
            "containerStatuses": container(json!({"waiting": {"reason": "ImagePullBackOff",
                "message": "Back-off pulling image \"registry.test:5000/swebench/x:latest\""}}))}),
        Script::Unschedulable => json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
            "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient memory."}]}),
    };
    pod
}

/// `a=b,c!=d` against a Pod's labels.
fn selected(pod: &Value, selector: &str) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let labels = &pod["metadata"]["labels"];
        if let Some((key, value)) = term.split_once("!=") {
            labels[key].as_str() != Some(value)
        } else if let Some((key, value)) = term.split_once('=') {
            labels[key].as_str() == Some(value)
        } else {
            labels.get(term).is_some()
        }
    })
}

fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

async fn answer(
    cluster: Arc<Mutex<Cluster>>,
    mut request: Request<hyper::body::Incoming>,
) -> Response<Full<Bytes>> {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let query = request.uri().query().unwrap_or_default().to_owned();
    cluster
        .lock()
        .unwrap()
        .requests
        .push((method.to_string(), format!("{path}?{query}")));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // api/v1/namespaces/arl/pods[/name[/exec]]
    match (method, parts.as_slice()) {
        (Method::POST, ["api", "v1", "namespaces", _, "pods"]) => {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let pod: Value = serde_json::from_slice(&body).unwrap();
            let mut cluster = cluster.lock().unwrap();
            if cluster.script == Script::Forbidden {
                return json_response(
                    StatusCode::FORBIDDEN,
                    &status_failure(
                        403,
                        "Forbidden",
                        "pods is forbidden: User \"system:serviceaccount:arl:arl-sandbox\" cannot create resource \"pods\" in API group \"\" in the namespace \"arl\"",
                    ),
                );
            }
            let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
            let container = cluster.root.join(&name);
            std::fs::create_dir_all(&container).unwrap();
            std::fs::write(container.join("README"), "fresh tree\n").unwrap();
            cluster.containers.insert(name.clone(), container);
            cluster.pods.insert(name, pod.clone());
            json_response(StatusCode::CREATED, &pod)
        }
        (Method::GET, ["api", "v1", "namespaces", _, "pods"]) => {
            let selector = query_pairs(&query)
                .into_iter()
                .find(|(k, _)| k == "labelSelector")
                .map(|(_, v)| v)
                .unwrap_or_default();
            let cluster = cluster.lock().unwrap();
            let items: Vec<Value> = cluster
                .pods
                .values()
                .filter(|pod| selected(pod, &selector))
                .map(|pod| with_status(pod.clone(), cluster.script))
                .collect();
            json_response(
                StatusCode::OK,
                &json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}),
            )
        }
        (Method::GET, ["api", "v1", "namespaces", _, "pods", name]) => {
            let cluster = cluster.lock().unwrap();
            match cluster.pods.get(*name) {
                Some(pod) => {
                    json_response(StatusCode::OK, &with_status(pod.clone(), cluster.script))
                }
                None => json_response(
                    StatusCode::NOT_FOUND,
                    &status_failure(404, "NotFound", &format!("pods \"{name}\" not found")),
                ),
            }
        }
        (Method::PATCH, ["api", "v1", "namespaces", _, "pods", name]) => {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let patch: Value = serde_json::from_slice(&body).unwrap();
            let mut cluster = cluster.lock().unwrap();
            let Some(pod) = cluster.pods.get_mut(*name) else {
                return json_response(
                    StatusCode::NOT_FOUND,
                    &status_failure(404, "NotFound", "gone"),
                );
            };
            for field in ["labels", "annotations"] {
                if let Some(map) = patch["metadata"][field].as_object() {
                    for (key, value) in map {
                        pod["metadata"][field][key] = value.clone();
                    }
                }
            }
            json_response(StatusCode::OK, &pod.clone())
        }
        (Method::DELETE, ["api", "v1", "namespaces", _, "pods", name]) => {
            let mut cluster = cluster.lock().unwrap();
            match cluster.pods.remove(*name) {
                Some(pod) => json_response(StatusCode::OK, &pod),
                None => json_response(
                    StatusCode::NOT_FOUND,
                    &status_failure(404, "NotFound", "gone"),
                ),
            }
        }
        (Method::GET, ["api", "v1", "namespaces", _, "pods", name, "exec"]) => {
            let container = cluster.lock().unwrap().containers.get(*name).cloned();
            let Some(container) = container else {
                return json_response(
                    StatusCode::NOT_FOUND,
                    &status_failure(404, "NotFound", "no pod"),
                );
            };
            let pairs = query_pairs(&query);
            let command: Vec<String> = pairs
                .iter()
                .filter(|(k, _)| k == "command")
                .map(|(_, v)| v.clone())
                .collect();
            let stdin = pairs.iter().any(|(k, v)| k == "stdin" && v == "true");
            let key = request
                .headers()
                .get("sec-websocket-key")
                .unwrap()
                .as_bytes()
                .to_vec();
            let upgrade = hyper::upgrade::on(&mut request);
            tokio::spawn(async move {
                let upgraded = upgrade.await.unwrap();
                let socket = tokio_tungstenite::WebSocketStream::from_raw_socket(
                    TokioIo::new(upgraded),
                    tokio_tungstenite::tungstenite::protocol::Role::Server,
                    None,
                )
                .await;
                run_exec(socket, container, command, stdin).await;
            });
            Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header(
                    "sec-websocket-accept",
                    tokio_tungstenite::tungstenite::handshake::derive_accept_key(&key),
                )
                .header("sec-websocket-protocol", "v5.channel.k8s.io")
                .body(Full::new(Bytes::new()))
                .unwrap()
        }
        (
            Method::POST,
            [
                "apis",
                "agents.kruise.io",
                "v1alpha1",
                "namespaces",
                _,
                "sandboxclaims",
            ],
        ) => {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let mut claim: Value = serde_json::from_slice(&body).unwrap();
            let mut cluster = cluster.lock().unwrap();
            let name = claim["metadata"]["name"].as_str().unwrap().to_owned();
            // The OpenKruise controller's part: bind a warm Sandbox (and its Pod, of the
            // Sandbox's name) to the claim, with the claim's labels — or have none.
            if cluster.script == Script::EmptySet {
                claim["status"] = json!({"phase": "Completed", "claimedReplicas": 0,
                    "message": "no available sandboxes in SandboxSet python-pool"});
            } else {
                let sandbox = format!(
                    "{}-{}",
                    claim["spec"]["templateName"].as_str().unwrap(),
                    cluster.sandboxes.len()
                );
                let container = cluster.root.join(&sandbox);
                std::fs::create_dir_all(&container).unwrap();
                std::fs::write(container.join("README"), "fresh tree\n").unwrap();
                cluster.containers.insert(sandbox.clone(), container);
                cluster.pods.insert(
                    sandbox.clone(),
                    json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": sandbox, "namespace": "arl", "labels": {}},
                    "spec": {"containers": [{"name": "main", "image": "python:3.12"}]}}),
                );
                cluster.sandboxes.insert(sandbox.clone(), json!({
                    "apiVersion": "agents.kruise.io/v1alpha1", "kind": "Sandbox",
                    "metadata": {"name": sandbox, "namespace": "arl",
                        "labels": claim["spec"]["labels"], "annotations": claim["spec"]["annotations"]},
                    "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}));
                claim["status"] = json!({"phase": "Completed", "claimedReplicas": 1});
            }
            cluster.claims.insert(name, claim.clone());
            json_response(StatusCode::CREATED, &claim)
        }
        (
            Method::GET,
            [
                "apis",
                "agents.kruise.io",
                "v1alpha1",
                "namespaces",
                _,
                "sandboxclaims",
                name,
            ],
        ) => match cluster.lock().unwrap().claims.get(*name) {
            Some(claim) => json_response(StatusCode::OK, claim),
            None => json_response(
                StatusCode::NOT_FOUND,
                &status_failure(404, "NotFound", "gone"),
            ),
        },
        (
            Method::DELETE,
            [
                "apis",
                "agents.kruise.io",
                "v1alpha1",
                "namespaces",
                _,
                "sandboxclaims",
                name,
            ],
        ) => match cluster.lock().unwrap().claims.remove(*name) {
            Some(claim) => json_response(StatusCode::OK, &claim),
            None => json_response(
                StatusCode::NOT_FOUND,
                &status_failure(404, "NotFound", "gone"),
            ),
        },
        (
            Method::GET,
            [
                "apis",
                "agents.kruise.io",
                "v1alpha1",
                "namespaces",
                _,
                "sandboxes",
            ],
        ) => {
            let selector = query_pairs(&query)
                .into_iter()
                .find(|(k, _)| k == "labelSelector")
                .map(|(_, v)| v)
                .unwrap_or_default();
            let cluster = cluster.lock().unwrap();
            let items: Vec<Value> = cluster
                .sandboxes
                .values()
                .filter(|s| selected(s, &selector))
                .cloned()
                .collect();
            json_response(
                StatusCode::OK,
                &json!({"apiVersion": "agents.kruise.io/v1alpha1",
                "kind": "SandboxList", "metadata": {}, "items": items}),
            )
        }
        (
            Method::PATCH,
            [
                "apis",
                "agents.kruise.io",
                "v1alpha1",
                "namespaces",
                _,
                "sandboxes",
                name,
            ],
        ) => {
            let body = request.into_body().collect().await.unwrap().to_bytes();
            let patch: Value = serde_json::from_slice(&body).unwrap();
            let mut cluster = cluster.lock().unwrap();
            let Some(sandbox) = cluster.sandboxes.get_mut(*name) else {
                return json_response(
                    StatusCode::NOT_FOUND,
                    &status_failure(404, "NotFound", "gone"),
                );
            };
            for field in ["labels", "annotations"] {
                if let Some(map) = patch["metadata"][field].as_object() {
                    for (key, value) in map {
                        sandbox["metadata"][field][key] = value.clone();
                    }
                }
            }
            json_response(StatusCode::OK, &sandbox.clone())
        }
        (
            Method::DELETE,
            [
                "apis",
                "agents.kruise.io",
                "v1alpha1",
                "namespaces",
                _,
                "sandboxes",
                name,
            ],
        ) => {
            let mut cluster = cluster.lock().unwrap();
            cluster.pods.remove(*name);
            match cluster.sandboxes.remove(*name) {
                Some(sandbox) => json_response(StatusCode::OK, &sandbox),
                None => json_response(
                    StatusCode::NOT_FOUND,
                    &status_failure(404, "NotFound", "gone"),
                ),
            }
        }
        (method, _) => json_response(
            StatusCode::NOT_FOUND,
            &status_failure(404, "NotFound", &format!("no route for {method} {path}")),
        ),
    }
}

/// Runs an exec'd command in a Pod's folder, speaking the channel protocol: stdin in on
/// channel 0 (255 closes it), stdout and stderr out on 1 and 2, the Status on 3.
async fn run_exec<S>(
    socket: tokio_tungstenite::WebSocketStream<S>,
    container: PathBuf,
    command: Vec<String>,
    stdin: bool,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, mut source) = socket.split();
    let mut child = tokio::process::Command::new(&command[0])
        .args(&command[1..])
        .current_dir(&container)
        .stdin(if stdin {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut child_stdin = child.stdin.take();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    for (channel, stream) in [
        (
            1u8,
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
        ),
        (
            2u8,
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
        ),
    ] {
        let (tx, mut stream) = (tx.clone(), stream.unwrap());
        tokio::spawn(async move {
            let mut buffer = vec![0u8; 8192];
            loop {
                match stream.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        let mut frame = vec![channel];
                        frame.extend_from_slice(&buffer[..n]);
                        let _ = tx.send(frame);
                    }
                }
            }
        });
    }
    drop(tx);
    tokio::spawn(async move {
        while let Some(Ok(message)) = source.next().await {
            if let Message::Binary(frame) = message {
                match (frame.first(), child_stdin.as_mut()) {
                    (Some(0), Some(input)) => {
                        let _ = input.write_all(&frame[1..]).await;
                    }
                    (Some(255), _) => child_stdin = None,
                    _ => {}
                }
            }
        }
    });
    while let Some(frame) = rx.recv().await {
        if sink.send(Message::Binary(frame.into())).await.is_err() {
            return;
        }
    }
    let status = child.wait().await.unwrap();
    let body = match status.code() {
        Some(0) => json!({"metadata": {}, "status": "Success"}),
        code => json!({"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
            "message": "command terminated with non-zero exit code",
            "details": {"causes": [{"reason": "ExitCode",
                "message": code.unwrap_or(137).to_string()}]}}),
    };
    let mut frame = vec![3u8];
    frame.extend_from_slice(body.to_string().as_bytes());
    let _ = sink.send(Message::Binary(frame.into())).await;
    let _ = sink.close().await;
}

fn environment(name: &str) -> EnvironmentRef {
    EnvironmentRef {
        name: name.into(),
        digest: None,
    }
}

fn record(lease: &str) -> LeaseRecord {
    LeaseRecord {
        lease_id: LeaseId::new(lease).unwrap(),
        run_id: RunId::new("run-kube").unwrap(),
        instance: "a".into(),
        environment: "swebench/x".into(),
        created_at: chrono::Utc::now(),
    }
}

fn spec(command: &str, timeout: Duration) -> ExecSpec {
    ExecSpec {
        command: command.into(),
        env: BTreeMap::from([("GREETING".into(), "it's a test".into())]),
        stdin: None,
        timeout,
        output_limit: 1 << 20,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_of_the_environments_image_runs_commands_with_limits_and_is_deleted() {
    let api = FakeApi::start(Script::Run).await;
    let kube = api.backend("a", None);
    assert_eq!(kube.kind(), SandboxBackend::KubernetesPod);
    let pinned = kube
        .resolve(&EnvironmentRef {
            name: "swebench/x".into(),
            digest: Some("sha256:abc".into()),
        })
        .unwrap();
    assert_eq!(pinned.image, "registry.test:5000/swebench/x@sha256:abc");
    assert!(kube.resolve(&environment("../escape")).is_err());
    let unregistered = Kube::new(
        api.client(),
        KubeSettings {
            registry: None,
            images: BTreeMap::from([("math".into(), "python:3.12-slim".into())]),
            ..api.settings("a", None)
        },
    );
    assert_eq!(
        unregistered.resolve(&environment("math")).unwrap().image,
        "python:3.12-slim"
    );
    let err = unregistered
        .resolve(&environment("swebench/x"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--kube-registry") && err.contains("--kube-image swebench/x=IMAGE"),
        "{err}"
    );

    let prepared = kube
        .prepare(&kube.resolve(&environment("swebench/x")).unwrap())
        .await
        .unwrap();
    assert_eq!(prepared.base.len(), 40, "a git commit: {}", prepared.base);
    assert!(prepared.workdir.starts_with('/'));
    let pods = api.pods();
    let (name, pod) = pods.iter().next().unwrap();
    assert!(name.starts_with("arl-sbx-"));
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["image"], "registry.test:5000/swebench/x:latest");
    assert_eq!(container["resources"]["limits"]["memory"], "2048Mi");
    assert_eq!(container["resources"]["limits"]["cpu"], "1000m");
    assert_eq!(
        container["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    assert_eq!(
        container["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
    assert_eq!(
        container["env"][0]["value"],
        "http://arl-proxy.arl.svc:8000/v1"
    );
    assert_eq!(pod["spec"]["automountServiceAccountToken"], false);
    assert_eq!(pod["spec"]["serviceAccountName"], "arl-sandbox-pods");
    assert_eq!(pod["spec"]["imagePullSecrets"][0]["name"], "registry");
    assert_eq!(pod["metadata"]["labels"]["arl.dev/role"], "sandbox");
    assert_eq!(pod["metadata"]["labels"]["arl.dev/state"], "idle");

    let ended = CancellationToken::new();
    let lease = record("lease-kube-1");
    let limits = ResolvedLimits::default();
    let activation = Activation {
        record: &lease,
        limits: &limits,
        ended: ended.clone(),
    };
    let sandbox = kube.activate(prepared, activation).await.unwrap();
    let pod = &api.pods()[name];
    assert_eq!(pod["metadata"]["labels"]["arl.dev/state"], "leased");
    let kept: LeaseRecord = serde_json::from_str(
        pod["metadata"]["annotations"]["arl.dev/lease"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(kept.lease_id, lease.lease_id);

    let output = kube
        .exec(
            &sandbox,
            spec(
                "echo \"$GREETING\"; echo oops >&2; exit 3",
                Duration::from_secs(20),
            ),
        )
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&output.stdout), "it's a test\n");
    assert_eq!(String::from_utf8_lossy(&output.stderr), "oops\n");
    assert_eq!(output.exit_code, 3);
    assert!(!output.timed_out);

    let mut write = spec(
        "cat > notes.txt && wc -c < notes.txt",
        Duration::from_secs(20),
    );
    write.stdin = Some(b"hello from stdin".to_vec());
    let output = kube.exec(&sandbox, write).await.unwrap();
    assert_eq!(
        output.exit_code,
        0,
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "16");

    let started = std::time::Instant::now();
    let output = kube
        .exec(
            &sandbox,
            spec("echo before; sleep 30; echo after", Duration::from_secs(1)),
        )
        .await
        .unwrap();
    assert!(output.timed_out, "{output:?}");
    assert_eq!(output.exit_code, -1);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );

    kube.destroy(&sandbox).await;
    assert!(api.pods().is_empty());
    let exec_request = api
        .requests()
        .into_iter()
        .find(|(_, path)| path.contains("/exec?"))
        .unwrap();
    assert!(
        exec_request.1.contains("container=sandbox"),
        "{exec_request:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_that_cannot_be_pulled_fails_at_once_and_its_pod_is_deleted() {
    let api = FakeApi::start(Script::ImagePull).await;
    let kube = api.backend("a", None);
    let err = kube
        .prepare(&kube.resolve(&environment("swebench/x")).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("ImagePullBackOff"), "{err}");
    assert!(err.contains("swebench/x"), "{err}");
    assert!(api.pods().is_empty(), "the Pod is deleted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_that_never_runs_fails_at_the_ready_timeout_with_the_schedulers_reason() {
    let api = FakeApi::start(Script::Unschedulable).await;
    let kube = api.backend("a", None);
    let started = std::time::Instant::now();
    let err = kube
        .prepare(&kube.resolve(&environment("swebench/x")).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not running after"), "{err}");
    assert!(err.contains("Insufficient memory"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(api.pods().is_empty(), "the Pod is deleted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forbidden_create_says_which_permission_is_missing() {
    let api = FakeApi::start(Script::Forbidden).await;
    let kube = api.backend("a", None);
    let err = kube
        .prepare(&kube.resolve(&environment("swebench/x")).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("forbidden"), "{err}");
    assert!(
        err.contains("cannot create resource \\\"pods\\\"")
            || err.contains("cannot create resource \"pods\""),
        "{err}"
    );
    assert!(err.contains("sandbox Role"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_process_reaps_its_predecessors_pods_and_their_leases() {
    let api = FakeApi::start(Script::Run).await;
    let owner = OwnerPod {
        name: "arl-sandbox-0".into(),
        uid: "0b7d6d0e-uid".into(),
    };
    let before = api.backend("before", Some(owner.clone()));
    let env = before.resolve(&environment("swebench/x")).unwrap();
    let leased = before.prepare(&env).await.unwrap();
    let lease = record("lease-kube-2");
    let limits = ResolvedLimits::default();
    let activation = Activation {
        record: &lease,
        limits: &limits,
        ended: CancellationToken::new(),
    };
    before.activate(leased, activation).await.unwrap();
    let _idle = before.prepare(&env).await.unwrap();
    let pods = api.pods();
    assert_eq!(pods.len(), 2);
    for pod in pods.values() {
        assert_eq!(pod["metadata"]["ownerReferences"][0]["uid"], "0b7d6d0e-uid");
        assert_eq!(pod["metadata"]["ownerReferences"][0]["kind"], "Pod");
    }
    // Another owner's Pods are not this process's to reap.
    let stranger = api.backend(
        "stranger",
        Some(OwnerPod {
            name: "other".into(),
            uid: "other-uid".into(),
        }),
    );
    stranger.prepare(&env).await.unwrap();

    let after = api.backend("after", Some(owner));
    let records = after.reap_leftovers().await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].lease_id, lease.lease_id);
    let left = api.pods();
    assert_eq!(left.len(), 1);
    assert_eq!(
        left.values().next().unwrap()["metadata"]["labels"]["arl.dev/instance"],
        "stranger"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lease_api_runs_unchanged_on_pods_with_warm_pools_refilled() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let api = FakeApi::start(Script::Run).await;
    let files = tempfile::tempdir().unwrap();
    let mut config = SandboxConfig::local(
        files.path().join("state"),
        files.path().join("env"),
        PathBuf::new(),
    );
    config.pool_min_idle = 2;
    config.proxy_service_url = Some("http://arl-proxy.arl.svc:8000".into());
    let shutdown = Shutdown::new();
    let kube = api.backend(&config.instance, None);
    let service = SandboxService::start_with(
        bus.clone(),
        config,
        Arc::new(kube),
        "127.0.0.1:0".parse().unwrap(),
        &shutdown,
    )
    .await
    .unwrap();
    service.prewarm(&environment("swebench/x")).unwrap();
    let idle = |api: &FakeApi| {
        api.pods()
            .values()
            .filter(|p| p["metadata"]["labels"]["arl.dev/state"] == "idle")
            .count()
    };
    let ready = |service: &SandboxService<Kube>| {
        service
            .idle_sandboxes()
            .get("swebench/x")
            .copied()
            .unwrap_or(0)
    };
    wait_for("two warm Pods", Duration::from_secs(30), || async {
        (ready(&service) == 2 && idle(&api) == 2).then_some(())
    })
    .await;

    let request = LeaseRequestV1 {
        run_id: RunId::new("run-kube").unwrap(),
        trial_id: None,
        environment: environment("swebench/x"),
        ttl_s: 600,
        limits: SandboxLimits::default(),
    };
    let grant: LeaseGrantV1 = bus
        .request(
            ns.sandbox_rpc("any", SandboxOp::Lease),
            &request,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert!(grant.warm, "the lease took a warm Pod");
    assert_eq!(
        grant.proxy_url.as_deref(),
        Some("http://arl-proxy.arl.svc:8000/v1")
    );
    wait_for(
        "the pool refilled to two",
        Duration::from_secs(30),
        || async { (ready(&service) == 2 && idle(&api) == 2).then_some(()) },
    )
    .await;

    let auth = format!("Bearer {}", grant.token);
    let headers = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    let body = json!({"command": "echo changed >> README && echo done", "timeout_s": 20});
    let response = http(
        &format!("{}/exec", grant.endpoint),
        "POST",
        &headers,
        body.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    let result: Value = response.json();
    assert_eq!(result["stdout"], "done\n");
    let response = http(&format!("{}/diff", grant.endpoint), "GET", &headers, b"")
        .await
        .unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    assert!(response.text().contains("+changed"), "{}", response.text());

    let pods_before = api.pods().len();
    let release = arl_schemas::rpc::ReleaseRequest::V2(arl_schemas::rpc::ReleaseRequestV2 {
        lease_id: grant.lease_id.clone(),
        token: grant.token.clone(),
    });
    let _: arl_schemas::rpc::ReleasedV1 = bus
        .request(
            ns.sandbox_rpc(&grant.instance, SandboxOp::Release),
            &release,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(
        api.pods().len(),
        pods_before - 1,
        "the leased Pod is deleted"
    );
    shutdown.trigger();
    wait_for(
        "warm Pods deleted at stop",
        Duration::from_secs(30),
        || async { api.pods().is_empty().then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandboxset_environment_is_claimed_used_and_given_back() {
    let api = FakeApi::start(Script::Run).await;
    let kube = api.kruise_backend();
    assert_eq!(kube.kind(), SandboxBackend::OpenkruiseClaim);
    let prepared = kube
        .prepare(&kube.resolve(&environment("math")).unwrap())
        .await
        .unwrap();
    assert_eq!(prepared.base.len(), 40, "{}", prepared.base);
    let claims = api.claims();
    let (claim_name, claim) = claims.iter().next().unwrap();
    assert_eq!(claim["apiVersion"], "agents.kruise.io/v1alpha1");
    assert_eq!(claim["spec"]["templateName"], "python-pool");
    assert_eq!(claim["spec"]["replicas"], 1);
    assert_eq!(
        claim["spec"]["labels"]["arl.dev/claim"],
        claim_name.as_str()
    );
    assert_eq!(claim["spec"]["annotations"]["arl.dev/environment"], "math");
    assert!(
        api.requests()
            .iter()
            .all(|(m, p)| !(m == "POST" && p.contains("/pods?"))),
        "no Pod of its own"
    );

    let lease = record("lease-kruise-1");
    let limits = ResolvedLimits::default();
    let activation = Activation {
        record: &lease,
        limits: &limits,
        ended: CancellationToken::new(),
    };
    let sandbox = kube.activate(prepared, activation).await.unwrap();
    let marked = api.sandboxes().values().next().unwrap().clone();
    assert_eq!(marked["metadata"]["labels"]["arl.dev/state"], "leased");
    assert!(
        marked["metadata"]["annotations"]["arl.dev/lease"]
            .as_str()
            .unwrap()
            .contains("lease-kruise-1")
    );

    let output = kube
        .exec(
            &sandbox,
            spec("echo hi from the pool", Duration::from_secs(20)),
        )
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "hi from the pool\n"
    );
    let exec = api
        .requests()
        .into_iter()
        .find(|(_, p)| p.contains("/exec?"))
        .unwrap();
    assert!(
        !exec.1.contains("container="),
        "the SandboxSet's Pod's own default container: {exec:?}"
    );

    kube.destroy(&sandbox).await;
    assert!(api.sandboxes().is_empty(), "the claimed Sandbox is deleted");
    assert!(api.claims().is_empty(), "and its claim");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_sandboxset_fails_the_lease_with_the_claims_message() {
    let api = FakeApi::start(Script::EmptySet).await;
    let kube = api.kruise_backend();
    let err = kube
        .prepare(&kube.resolve(&environment("math")).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("python-pool") && err.contains("no available sandboxes"),
        "{err}"
    );
    assert!(api.claims().is_empty(), "the claim is deleted");
}
