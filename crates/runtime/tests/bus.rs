//! The bus runtime against a real `nats-server -js`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::consumer::run_consumer;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Metrics, Shutdown, headers};
use arl_schemas::events::{Example, RunFailedV1, RunProgressV1};
use arl_schemas::{Bucket, Domain, Event, Namespace, RunId};
use arl_testkit::{NatsServer, test_namespace, wait_for};
use tokio::sync::mpsc;

async fn connect(server: &NatsServer, namespace: &Namespace) -> Bus {
    let bus = Bus::connect(
        BusConfig::new(server.url(), namespace.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    bus
}

/// A stream's configuration as the server holds it.
async fn stream_config(bus: &Bus, stream: &str) -> async_nats::jetstream::stream::Config {
    let mut stream = bus.jetstream().get_stream(stream).await.unwrap();
    stream.info().await.unwrap().config.clone()
}

fn progress(run: &str, sequence: u64) -> RunProgressV1 {
    RunProgressV1 {
        run_id: RunId::new(run).unwrap(),
        sequence,
        ..RunProgressV1::example()
    }
}

fn fast_spec(namespace: &Namespace, durable: &str) -> ConsumerSpec {
    let mut spec = ConsumerSpec::new(
        Domain::Run,
        durable,
        vec![namespace.event_filter(Domain::Run, "progress")],
    );
    spec.retry_backoff = vec![Duration::from_millis(50)];
    spec.max_deliver = 3;
    spec
}

/// Runs a consumer that forwards each delivery to a channel and returns `result`.
fn forward(
    bus: &Bus,
    spec: ConsumerSpec,
    shutdown: &Shutdown,
    result: impl Fn(&Delivery) -> Result<(), HandlerError> + Send + Sync + 'static,
) -> mpsc::UnboundedReceiver<Delivery> {
    let (tx, rx) = mpsc::unbounded_channel();
    let result = Arc::new(result);
    shutdown.spawn(run_consumer(
        bus.clone(),
        spec,
        move |delivery: Delivery| {
            let (tx, result) = (tx.clone(), result.clone());
            async move {
                let outcome = result(&delivery);
                let _ = tx.send(delivery);
                outcome
            }
        },
        shutdown.clone(),
    ));
    rx
}

/// Waits until the namespace's dead-letter stream holds `count` messages.
async fn wait_for_dead_letters(bus: &Bus, ns: &Namespace, count: u64) {
    let stream = ns.stream(Domain::DeadLetter);
    wait_for("the dead letters", Duration::from_secs(10), || {
        let (js, stream) = (bus.jetstream().clone(), stream.clone());
        async move {
            let info = js.get_stream(&stream).await.ok()?.get_info().await.ok()?;
            (info.state.messages == count).then_some(())
        }
    })
    .await;
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Delivery>) -> Delivery {
    tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("a delivery")
        .unwrap()
}

#[tokio::test]
async fn typed_publish_carries_type_version_and_id_headers() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let shutdown = Shutdown::new();
    let mut rx = forward(&bus, fast_spec(&ns, "reader"), &shutdown, |_| Ok(()));

    let event = progress("run-a", 1);
    let published = bus.publish(&event).await.unwrap();
    assert_eq!(published.stream, ns.stream(Domain::Run));
    assert!(!published.duplicate);

    let delivery = next(&mut rx).await;
    assert_eq!(delivery.subject, event.subject(&ns));
    let headers = delivery.headers.as_ref().unwrap();
    assert_eq!(
        headers.get(headers::EVENT_TYPE).unwrap().as_str(),
        "run.progress"
    );
    assert_eq!(headers.get(headers::EVENT_VERSION).unwrap().as_str(), "1");
    assert_eq!(
        headers.get(headers::MSG_ID).unwrap().as_str(),
        event.message_id()
    );
    assert_eq!(delivery.decode::<RunProgressV1>().unwrap(), event);
    let wrong = delivery.decode::<RunFailedV1>().unwrap_err();
    assert!(
        wrong.to_string().contains("expected run.failed v1"),
        "{wrong}"
    );
    shutdown.trigger();
    shutdown.wait().await;
}

#[tokio::test]
async fn duplicate_message_ids_are_stored_once_and_handled_once() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let event = progress("run-dup", 4);
    let first = bus.publish(&event).await.unwrap();
    let second = bus.publish(&event).await.unwrap();
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(first.sequence, second.sequence);

    let handled = Arc::new(AtomicU32::new(0));
    let shutdown = Shutdown::new();
    let counter = handled.clone();
    let mut rx = forward(&bus, fast_spec(&ns, "dedupe"), &shutdown, move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(())
    });
    // A later, different event proves the consumer is past the duplicate.
    bus.publish(&progress("run-dup", 5)).await.unwrap();
    let sequences = [next(&mut rx).await, next(&mut rx).await]
        .map(|d| d.decode::<RunProgressV1>().unwrap().sequence);
    assert_eq!(sequences, [4, 5]);
    assert_eq!(handled.load(Ordering::SeqCst), 2);
    shutdown.trigger();
    shutdown.wait().await;
}

