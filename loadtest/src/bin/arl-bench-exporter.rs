//! `arl-bench-exporter`: how fast the Kafka exporter moves a run's events from JetStream to
//! Kafka, next to how fast the same events can merely be read off JetStream (an ordered
//! feed acknowledging as it goes: the exporter's own read path with no Kafka behind it),
//! measured in the same run on the same server. The broker is tansu on PostgreSQL (`make
//! deps` installs it), so the Kafka side includes a durable write per batch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arl_exporter::kafka::{Compression, ProducerSettings};
use arl_exporter::metrics::ExporterMetrics;
use arl_exporter::pipeline::Exporter;
use arl_exporter::selection::{KeyBy, LlmCalls, Selection, SelectionFlags};
use arl_runtime::bus::BusConfig;
use arl_runtime::feed::{Feed, FeedSpec};
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{Example, TrialFinishedV1};
use arl_schemas::{Domain, Event, RunId, TrialId};
use arl_testkit::kafka::KafkaBroker;
use clap::Parser;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::FutureRecord;

#[derive(Debug, Parser)]
#[command(about = "Kafka export rate vs the JetStream read rate, same run")]
struct Args {
    /// trial.finished events exported.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Kafka partitions of the topic.
    #[arg(long, default_value_t = 4)]
    partitions: u32,
    /// The exporter's window (events out per stream).
    #[arg(long, default_value_t = 1000)]
    window: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = arl_testkit::NatsServer::start()?;
    let ns = arl_testkit::test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "bench"),
        Metrics::new(),
    )
    .await?;
    bus.provision().await?;
    let broker = KafkaBroker::start()?;
    broker.create_topic("arl.trial.finished", args.partitions)?;
    broker.create_topic("bench.direct", args.partitions)?;

    let selection = Arc::new(Selection::new(&SelectionFlags {
        events: "trial.finished",
        runs: "all",
        topic_prefix: "arl.",
        topics: &[],
        key_by: KeyBy::Run,
        llm_calls: LlmCalls::Full,
    })?);
    let mut bytes = 0usize;
    let runs: Vec<RunId> = (0..8).map(|_| RunId::generate()).collect();
    let mut bodies = Vec::with_capacity(args.events);
    for i in 0..args.events {
        let mut event = TrialFinishedV1::example();
        event.run_id = runs[i % runs.len()].clone();
        event.trial_id = TrialId::new(format!("trial-{i}"))?;
        let body = event.encode()?;
        bytes += body.len();
        bodies.push(bench_record(&selection, &ns, &event, body, i)?);
        bus.publish(&event).await?;
    }
    let settings = ProducerSettings {
        brokers: broker.bootstrap_servers(),
        compression: Compression::Lz4,
        idempotence: true,
        passthrough: BTreeMap::new(),
    };

    // The broker's own ceiling: the same records (value, key, headers) from a bare
    // producer, no bus behind it.
    let producer = settings.producer()?;
    let started = Instant::now();
    let mut reports = Vec::with_capacity(args.events);
    for r in &bodies {
        let mut record = FutureRecord::to("bench.direct")
            .key(r.key.as_bytes())
            .payload(r.value.as_ref())
            .headers(r.kafka_headers());
        loop {
            match producer.send_result(record) {
                Ok(report) => {
                    reports.push(report);
                    break;
                }
                Err((error, back)) => {
                    record = back;
                    anyhow::ensure!(
                        matches!(
                            error,
                            KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull)
                        ),
                        "producing: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    }
    for report in reports {
        report.await?.map_err(|(e, _)| e)?;
    }
    let direct = started.elapsed();
    drop(producer);
    let subjects = vec![TrialFinishedV1::filter(&ns)];

    // The read path alone: an ordered feed, acknowledged every 256 events.
    let started = Instant::now();
    let mut feed = Feed::open(
        &bus,
        FeedSpec {
            domain: Domain::Trial,
            durable: "bench-read".into(),
            filter_subjects: subjects,
            window: args.window,
            ack_wait: Duration::from_secs(60),
        },
    )
    .await?;
    for n in 1..=args.events {
        let message = feed
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("the feed ended"))??;
        if n % 256 == 0 || n == args.events {
            message.ack().await?;
        }
    }
    let read = started.elapsed();

    // The exporter: the same events to Kafka, until Kafka acknowledged every one.
    let metrics = Metrics::new();
    let exporter = Exporter {
        bus: bus.clone(),
        selection: selection.clone(),
        producer: settings,
        durable: "exporter".into(),
        window: args.window,
        ack_wait: Duration::from_secs(60),
        metrics: ExporterMetrics::new(&metrics),
    };
    let shutdown = Shutdown::new();
    let started = Instant::now();
    let task = tokio::spawn(exporter.run(shutdown.clone()));
    let deadline = started + Duration::from_secs(600);
    while exported(&metrics) < args.events as f64 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "export did not finish in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let export = started.elapsed();
    shutdown.trigger();
    task.await?;

    let rate = |took: Duration| args.events as f64 / took.as_secs_f64();
    let mb = |took: Duration| bytes as f64 / 1e6 / took.as_secs_f64();
    println!(
        "\n{} trial.finished events ({:.0} bytes each), {} partitions, window {}\n",
        args.events,
        bytes as f64 / args.events as f64,
        args.partitions,
        args.window
    );
    println!("| path | seconds | events/s | MB/s | vs JetStream read | vs producer alone |");
    println!("|---|---|---|---|---|---|");
    let row = |path: &str, took: Duration| {
        println!(
            "| {path} | {:.2} | {:.0} | {:.1} | {:.2}× | {:.2}× |",
            took.as_secs_f64(),
            rate(took),
            mb(took),
            rate(took) / rate(read),
            rate(took) / rate(direct)
        );
    };
    row("JetStream read (ordered feed, acked)", read);
    row(
        "rdkafka producer alone, same records (the broker's ceiling)",
        direct,
    );
    row("export: JetStream → Kafka, acked both ends", export);
    println!("\nKafka: tansu on PostgreSQL, acks=all, idempotent producer, lz4.");
    Ok(())
}

/// The record the exporter makes of `event` (headers included), for the bare producer.
fn bench_record(
    selection: &Selection,
    ns: &arl_schemas::Namespace,
    event: &TrialFinishedV1,
    body: Vec<u8>,
    sequence: usize,
) -> anyhow::Result<arl_exporter::record::Record> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", event.message_id().as_str());
    headers.insert("Arl-Type", TrialFinishedV1::TYPE);
    headers.insert("Arl-Version", TrialFinishedV1::VERSION.to_string().as_str());
    headers.insert(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    let delivery = arl_runtime::Delivery {
        subject: event.subject(ns),
        headers: Some(headers),
        payload: body.into(),
        attempt: 1,
        stream_sequence: sequence as u64 + 1,
        published: std::time::SystemTime::now(),
    };
    Ok(arl_exporter::record::record(
        selection,
        ns,
        &ns.stream(Domain::Trial),
        &delivery,
    )?)
}

fn exported(metrics: &Metrics) -> f64 {
    metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("arl_exporter_events_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
