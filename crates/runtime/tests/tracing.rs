//! One trace across services: the `traceparent` a publisher writes is the parent of the
//! consumer's span, and spans reach an OTLP/HTTP collector.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::consumer::run_consumer;
use arl_runtime::telemetry::{self, current_trace_id};
use arl_runtime::{Bus, ConsumerSpec, Metrics, Shutdown};
use arl_schemas::Domain;
use arl_schemas::events::{Example, RunProgressV1};
use arl_testkit::{NatsServer, test_namespace, wait_for};
use axum::body::Bytes;
use tracing::Instrument;

/// A minimal OTLP/HTTP collector: it keeps the protobuf bodies posted to `/v1/traces`.
async fn collector(shutdown: &Shutdown) -> (String, Arc<Mutex<Vec<Bytes>>>) {
    let received = Arc::new(Mutex::new(Vec::new()));
    let sink = received.clone();
    let router = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push(body);
                axum::http::StatusCode::OK
            }
        }),
    );
    let addr = arl_runtime::http::serve("127.0.0.1:0".parse().unwrap(), router, shutdown)
        .await
        .unwrap();
    (format!("http://{addr}"), received)
}

fn hex_to_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test]
async fn a_trace_crosses_the_bus_and_reaches_the_collector() {
    let http_shutdown = Shutdown::new();
    let (endpoint, received) = collector(&http_shutdown).await;
    let guard = telemetry::init("arl-test", Some(endpoint)).unwrap();

    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "t"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();

    let consumer_trace = Arc::new(Mutex::new(None));
    let seen = consumer_trace.clone();
    let shutdown = Shutdown::new();
    shutdown.spawn(run_consumer(
        bus.clone(),
        ConsumerSpec::new(
            Domain::Run,
            "traced",
            vec![ns.event_filter(Domain::Run, "progress")],
        ),
        move |_delivery| {
            let seen = seen.clone();
            async move {
                *seen.lock().unwrap() = current_trace_id();
                Ok(())
            }
        },
        shutdown.clone(),
    ));

    let span = tracing::info_span!("trial");
    let publisher_trace = async {
        bus.publish(&RunProgressV1::example()).await.unwrap();
        current_trace_id().unwrap()
    }
    .instrument(span)
    .await;

    let consumer_trace = wait_for("the consumer's span", Duration::from_secs(20), || {
        let seen = consumer_trace.clone();
        async move { seen.lock().unwrap().clone() }
    })
    .await;
    assert_eq!(consumer_trace, publisher_trace);

    shutdown.trigger();
    shutdown.wait().await;
    guard.flush().await;
    let trace_bytes = hex_to_bytes(&publisher_trace);
    wait_for("spans at the collector", Duration::from_secs(20), || {
        let received = received.clone();
        let trace_bytes = trace_bytes.clone();
        async move {
            let bodies = received.lock().unwrap();
            bodies
                .iter()
                .any(|body| {
                    body.windows(trace_bytes.len())
                        .any(|w| w == trace_bytes.as_slice())
                })
                .then_some(())
        }
    })
    .await;
    http_shutdown.trigger();
}