/// Each stream keeps the de-duplication window its events need: the per-trial events
/// (nearly every message, each one's consumers idempotent by the trial) NATS's default two
/// minutes, a run's and its steps' the long one; a stream provisioned with another window
/// is brought to it.
#[tokio::test]
async fn streams_keep_the_duplicate_window_of_their_domain() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let window = async |domain: Domain| {
        stream_config(&bus, &ns.stream(domain))
            .await
            .duplicate_window
    };
    for domain in [
        Domain::Trial,
        Domain::Llm,
        Domain::Sandbox,
        Domain::Reward,
        Domain::Trajectory,
    ] {
        assert_eq!(window(domain).await, Duration::from_secs(120), "{domain:?}");
    }
    for domain in [Domain::Run, Domain::Task, Domain::Train, Domain::Weights] {
        assert_eq!(window(domain).await, Duration::from_secs(600), "{domain:?}");
    }
    assert_eq!(
        arl_runtime::bus::duplicate_window(Domain::Trial),
        Duration::from_secs(120)
    );

    // A stream made with the old window is updated when a service provisions.
    let mut old = stream_config(&bus, &ns.stream(Domain::Trial)).await;
    old.duplicate_window = Duration::from_secs(600);
    bus.jetstream().update_stream(old).await.unwrap();
    bus.provision().await.unwrap();
    assert_eq!(window(Domain::Trial).await, Duration::from_secs(120));
}

#[tokio::test]
async fn a_failing_handler_is_retried_then_succeeds() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let shutdown = Shutdown::new();
    let mut rx = forward(&bus, fast_spec(&ns, "flaky"), &shutdown, |delivery| {
        if delivery.attempt < 2 {
            Err(HandlerError::retry("disk busy"))
        } else {
            Ok(())
        }
    });
    bus.publish(&progress("run-r", 1)).await.unwrap();
    assert_eq!(next(&mut rx).await.attempt, 1);
    assert_eq!(next(&mut rx).await.attempt, 2);
    // Acked on the second attempt: nothing more arrives, nothing is dead-lettered.
    bus.publish(&progress("run-r", 2)).await.unwrap();
    assert_eq!(
        next(&mut rx)
            .await
            .decode::<RunProgressV1>()
            .unwrap()
            .sequence,
        2
    );
    let dlq = bus
        .jetstream()
        .get_stream(ns.stream(Domain::DeadLetter))
        .await
        .unwrap();
    assert_eq!(dlq.get_info().await.unwrap().state.messages, 0);
    shutdown.trigger();
    shutdown.wait().await;
}

