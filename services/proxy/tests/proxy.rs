//! The proxy against a real nats-server and a stand-in OpenAI backend (a test double for an
//! engine: canned answers with token ids): keys, recording, streaming, errors, backpressure,
//! retries, and refusing to answer when the record cannot be stored.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_proxy::api::{self, Proxy, ProxyConfig};
use arl_proxy::backends::{Backends, Dialect};
use arl_proxy::keys::Keys;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{
    LlmCallV2, RunCompletedV1, WEIGHTS_FILE, WeightsFormat, WeightsLocation, WeightsPublishedV2,
};
use arl_schemas::rpc::{
    ProxyOp, TrialKeyGrantV1, TrialKeyRequestV1, TrialKeyRevokeV1, TrialKeyRevokedV1,
};
use arl_schemas::{Domain, Event, RunId, TrialId};
use arl_testkit::{NatsServer, http, test_namespace, wait_for};
use axum::Json;
use axum::response::IntoResponse;
use serde_json::{Value, json};

type Seen = Arc<Mutex<Vec<Value>>>;

/// SGLang's shapes of the same answers: chat ids once per response in `sglext` (in the
/// last streamed chunk, which has no choices), text-completion ids in the choice.
fn sglang_answer(body: &Value, chat: bool) -> axum::response::Response {
    let ext = json!({"input_ids": [1, 2, 3], "output_ids": [[7, 8]]});
    match (chat, body["stream"] == true) {
        (true, true) => {
            let chunks = [
                json!({"choices": [{"index": 0, "delta": {"content": "h"}, "logprobs": {"content": [{"logprob": -0.1}]}, "finish_reason": null}]}),
                json!({"choices": [{"index": 0, "delta": {"content": "i"}, "logprobs": {"content": [{"logprob": -0.2}]}, "finish_reason": "stop"}]}),
                json!({"choices": [], "sglext": ext}),
            ];
            let mut text = String::new();
            for c in chunks {
                text.push_str(&format!("data: {c}\n\n"));
            }
            text.push_str("data: [DONE]\n\n");
            ([("content-type", "text/event-stream")], text).into_response()
        }
        (true, false) => Json(json!({"model": "policy", "sglext": ext,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                         "finish_reason": "stop"}]}))
        .into_response(),
        (false, _) => Json(json!({"model": "policy",
            "choices": [{"index": 0, "text": "hi", "prompt_token_ids": [1, 2, 3], "token_ids": [7, 8],
                         "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "stop"}]}))
        .into_response(),
    }
}

/// A stand-in engine: answers `[7, 8]` after a `[1, 2, 3]` prompt, streaming or not, in
/// vLLM's shape (or SGLang's); "slow" in a message makes it wait a second.
async fn fake_backend_in(shutdown: &Shutdown, dialect: Dialect) -> (SocketAddr, Seen) {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let router = axum::Router::new()
        // Names only, no policy: the proxy cannot tell what it serves (as with vLLM).
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                Json(json!({"object": "list", "data": [{"id": "policy"}, {"id": "tiny-model"}]}))
            }),
        )
        .route(
            "/v1/chat/completions",
            axum::routing::post(move |headers: axum::http::HeaderMap, Json(body): Json<Value>| {
                let record = record.clone();
                async move {
                    // What was sent, with the policy the proxy named in its header.
                    let mut seen = body.clone();
                    seen["arl-policy"] = json!(headers.get("arl-policy").and_then(|v| v.to_str().ok()));
                    record.lock().unwrap().push(seen);
                    if dialect == Dialect::Sglang {
                        return sglang_answer(&body, true);
                    }
                    if body.to_string().contains("slow") {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    if body["stream"] == true {
                        let chunks = [
                            json!({"prompt_token_ids": [1, 2, 3], "policy_version": 2, "choices": [{"index": 0, "delta": {"content": "h"}, "token_ids": [7], "logprobs": {"content": [{"logprob": -0.1}]}, "finish_reason": null}]}),
                            json!({"policy_version": 2, "choices": [{"index": 0, "delta": {"content": "i"}, "token_ids": [8], "logprobs": {"content": [{"logprob": -0.2}]}, "finish_reason": "stop"}]}),
                        ];
                        let mut text = String::new();
                        for c in chunks {
                            text.push_str(&format!("data: {c}\n\n"));
                        }
                        text.push_str("data: [DONE]\n\n");
                        ([("content-type", "text/event-stream")], text).into_response()
                    } else {
                        Json(json!({"prompt_token_ids": [1, 2, 3], "policy_version": 2, "model": "policy",
                                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                 "token_ids": [7, 8], "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                                                 "finish_reason": "stop"}]}))
                        .into_response()
                    }
                }
            }),
        );
    // SGLang's weight API: what it serves, and loading a folder.
    let serving = Arc::new(Mutex::new("default".to_owned()));
    let (asked, loading) = (serving.clone(), seen.clone());
    let router =
        router
            .route(
                "/model_info",
                axum::routing::get(move || {
                    let version = asked.lock().unwrap().clone();
                    async move {
                        Json(json!({"model_path": "/models/policy", "weight_version": version}))
                    }
                }),
            )
            .route(
                "/update_weights_from_disk",
                axum::routing::post(move |Json(body): Json<Value>| {
                    loading.lock().unwrap().push(body.clone());
                    *serving.lock().unwrap() = body["weight_version"].as_str().unwrap().to_owned();
                    async move {
                        Json(
                            json!({"success": true, "message": "Succeeded to update model weights.",
                                "num_paused_requests": 0}),
                        )
                    }
                }),
            );
    let record = seen.clone();
    let router = router.route(
        "/v1/completions",
        axum::routing::post(move |Json(body): Json<Value>| {
            let record = record.clone();
            async move {
                record.lock().unwrap().push(body.clone());
                sglang_answer(&body, false)
            }
        }),
    );
    let addr = arl_runtime::http::serve("127.0.0.1:0".parse().unwrap(), router, shutdown)
        .await
        .unwrap();
    (addr, seen)
}

struct Setup {
    server: NatsServer,
    bus: Bus,
    proxy: Proxy,
    base: String,
    seen: Seen,
    shutdown: Shutdown,
}

async fn setup(config: ProxyConfig, dead_backend_first: bool) -> Setup {
    setup_with(config, dead_backend_first, Dialect::Vllm).await
}

async fn setup_with(config: ProxyConfig, dead_backend_first: bool, dialect: Dialect) -> Setup {
    setup_following(config, dead_backend_first, dialect, None).await
}

/// With `weights_dir`, the proxy follows weights into its vLLM and SGLang backends.
async fn setup_following(
    config: ProxyConfig,
    dead_backend_first: bool,
    dialect: Dialect,
    weights_dir: Option<&std::path::Path>,
) -> Setup {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let mut bus_config = BusConfig::new(server.url(), ns, "proxy-test");
    // A record that cannot be stored must fail the call quickly.
    bus_config.publish_timeout = Duration::from_secs(2);
    let bus = Bus::connect(bus_config, Metrics::new()).await.unwrap();
    bus.provision().await.unwrap();
    let shutdown = Shutdown::new();
    let (backend, seen) = fake_backend_in(&shutdown, dialect).await;
    let mut specs = Vec::new();
    if dead_backend_first {
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        specs.push((Dialect::Arl, format!("http://{closed}")));
    }
    specs.push((dialect, format!("http://{backend}")));
    let keys = Arc::new(Keys::default());
    let backends = Arc::new(Backends::with_following(specs, weights_dir.is_some()));
    let mcp = arl_proxy::mcp::Mcp::new(
        keys.clone(),
        arl_sandbox_client::SandboxClient::new(bus.clone()),
        arl_proxy::mcp::McpConfig::default(),
    );
    let proxy = Proxy::new(
        bus.clone(),
        keys.clone(),
        mcp.clone(),
        backends.clone(),
        config,
    );
    if let Some(dir) = weights_dir {
        backends.watch_health(proxy.client.clone(), Duration::from_millis(200), &shutdown);
        arl_proxy::follow::follow(
            &bus,
            backends,
            proxy.client.clone(),
            "p1",
            None,
            dir.to_path_buf(),
            &shutdown,
        );
    }
    proxy.forget_ended_runs("p1", &shutdown);
    let addr = arl_runtime::http::serve(
        "127.0.0.1:0".parse().unwrap(),
        api::router(proxy.clone()),
        &shutdown,
    )
    .await
    .unwrap();
    let base = format!("http://{addr}");
    arl_proxy::service::serve_keys(&bus, keys, mcp, "p1", &base, &shutdown)
        .await
        .unwrap();
    Setup {
        server,
        bus,
        proxy,
        base,
        seen,
        shutdown,
    }
}

impl Setup {
    async fn key(&self, trial: &str, max_staleness: Option<u64>) -> TrialKeyGrantV1 {
        let request = TrialKeyRequestV1 {
            run_id: RunId::new("run-proxy").unwrap(),
            trial_id: TrialId::new(trial).unwrap(),
            policy_version: 0,
            max_staleness,
        };
        self.bus
            .request(
                self.bus.namespace().proxy_rpc("any", ProxyOp::Issue),
                &request,
                Duration::from_secs(5),
            )
            .await
            .unwrap()
    }

    /// Publishes the run's end, as the controller does when it completes.
    async fn end_run(&self, run: &RunId) {
        self.bus
            .publish(&RunCompletedV1 {
                run_id: run.clone(),
                completed_at: chrono::Utc::now(),
                steps: 1,
                final_policy_version: 1,
                checkpoint_uri: None,
                final_resolution_rate: None,
            })
            .await
            .unwrap();
    }

    async fn post(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        body: &Value,
    ) -> (u16, String, Vec<(String, String)>) {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        let r = http(url, "POST", &all, body.to_string().as_bytes())
            .await
            .unwrap();
        (r.status, r.text(), r.headers)
    }

    async fn calls(&self) -> Vec<LlmCallV2> {
        let stream = self
            .bus
            .jetstream()
            .get_stream(self.bus.namespace().stream(Domain::Llm))
            .await
            .unwrap();
        let info = stream.clone().get_info().await.unwrap();
        let mut out = Vec::new();
        for seq in info.state.first_sequence..=info.state.last_sequence {
            if let Ok(m) = stream.get_raw_message(seq).await {
                out.push(LlmCallV2::decode(&m.payload).unwrap());
            }
        }
        out
    }
}

fn chat(content: &str) -> Value {
    json!({"model": "policy", "messages": [{"role": "user", "content": content}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_forwarded_recorded_and_keys_scope_them() {
    let s = setup(ProxyConfig::default(), true).await;
    let grant = s.key("trial-a", None).await;
    assert!(
        grant
            .base_url
            .ends_with(&format!("/{}/v1", grant.trial_key))
    );

    // Key in the path; the first backend refuses connections, the second answers.
    let (status, body, _) = s
        .post(
            &format!("{}/chat/completions", grant.base_url),
            &[],
            &chat("hello"),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["message"]["content"],
        "hi"
    );
    // The backend was asked in its dialect, with the trial as the session.
    let sent = s.seen.lock().unwrap()[0].clone();
    assert_eq!(
        (sent["logprobs"].clone(), sent["return_token_ids"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!(sent["user"], "trial-a");
    assert_eq!(
        sent["arl-policy"], "run-proxy:0",
        "the trial's policy, for the engine"
    );

    // Key as a bearer token, streaming: chunks pass through, [DONE] comes last.
    let mut streamed = chat("again");
    streamed["stream"] = json!(true);
    let auth = format!("Bearer {}", grant.trial_key);
    let (status, text, _) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            &[("authorization", &auth)],
            &streamed,
        )
        .await;
    assert_eq!(status, 200);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.len(), 3, "{text}");
    assert_eq!(data.last(), Some(&"[DONE]"));

    // Both calls are recorded, in turn order, with ids, logprobs and version.
    let calls = wait_for("two records", Duration::from_secs(10), || async {
        let calls = s.calls().await;
        (calls.len() == 2).then_some(calls)
    })
    .await;
    for (turn, call) in calls.iter().enumerate() {
        assert_eq!(call.turn_index as usize, turn);
        assert_eq!(call.trial_id.as_str(), "trial-a");
        assert_eq!(
            (
                call.prompt_token_ids.clone(),
                call.completion_token_ids.clone()
            ),
            (vec![1, 2, 3], vec![7, 8])
        );
        assert_eq!(
            (call.logprobs.clone(), call.policy_version),
            (vec![-0.1, -0.2], 2)
        );
        assert_eq!(call.request_messages[0]["role"], "user");
    }

    // `/v1/models` for the trial (path key or bearer): the engine's own list.
    for (url, headers) in [
        (format!("{}/models", grant.base_url), vec![]),
        (
            format!("{}/v1/models", s.base),
            vec![("authorization", auth.as_str())],
        ),
    ] {
        let models = http(&url, "GET", &headers, b"").await.unwrap();
        assert_eq!(models.status, 200, "{}", models.text());
        let ids: Vec<String> = models.json::<Value>()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids, ["policy", "tiny-model"]);
    }
    let anonymous = http(&format!("{}/v1/models", s.base), "GET", &[], b"")
        .await
        .unwrap();
    assert_eq!(anonymous.status, 401, "{}", anonymous.text());

    // Unknown and revoked keys get 401; revoke reports the calls made.
    let (status, _, _) = s
        .post(
            &format!("{}/tk-nope/v1/chat/completions", s.base),
            &[],
            &chat("x"),
        )
        .await;
    assert_eq!(status, 401);
    let revoked: TrialKeyRevokedV1 = s
        .bus
        .request(
            s.bus
                .namespace()
                .proxy_rpc(&grant.instance, ProxyOp::Revoke),
            &TrialKeyRevokeV1 {
                trial_key: grant.trial_key.clone(),
            },
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(revoked.calls, 2);
    // ... and where each is stored: the run's subject, read back by sequence.
    assert_eq!(revoked.call_sequences.len(), 2);
    for (turn, &sequence) in revoked.call_sequences.iter().enumerate() {
        let call: LlmCallV2 = s.bus.read_at(Domain::Llm, sequence).await.unwrap();
        assert_eq!(call, calls[turn]);
        assert_eq!(
            call.subject(s.bus.namespace()),
            s.bus
                .namespace()
                .event_subject(Domain::Llm, &call.run_id, "call")
        );
    }
    let (status, body, _) = s
        .post(
            &format!("{}/chat/completions", grant.base_url),
            &[],
            &chat("x"),
        )
        .await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("revoked"));
    s.shutdown.trigger();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_overload_and_an_unrecordable_call_are_refused() {
    let s = setup(
        ProxyConfig {
            max_body_bytes: 4096,
            max_in_flight_per_run: 1,
        },
        false,
    )
    .await;
    let grant = s.key("trial-b", None).await;
    let url = format!("{}/chat/completions", grant.base_url);

    let mut typo = chat("x");
    typo["temprature"] = json!(0.5);
    let (status, body, _) = s.post(&url, &[], &typo).await;
    assert_eq!(status, 400);
    assert!(
        body.contains("temprature") && body.contains("invalid_request_error"),
        "{body}"
    );
    let r = http(&url, "POST", &[], b"{not json").await.unwrap();
    assert_eq!(r.status, 400);
    let (status, body, _) = s.post(&url, &[], &chat(&"x".repeat(10_000))).await;
    assert_eq!(status, 413, "{body}");

    // One call in flight fills the run: the next gets 429 with Retry-After.
    let slow_request = chat("slow");
    let slow = s.post(&url, &[], &slow_request);
    let second = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.post(&url, &[], &chat("fast")).await
    };
    let ((slow_status, _, _), (status, _, headers)) = tokio::join!(slow, second);
    assert_eq!((slow_status, status), (200, 429));
    assert!(headers.iter().any(|(k, v)| k == "retry-after" && v == "1"));

    // With NATS gone the call cannot be recorded: 503, not an answer.
    let mut s = s;
    s.server.stop().unwrap();
    let (status, body, _) = s.post(&url, &[], &chat("lost?")).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("could not be recorded"), "{body}");
    s.shutdown.trigger();
}

/// A conversation whose record would pass the bus's event limit is refused as the agent's
/// context (413, `record_too_large`): a classed failure, not a 503 the agent retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_too_large_to_record_is_refused_as_its_context() {
    let s = setup(
        ProxyConfig {
            max_body_bytes: 4 << 20,
            ..ProxyConfig::default()
        },
        false,
    )
    .await;
    let grant = s.key("trial-huge", None).await;
    let url = format!("{}/chat/completions", grant.base_url);
    let (status, body, _) = s.post(&url, &[], &chat(&"x".repeat(1_200_000))).await;
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("record_too_large"), "{body}");
    assert!(body.contains("could not be recorded"), "{body}");
    // The trial's next, ordinary call is recorded as usual.
    assert_eq!(s.post(&url, &[], &chat("small")).await.0, 200);
    s.shutdown.trigger();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trial_past_its_staleness_limit_is_held_back() {
    let s = setup(ProxyConfig::default(), false).await;
    // The fake engine serves version 2; a trial that started on 0 with max_staleness 1 may
    // make one call (which reveals the version), then waits.
    let grant = s.key("trial-c", Some(1)).await;
    let url = format!("{}/chat/completions", grant.base_url);
    assert_eq!(s.post(&url, &[], &chat("one")).await.0, 200);
    let (status, body, headers) = s.post(&url, &[], &chat("two")).await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("stale"));
    let code: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(code["error"]["code"], "policy_too_stale", "{body}");
    assert!(headers.iter().any(|(k, _)| k == "retry-after"));
    s.shutdown.trigger();
}

/// A run's load (calls in flight, newest version) lasts as long as the run: its end drops
/// it, so a long-lived proxy does not keep one for every run it ever served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_runs_load_is_dropped() {
    let s = setup(ProxyConfig::default(), false).await;
    let url = format!(
        "{}/chat/completions",
        s.key("trial-end", None).await.base_url
    );
    assert_eq!(s.post(&url, &[], &chat("one")).await.0, 200);
    assert_eq!(s.proxy.tracked_runs(), 1);
    s.end_run(&RunId::new("run-proxy").unwrap()).await;
    wait_for(
        "the ended run's load dropped",
        Duration::from_secs(10),
        || async { (s.proxy.tracked_runs() == 0).then_some(()) },
    )
    .await;
    // A late call of the ended run is still served, on a load of its own.
    assert_eq!(s.post(&url, &[], &chat("two")).await.0, 200);
    assert_eq!(s.proxy.tracked_runs(), 1);
    s.shutdown.trigger();
}

/// An SGLang backend is asked in its dialect and its answers are recorded from where it
/// puts the ids: `sglext` for chat (whole, once per response, also when streaming), the
/// choice for text completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_answers_are_recorded_from_its_own_fields() {
    let s = setup_with(ProxyConfig::default(), false, Dialect::Sglang).await;
    let grant = s.key("trial-sgl", None).await;
    let (status, body, _) = s
        .post(
            &format!("{}/chat/completions", grant.base_url),
            &[],
            &chat("hello"),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let mut streamed = chat("again");
    streamed["stream"] = json!(true);
    let (status, text, _) = s
        .post(
            &format!("{}/chat/completions", grant.base_url),
            &[],
            &streamed,
        )
        .await;
    assert_eq!(status, 200);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let completion = json!({"model": "policy", "prompt": "say hi"});
    let (status, body, _) = s
        .post(&format!("{}/completions", grant.base_url), &[], &completion)
        .await;
    assert_eq!(status, 200, "{body}");

    let sent = s.seen.lock().unwrap().clone();
    assert_eq!(
        (
            &sent[0]["return_input_ids"],
            &sent[0]["return_output_ids"],
            &sent[0]["logprobs"]
        ),
        (&json!(true), &json!(true), &json!(true))
    );
    assert!(sent[0].get("return_token_ids").is_none());
    assert_eq!(sent[2]["return_token_ids"], json!(true));

    let calls = wait_for("three records", Duration::from_secs(10), || async {
        let calls = s.calls().await;
        (calls.len() == 3).then_some(calls)
    })
    .await;
    for call in &calls {
        assert_eq!(call.prompt_token_ids, [1, 2, 3], "{call:?}");
        assert_eq!(call.completion_token_ids, [7, 8], "{call:?}");
        assert_eq!(call.logprobs, [-0.1, -0.2], "{call:?}");
        assert_eq!(
            call.policy_version, 0,
            "SGLang names no version: the trial's"
        );
    }
    s.shutdown.trigger();
}

/// `--follow-weights` with an SGLang backend (a stand-in in SGLang's documented shapes):
/// the proxy reads what it serves (`/model_info`), loads each published version through
/// `/update_weights_from_disk` with ARL's weight version, routes a trial of the new version
/// only then, and records each call with the version that served it. A version in the
/// object store, which SGLang cannot read, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_sglang_serves_each_published_version_and_calls_carry_it() {
    let weights = tempfile::tempdir().unwrap();
    let s = setup_following(
        ProxyConfig::default(),
        false,
        Dialect::Sglang,
        Some(weights.path()),
    )
    .await;
    let grant = s.key("trial-base", None).await;
    let (status, body, _) = wait_for(
        "the engine's weights read",
        Duration::from_secs(10),
        || async {
            let answer = s
                .post(
                    &format!("{}/chat/completions", grant.base_url),
                    &[],
                    &chat("hello"),
                )
                .await;
            (answer.0 != 429).then_some(answer)
        },
    )
    .await;
    assert_eq!(status, 200, "{body}");

    // Version 1 of the run, as the trainer publishes it (a folder under --runs-dir).
    let run = RunId::new("run-proxy").unwrap();
    let dir = weights.path().join("run-proxy/version-1");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(WEIGHTS_FILE), b"new weights").unwrap();
    let (sha256, size_bytes) = arl_runtime::digest::sha256_file(&dir.join(WEIGHTS_FILE)).unwrap();
    let published = |version: u64, location: WeightsLocation| WeightsPublishedV2 {
        run_id: run.clone(),
        policy_version: version,
        step: version as u32,
        format: WeightsFormat::HfSafetensors,
        sha256: sha256.clone(),
        size_bytes,
        location,
        at: chrono::Utc::now(),
    };
    s.bus
        .publish(&published(
            1,
            WeightsLocation::Folder {
                path: dir.display().to_string(),
            },
        ))
        .await
        .unwrap();
    let request = TrialKeyRequestV1 {
        run_id: run.clone(),
        trial_id: TrialId::new("trial-v1").unwrap(),
        policy_version: 1,
        max_staleness: None,
    };
    let v1: TrialKeyGrantV1 = s
        .bus
        .request(
            s.bus.namespace().proxy_rpc("any", ProxyOp::Issue),
            &request,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let (status, body, _) = wait_for("version 1 served", Duration::from_secs(10), || async {
        let answer = s
            .post(
                &format!("{}/chat/completions", v1.base_url),
                &[],
                &chat("again"),
            )
            .await;
        (answer.0 != 429).then_some(answer)
    })
    .await;
    assert_eq!(status, 200, "{body}");

    let update = s
        .seen
        .lock()
        .unwrap()
        .iter()
        .find(|b| b.get("model_path").is_some())
        .cloned()
        .unwrap();
    assert_eq!(
        update["model_path"],
        json!(dir.canonicalize().unwrap().display().to_string())
    );
    assert_eq!(update["weight_version"], "arl:run-proxy:1");
    let calls = wait_for("two records", Duration::from_secs(10), || async {
        let calls = s.calls().await;
        (calls.len() == 2).then_some(calls)
    })
    .await;
    let served: Vec<_> = calls
        .iter()
        .map(|c| (c.policy_version, c.served_version, c.served_run_id.clone()))
        .collect();
    assert_eq!(
        served,
        [(0, Some(0), None), (1, Some(1), Some(run.clone()))]
    );

    // A version SGLang could not read is refused, and nothing changes.
    s.bus
        .publish(&published(
            2,
            WeightsLocation::ObjectStore {
                bucket: "ARL_WEIGHTS".into(),
                files: Vec::new(),
            },
        ))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let updates = s
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|b| b.get("model_path").is_some())
        .count();
    assert_eq!(updates, 1);
    let (status, _, _) = s
        .post(
            &format!("{}/chat/completions", v1.base_url),
            &[],
            &chat("still"),
        )
        .await;
    assert_eq!(status, 200);

    // The run ends: SGLang gets the model it started with back, and the next run's first
    // trials (version 0) are served by it.
    s.end_run(&run).await;
    let next = s.key("trial-next-run", None).await;
    let (status, body, _) = wait_for("the start model back", Duration::from_secs(10), || async {
        let answer = s
            .post(
                &format!("{}/chat/completions", next.base_url),
                &[],
                &chat("next"),
            )
            .await;
        (answer.0 != 429).then_some(answer)
    })
    .await;
    assert_eq!(status, 200, "{body}");
    let loads: Vec<Value> = s
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|b| b.get("model_path").is_some())
        .cloned()
        .collect();
    assert_eq!(loads.len(), 2, "{loads:?}");
    assert_eq!(
        (&loads[1]["model_path"], &loads[1]["weight_version"]),
        (&json!("/models/policy"), &json!("default"))
    );
    s.shutdown.trigger();
}
