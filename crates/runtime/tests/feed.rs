//! The ordered feed on a real `nats-server -js`: stream order, the window as backpressure,
//! redeliveries of what is still held skipped, and a reopened feed resuming at its
//! acknowledged floor.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use arl_runtime::bus::BusConfig;
use arl_runtime::feed::{Feed, FeedMessage, FeedSpec};
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{Example, RunProgressV1};
use arl_schemas::{Domain, Event, RunId};
use arl_testkit::{NatsServer, test_namespace};

async fn next(feed: &mut Feed) -> Option<FeedMessage> {
    tokio::time::timeout(Duration::from_millis(700), feed.next())
        .await
        .ok()
        .map(|m| m.unwrap().unwrap())
}

fn sequence_of(message: &FeedMessage) -> u64 {
    let progress: RunProgressV1 = message.delivery.decode().unwrap();
    progress.sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_is_ordered_bounded_and_resumes_at_its_floor() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let run = RunId::generate();
    for sequence in 1..=10 {
        let mut progress = RunProgressV1::example();
        progress.run_id = run.clone();
        progress.sequence = sequence;
        bus.publish(&progress).await.unwrap();
    }
    let spec = FeedSpec {
        domain: Domain::Run,
        durable: "feed-test".into(),
        filter_subjects: vec![RunProgressV1::filter(&ns)],
        window: 4,
        ack_wait: Duration::from_secs(1),
    };
    let mut feed = Feed::open(&bus, spec.clone()).await.unwrap();
    let mut held = Vec::new();
    for want in 1..=4 {
        let message = next(&mut feed).await.expect("within the window");
        assert_eq!(sequence_of(&message), want, "stream order");
        held.push(message);
    }
    // The window is full: nothing more, and after ack_wait the server's redeliveries of
    // the four held messages are not handed out again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        next(&mut feed).await.is_none(),
        "past the window, or a repeat"
    );
    assert_eq!(feed.lag_probe().lag().await.unwrap().total(), 10);

    // Acknowledging the second covers the first: two places free up.
    held[1].ack().await.unwrap();
    let fifth = next(&mut feed).await.expect("a place freed");
    assert_eq!(sequence_of(&fifth), 5);
    let sixth = next(&mut feed).await.expect("a place freed");
    assert_eq!(sequence_of(&sixth), 6);
    assert_eq!(feed.lag_probe().lag().await.unwrap().total(), 8);
    drop(feed);

    // Reopened (a restart): everything after the floor again, first and in order.
    let mut feed = Feed::open(&bus, spec).await.unwrap();
    let mut seen = Vec::new();
    while let Some(message) = next(&mut feed).await {
        seen.push(sequence_of(&message));
        if seen.len() == 4 {
            message.ack().await.unwrap();
        }
    }
    assert_eq!(seen, [3, 4, 5, 6, 7, 8, 9, 10]);
}