#[tokio::test]
async fn messages_are_dead_lettered_after_max_deliver_and_on_rejection() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let shutdown = Shutdown::new();
    let mut rx = forward(&bus, fast_spec(&ns, "doomed"), &shutdown, |delivery| {
        let event = delivery.decode::<RunProgressV1>().unwrap();
        if event.sequence == 1 {
            Err(HandlerError::retry("always failing"))
        } else {
            Err(HandlerError::dead_letter("can never work"))
        }
    });
    bus.publish(&progress("run-d", 1)).await.unwrap();
    for attempt in 1..=3 {
        assert_eq!(next(&mut rx).await.attempt, attempt);
    }
    bus.publish(&progress("run-d", 2)).await.unwrap();
    assert_eq!(next(&mut rx).await.attempt, 1);

    let dlq_stream = ns.stream(Domain::DeadLetter);
    wait_for_dead_letters(&bus, &ns, 2).await;
    let dlq = bus.jetstream().get_stream(&dlq_stream).await.unwrap();
    let first = dlq.get_raw_message(1).await.unwrap();
    let reason = first
        .headers
        .get(headers::DEAD_LETTER_REASON)
        .unwrap()
        .as_str()
        .to_owned();
    assert!(
        reason.contains("gave up after 3 deliveries: always failing"),
        "{reason}"
    );
    assert_eq!(
        first
            .headers
            .get(headers::ORIGINAL_SUBJECT)
            .unwrap()
            .as_str(),
        progress("run-d", 1).subject(&ns)
    );
    let second = dlq.get_raw_message(2).await.unwrap();
    assert_eq!(
        second
            .headers
            .get(headers::DEAD_LETTER_REASON)
            .unwrap()
            .as_str(),
        "can never work"
    );
    // Terminated, not redelivered.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), rx.recv())
            .await
            .is_err()
    );
    shutdown.trigger();
    shutdown.wait().await;
}

#[tokio::test]
async fn nothing_published_before_a_server_restart_is_lost() {
    let mut server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    for sequence in 1..=20 {
        bus.publish(&progress("run-restart", sequence))
            .await
            .unwrap();
    }
    server.restart().unwrap();

    // The same client reconnects by itself; a publish while it does is retried.
    bus.publish(&progress("run-restart", 21)).await.unwrap();
    let shutdown = Shutdown::new();
    let mut rx = forward(&bus, fast_spec(&ns, "after-restart"), &shutdown, |_| Ok(()));
    let mut seen = Vec::new();
    while seen.len() < 21 {
        seen.push(
            next(&mut rx)
                .await
                .decode::<RunProgressV1>()
                .unwrap()
                .sequence,
        );
    }
    seen.sort_unstable();
    assert_eq!(seen, (1..=21).collect::<Vec<_>>());
    shutdown.trigger();
    shutdown.wait().await;
}

#[tokio::test]
async fn a_consumer_resumes_after_the_server_restarts_under_it() {
    let mut server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let shutdown = Shutdown::new();
    let mut rx = forward(&bus, fast_spec(&ns, "survivor"), &shutdown, |_| Ok(()));
    bus.publish(&progress("run-s", 1)).await.unwrap();
    assert_eq!(
        next(&mut rx)
            .await
            .decode::<RunProgressV1>()
            .unwrap()
            .sequence,
        1
    );

    server.restart().unwrap();
    bus.publish(&progress("run-s", 2)).await.unwrap();
    let delivery = next(&mut rx).await;
    assert_eq!(delivery.decode::<RunProgressV1>().unwrap().sequence, 2);
    shutdown.trigger();
    shutdown.wait().await;
}

#[tokio::test]
async fn health_and_metrics_are_served() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    bus.publish(&progress("run-m", 1)).await.unwrap();
    let shutdown = Shutdown::new();
    let router = arl_runtime::http::ops_router(
        "test",
        bus.clone(),
        bus.metrics().clone(),
        arl_runtime::http::Readiness::always(),
    );
    let addr = arl_runtime::http::serve("127.0.0.1:0".parse().unwrap(), router, &shutdown)
        .await
        .unwrap();

    let health = http_get(addr, "/health").await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.contains("\"nats\":\"connected\""), "{health}");
    let metrics = http_get(addr, "/metrics").await;
    assert!(
        metrics.contains("arl_events_published_total{event_type=\"run.progress\"} 1"),
        "{metrics}"
    );
    shutdown.trigger();
    shutdown.wait().await;
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

#[tokio::test]
async fn a_consumer_does_not_exceed_its_concurrency() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    for sequence in 1..=12 {
        bus.publish(&progress("run-c", sequence)).await.unwrap();
    }
    let in_flight = Arc::new(AtomicU32::new(0));
    let peak = Arc::new(AtomicU32::new(0));
    let done = Arc::new(AtomicU32::new(0));
    let mut spec = fast_spec(&ns, "bounded");
    spec.concurrency = 3;
    let shutdown = Shutdown::new();
    let (flight, top, finished) = (in_flight.clone(), peak.clone(), done.clone());
    shutdown.spawn(run_consumer(
        bus.clone(),
        spec,
        move |_delivery| {
            let (flight, top, finished) = (flight.clone(), top.clone(), finished.clone());
            async move {
                let now = flight.fetch_add(1, Ordering::SeqCst) + 1;
                top.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(30)).await;
                flight.fetch_sub(1, Ordering::SeqCst);
                finished.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        },
        shutdown.clone(),
    ));
    wait_for("12 handled", Duration::from_secs(20), || {
        let done = done.clone();
        async move { (done.load(Ordering::SeqCst) == 12).then_some(()) }
    })
    .await;
    assert!(
        peak.load(Ordering::SeqCst) <= 3,
        "peak {}",
        peak.load(Ordering::SeqCst)
    );
    assert!(
        peak.load(Ordering::SeqCst) >= 2,
        "handlers never overlapped"
    );
    shutdown.trigger();
    shutdown.wait().await;
}

/// A held message (its handler waits for a later commit) is not redelivered while its
/// handler runs far past `ack_wait`, and is acked once the handler returns; without
/// keep-alive the same wait causes a redelivery.
#[tokio::test]
async fn held_messages_are_kept_alive_until_their_handler_returns() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let shutdown = Shutdown::new();
    for (durable, held, expected) in [("held", true, 1), ("not-held", false, 2)] {
        let mut spec = fast_spec(&ns, durable);
        spec.ack_wait = Duration::from_millis(600);
        if held {
            spec = spec.held(8);
        }
        let deliveries = Arc::new(AtomicU32::new(0));
        let seen = deliveries.clone();
        shutdown.spawn(run_consumer(
            bus.clone(),
            spec,
            move |_delivery: Delivery| {
                let seen = seen.clone();
                async move {
                    // The first delivery waits ~3 ack_waits, like a batch awaiting its step.
                    if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                        tokio::time::sleep(Duration::from_millis(2000)).await;
                    }
                    Ok(())
                }
            },
            shutdown.clone(),
        ));
        if durable == "held" {
            bus.publish(&progress("run-h", 1)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert_eq!(deliveries.load(Ordering::SeqCst), expected, "{durable}");
    }
    shutdown.trigger();
    shutdown.wait().await;
}

/// A run whose state disappears mid-run: a handler that needs the run's context gets it
/// while the state is there; once it is deleted, the handler's message is retried, then
/// the service gives the run up — `run.failed` naming the service and the reason — and the
/// message is dead-lettered. Never a default spec.
#[tokio::test]
async fn a_run_whose_state_disappears_is_failed_with_the_reason() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "arl-rollout"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let run = RunId::new("run-gone").unwrap();
    let state = serde_json::json!({
        "run_id": run, "name": "gone", "status": "running", "phase": "training",
        "submitted_by": "test", "submitted_at": "2026-11-30T00:00:00Z",
        "updated_at": "2026-11-30T00:00:00Z", "spec": arl_schemas::spec::RunSpec::default(),
        "total_steps": 1, "step": 0, "policy_version": 0, "trials_finished": 0,
        "failures": {"infrastructure": 0, "agent_error": 0, "timeout": 0,
                     "context_overflow": 0, "grading_error": 0},
        "progress_sequence": 0
    });
    let state: arl_schemas::state::RunStateV1 = serde_json::from_value(state).unwrap();
    let kv = bus.bucket(arl_schemas::Bucket::RunState).await.unwrap();
    kv.put(run.as_str(), state.encode().unwrap().into())
        .await
        .unwrap();
    let shutdown = Shutdown::new();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let handler_bus = bus.clone();
    shutdown.spawn(run_consumer(
        bus.clone(),
        fast_spec(&ns, "needs-context"),
        move |delivery: Delivery| {
            let (bus, tx) = (handler_bus.clone(), tx.clone());
            async move {
                let event = delivery.decode::<RunProgressV1>()?;
                let outcome = bus.run_context(&event.run_id).await.map(|_| ());
                let _ = tx.send((event.sequence, delivery.attempt, outcome.is_ok()));
                outcome
            }
        },
        shutdown.clone(),
    ));
    bus.publish(&progress(run.as_str(), 1)).await.unwrap();
    assert_eq!(rx.recv().await.unwrap(), (1, 1, true));
    kv.delete(run.as_str()).await.unwrap();
    bus.publish(&progress(run.as_str(), 2)).await.unwrap();
    for attempt in 1..=3 {
        assert_eq!(rx.recv().await.unwrap(), (2, attempt, false));
    }
    let failed = wait_for("run.failed", Duration::from_secs(10), || async {
        let failed: Vec<RunFailedV1> = bus
            .replay(Domain::Run, ns.event_subject(Domain::Run, &run, "failed"))
            .await
            .ok()?;
        failed.into_iter().next()
    })
    .await;
    assert_eq!(failed.service, "arl-rollout");
    assert!(
        failed.reason.contains("gave up after 3 deliveries")
            && failed.reason.contains("deleted mid-run"),
        "{}",
        failed.reason
    );
    wait_for_dead_letters(&bus, &ns, 1).await;
    shutdown.trigger();
    shutdown.wait().await;
}

/// A handler that panics, and one whose event is too large to ever be stored, each send
/// their message to the dead-letter stream with the reason at the first delivery; the
/// consumer goes on with the next message.
#[tokio::test]
async fn a_panic_and_an_oversized_event_are_dead_lettered_at_once() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let shutdown = Shutdown::new();
    let handled = Arc::new(AtomicU32::new(0));
    let (publisher, seen) = (bus.clone(), handled.clone());
    shutdown.spawn(run_consumer(
        bus.clone(),
        fast_spec(&ns, "fragile"),
        move |delivery: Delivery| {
            let (bus, seen) = (publisher.clone(), seen.clone());
            async move {
                let event = delivery.decode::<RunProgressV1>()?;
                seen.fetch_add(1, Ordering::SeqCst);
                match event.sequence {
                    1 => panic!("sequence one is a bug"),
                    2 => {
                        let huge = RunFailedV1 {
                            reason: "x".repeat(arl_runtime::bus::MAX_EVENT_BYTES),
                            ..RunFailedV1::example()
                        };
                        bus.publish(&huge).await?;
                        Ok(())
                    }
                    _ => Ok(()),
                }
            }
        },
        shutdown.clone(),
    ));
    for sequence in 1..=3 {
        bus.publish(&progress("run-p", sequence)).await.unwrap();
    }
    wait_for_dead_letters(&bus, &ns, 2).await;
    let dlq = bus
        .jetstream()
        .get_stream(ns.stream(Domain::DeadLetter))
        .await
        .unwrap();
    let dlq = &dlq;
    let reason = |sequence| async move {
        let message = dlq.get_raw_message(sequence).await.unwrap();
        message
            .headers
            .get(headers::DEAD_LETTER_REASON)
            .unwrap()
            .as_str()
            .to_owned()
    };
    let first = reason(1).await;
    assert_eq!(first, "the handler panicked: sequence one is a bug");
    let second = reason(2).await;
    assert!(
        second.contains("run.failed is") && second.contains("-byte limit of one event"),
        "{second}"
    );
    // Each was delivered once; the third message was handled after them.
    wait_for("the third message", Duration::from_secs(10), || async {
        (handled.load(Ordering::SeqCst) == 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(handled.load(Ordering::SeqCst), 3, "nothing was redelivered");
    shutdown.trigger();
    shutdown.wait().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_stream_refuses_new_events_at_once_and_keeps_the_old_ones() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let mut config = BusConfig::new(server.url(), ns.clone(), "test");
    config.stream_max_bytes = Some(64 * 1024);
    let bus = Bus::connect(config, Metrics::new()).await.unwrap();
    bus.provision().await.unwrap();
    let run_stream = ns.stream(RunFailedV1::DOMAIN);
    let info = stream_config(&bus, &run_stream).await;
    assert_eq!(info.max_bytes, 64 * 1024);

    let started = std::time::Instant::now();
    let mut refused = None;
    for n in 0..64 {
        let event = RunFailedV1 {
            run_id: RunId::new(format!("run-full-{n}")).unwrap(),
            reason: "x".repeat(8 * 1024),
            ..RunFailedV1::example()
        };
        if let Err(err) = bus.publish(&event).await {
            refused = Some((n, err));
            break;
        }
    }
    let (n, err) = refused.expect("a 64 KiB stream takes no 64 events of 8 KiB");
    assert!(
        matches!(err, arl_runtime::BusError::StreamFull { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("ARL_STREAM_MAX_BYTES"), "{err}");
    assert!(n >= 4, "refused after only {n} events");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "refused at once, not after the publish timeout: {:?}",
        started.elapsed()
    );
    let state = bus
        .jetstream()
        .get_stream(&run_stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .clone();
    assert_eq!(state.first_sequence, 1, "the oldest event is kept");
    assert_eq!(state.messages, n as u64);
}

fn run_state(run: &RunId, policy_version: u64) -> arl_schemas::state::RunStateV1 {
    serde_json::from_value(serde_json::json!({
        "run_id": run, "name": "waits", "status": "running", "phase": "training",
        "submitted_by": "test", "submitted_at": "2026-11-30T00:00:00Z",
        "updated_at": "2026-11-30T00:00:00Z",
        "total_steps": 4, "step": 0, "policy_version": policy_version, "trials_finished": 0,
        "failures": {"infrastructure": 0, "agent_error": 0, "timeout": 0,
                     "context_overflow": 0, "grading_error": 0},
        "progress_sequence": 0
    }))
    .unwrap()
}

/// Consumers on a stream, as the server counts them.
async fn consumers_on(bus: &Bus, stream: &str) -> usize {
    let mut stream = bus.jetstream().get_stream(stream).await.unwrap();
    stream.info().await.unwrap().state.consumer_count
}

/// More trials wait for a run's weights than a stream may hold consumers (1,000 by
/// default): every wait shares the process's one watch of the run-state bucket, each
/// returns when its version is reached (or with the latest state at its limit), and a
/// finished wait leaves nothing behind.
#[tokio::test]
async fn thousands_of_waits_on_run_states_share_one_watch() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let kv = bus.bucket(arl_schemas::Bucket::RunState).await.unwrap();
    let (ahead, behind) = (
        RunId::new("run-ahead").unwrap(),
        RunId::new("run-behind").unwrap(),
    );
    kv.put(
        ahead.as_str(),
        run_state(&ahead, 0).encode().unwrap().into(),
    )
    .await
    .unwrap();
    let mut waits = tokio::task::JoinSet::new();
    for i in 0..1_500u64 {
        let (bus, run) = (
            bus.clone(),
            if i % 3 == 0 {
                behind.clone()
            } else {
                ahead.clone()
            },
        );
        let needed = 1 + i % 2;
        waits.spawn(async move {
            let state = bus
                .await_run_state(&run, Duration::from_secs(60), |s| {
                    s.policy_version >= needed
                })
                .await
                .unwrap();
            (needed, state.map(|s| s.policy_version))
        });
    }
    wait_for("every wait subscribed", Duration::from_secs(30), || async {
        (bus.awaited_runs() == 2).then_some(())
    })
    .await;
    let state_stream = ns.bucket(arl_schemas::Bucket::RunState);
    assert_eq!(consumers_on(&bus, &format!("KV_{state_stream}")).await, 1);
    // The run not yet in the bucket appears, then both move to version 2 by way of 1.
    kv.put(
        behind.as_str(),
        run_state(&behind, 1).encode().unwrap().into(),
    )
    .await
    .unwrap();
    for run in [&ahead, &behind] {
        kv.put(run.as_str(), run_state(run, 2).encode().unwrap().into())
            .await
            .unwrap();
    }
    let mut released = 0;
    while let Some(joined) = waits.join_next().await {
        let (needed, version) = joined.unwrap();
        assert!(
            version.is_some_and(|v| v >= needed),
            "{needed}: {version:?}"
        );
        released += 1;
    }
    assert_eq!(released, 1_500);
    assert_eq!(bus.awaited_runs(), 0);
    // A limit that passes returns the latest state seen, short of the wait's condition.
    let latest = bus
        .await_run_state(&ahead, Duration::from_millis(300), |s| {
            s.policy_version >= 9
        })
        .await
        .unwrap();
    assert_eq!(latest.map(|s| s.policy_version), Some(2));
    let missing = RunId::new("run-missing").unwrap();
    let none = bus
        .await_run_state(&missing, Duration::from_millis(300), |_| true)
        .await
        .unwrap();
    assert!(none.is_none());
}

/// Reading events back holds a consumer only while reading: more reads in a row than a
/// stream may hold consumers succeed and leave the stream with none.
#[tokio::test]
async fn replays_leave_no_consumers_behind() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let run = RunId::new("run-replayed").unwrap();
    for sequence in 1..=3 {
        bus.publish(&progress(run.as_str(), sequence))
            .await
            .unwrap();
    }
    let subject = ns.event_subject(Domain::Run, &run, "progress");
    for _ in 0..1_200 {
        let events: Vec<RunProgressV1> = bus.replay(Domain::Run, subject.clone()).await.unwrap();
        assert_eq!(
            events.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            [1, 2, 3]
        );
    }
    let empty: Vec<RunProgressV1> = bus
        .replay(Domain::Run, ns.event_subject(Domain::Run, &run, "failed"))
        .await
        .unwrap();
    assert!(empty.is_empty());
    assert_eq!(consumers_on(&bus, &ns.stream(Domain::Run)).await, 0);
}

/// A settled record replaces its history and expires: until then it reads as written
/// (a copy of its request still finds it), then as absent, and the bucket's stream no
/// longer holds the key. A record written after it starts afresh.
#[tokio::test]
async fn a_settled_record_rolls_up_its_history_and_expires() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let stream = format!("KV_{}", ns.bucket(Bucket::Trials));
    assert!(stream_config(&bus, &stream).await.allow_message_ttl);
    for step in 1..=3u32 {
        bus.modify_record::<u32>(Bucket::Trials, "trial-1", |r| {
            *r = Some(step);
            true
        })
        .await
        .unwrap();
    }
    let messages = async || {
        let mut s = bus.jetstream().get_stream(&stream).await.unwrap();
        s.info().await.unwrap().state.messages
    };
    assert_eq!(messages().await, 3);
    let settled = bus
        .settle_record::<u32>(
            Bucket::Trials,
            "trial-1",
            |r| {
                assert_eq!(*r, Some(3));
                *r = Some(4);
                true
            },
            Duration::from_secs(2),
        )
        .await
        .unwrap();
    assert_eq!(settled, Some(4));
    assert_eq!(
        messages().await,
        1,
        "the settled write rolls up the history"
    );
    assert_eq!(
        bus.get_record::<u32>(Bucket::Trials, "trial-1")
            .await
            .unwrap(),
        Some(4)
    );
    wait_for("the record to expire", Duration::from_secs(10), || async {
        let read = bus
            .get_record::<u32>(Bucket::Trials, "trial-1")
            .await
            .unwrap();
        read.is_none().then_some(())
    })
    .await;
    let written = bus
        .modify_record::<u32>(Bucket::Trials, "trial-1", |r| {
            assert_eq!(*r, None);
            *r = Some(7);
            true
        })
        .await
        .unwrap();
    assert_eq!(written, Some(7));
}

/// No claim in `ARL_TRIALS` proves an event forged only while a done attempt's claim would
/// still be there: a young event without one is refused, an older one (its claim may have
/// expired while a consumer was down) is let through; a claim of an earlier attempt
/// refuses a later one at any age.
#[tokio::test]
async fn an_event_without_a_claim_is_refused_while_its_claim_would_still_be_kept() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = connect(&server, &ns).await;
    let trial = arl_schemas::TrialId::new("run-1-s1-t0-k0").unwrap();
    let now = std::time::SystemTime::now();
    let kept = Duration::from_secs(arl_schemas::state::DONE_TRIAL_RECORD_KEPT_SECONDS);
    let old = now - kept - Duration::from_secs(1);
    let check = async |attempt: u32, published| {
        bus.check_requested(&trial, attempt, "trajectory.ready", published)
            .await
    };
    let refused = check(0, now).await;
    assert!(
        matches!(refused, Err(HandlerError::DeadLetter(_))),
        "{refused:?}"
    );
    check(0, old).await.unwrap();
    bus.modify_record::<arl_schemas::state::TrialRecordV2>(Bucket::Trials, trial.as_str(), |r| {
        *r = Some(arl_schemas::state::TrialRecordV2 {
            attempt: 0,
            done: false,
            finished: None,
        });
        true
    })
    .await
    .unwrap();
    check(0, now).await.unwrap();
    let later = check(1, old).await;
    assert!(
        matches!(later, Err(HandlerError::DeadLetter(_))),
        "{later:?}"
    );
}
