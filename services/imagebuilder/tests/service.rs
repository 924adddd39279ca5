//! The image builder service on a real nats-server: a task batch of Harbor tasks (the
//! bundled examples) gets `image.ready` for each buildable task — built the first time,
//! cached the second — and `image.failed` with the reason for one that cannot be built.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::service::{ImageBuilder, Recipes};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{
    EnvironmentLocation, EnvironmentRef, Example, ImageFailedV1, ImageFailureReason, ImageReadyV1,
    Split, TaskBatchV1, TaskKind, TaskRef,
};
use arl_schemas::state::RunStateV1;
use arl_schemas::{Bucket, Domain, Event, RunId, TaskId};
use arl_testkit::{NatsServer, test_namespace, wait_for};

/// A local builder over `files` (no pyenv: Harbor tasks and folders only).
fn local_builder(files: &Path, timeout: Duration) -> LocalBuilder {
    LocalBuilder::new(LocalConfig {
        root: files.join("environments"),
        pyenv_root: files.join("no-pyenv"),
        pip_cache: files.join("pip"),
        timeout,
    })
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks")
}

async fn put_run(bus: &Bus, run: &RunId) {
    let mut state: RunStateV1 = serde_json::from_value(serde_json::json!({
        "run_id": run, "name": "images", "status": "running", "phase": "preparing",
        "submitted_by": "test", "submitted_at": "2026-11-30T00:00:00Z",
        "updated_at": "2026-11-30T00:00:00Z", "total_steps": 1, "step": 0,
        "policy_version": 0, "trials_finished": 0,
        "failures": {"infrastructure": 0, "agent_error": 0, "timeout": 0, "context_overflow": 0, "grading_error": 0},
        "progress_sequence": 0
    }))
    .unwrap();
    state.dataset_path = Some(examples().display().to_string());
    let kv = bus.bucket(Bucket::RunState).await.unwrap();
    kv.put(run.as_str(), state.encode().unwrap().into())
        .await
        .unwrap();
}

fn batch(run: &RunId, tasks: &[&str]) -> TaskBatchV1 {
    TaskBatchV1 {
        run_id: run.clone(),
        step: 1,
        split: Split::Train,
        samples_per_task: 2,
        tasks: tasks
            .iter()
            .map(|t| TaskRef {
                task_id: TaskId::new(*t).unwrap(),
                kind: TaskKind::Harbor,
                dataset_digest: TaskBatchV1::example().tasks[0].dataset_digest.clone(),
                environment: EnvironmentRef {
                    name: format!("harbor/{t}"),
                    digest: None,
                },
            })
            .collect(),
    }
}

async fn all<E: Event>(bus: &Bus, domain: Domain, event: &str) -> Vec<E> {
    let stream = bus
        .jetstream()
        .get_stream(bus.namespace().stream(domain))
        .await
        .unwrap();
    let info = stream.clone().get_info().await.unwrap();
    let mut out = Vec::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        if let Ok(m) = stream.get_raw_message(seq).await
            && m.subject.ends_with(event)
        {
            out.push(E::decode(&m.payload).unwrap());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harbor_batches_get_ready_or_failed_environments() {
    let server = NatsServer::start().unwrap();
    let bus = Bus::connect(
        BusConfig::new(server.url(), test_namespace(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let files = tempfile::tempdir().unwrap();
    let root = files.path().join("environments");
    let local = Arc::new(local_builder(files.path(), Duration::from_secs(120)));
    let shutdown = Shutdown::new();
    ImageBuilder::new(bus.clone(), local, Recipes::default()).start(&shutdown);

    let (first, second) = (
        RunId::new("run-img-1").unwrap(),
        RunId::new("run-img-2").unwrap(),
    );
    for run in [&first, &second] {
        put_run(&bus, run).await;
    }
    bus.publish(&batch(
        &first,
        &["fix-mean", "fix-fizzbuzz", "no-such-task"],
    ))
    .await
    .unwrap();
    let ready = wait_for(
        "two environments ready",
        Duration::from_secs(60),
        || async {
            let ready = all::<ImageReadyV1>(&bus, Domain::Image, "ready").await;
            (ready.len() == 2).then_some(ready)
        },
    )
    .await;
    for r in &ready {
        assert!(!r.cached, "{r:?}");
        let EnvironmentLocation::LocalSnapshot { path } = &r.location else {
            panic!("{r:?}")
        };
        assert!(Path::new(path).join("tree").is_dir());
        let metadata: serde_json::Value = serde_json::from_slice(
            &std::fs::read(Path::new(path).join("environment.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(metadata["workdir"], "/app");
    }
    assert!(root.join("harbor/fix-mean/tree/stats.py").is_file());
    let failed = wait_for(
        "one environment failed",
        Duration::from_secs(30),
        || async {
            let failed = all::<ImageFailedV1>(&bus, Domain::Image, "failed").await;
            (failed.len() == 1).then_some(failed)
        },
    )
    .await;
    assert_eq!(failed[0].task_id.as_str(), "no-such-task");
    assert_eq!(failed[0].reason, ImageFailureReason::InstallError);
    assert!(
        failed[0].message.contains("Dockerfile"),
        "{}",
        failed[0].message
    );

    // Another run with the same task: nothing is built again.
    bus.publish(&batch(&second, &["fix-mean"])).await.unwrap();
    let cached = wait_for(
        "the cached environment",
        Duration::from_secs(30),
        || async {
            all::<ImageReadyV1>(&bus, Domain::Image, "ready")
                .await
                .into_iter()
                .find(|r| r.run_id == second)
        },
    )
    .await;
    assert!(cached.cached);
    shutdown.trigger();
    shutdown.wait().await;
}

/// Concurrent requests for one environment build it once; garbage collection removes the
/// least recently used environments down to the size limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_build_per_environment_and_garbage_collection_by_size() {
    use arl_imagebuilder::recipe::Recipe;
    let files = tempfile::tempdir().unwrap();
    let builder = local_builder(files.path(), Duration::from_secs(60));
    let mean = Recipe::from_harbor(&examples().join("fix-mean")).unwrap();
    let fizz = Recipe::from_harbor(&examples().join("fix-fizzbuzz")).unwrap();
    let (a, b) = tokio::join!(builder.ensure(&mean), builder.ensure(&mean));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        (a.cached as u8) + (b.cached as u8),
        1,
        "exactly one of them built"
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    builder.ensure(&fizz).await.unwrap();
    // Over the limit: the least recently used (fix-mean) goes first.
    let removed = builder.collect_garbage(1).await.unwrap();
    assert_eq!(
        removed,
        vec![
            "harbor/fix-mean".to_owned(),
            "harbor/fix-fizzbuzz".to_owned()
        ]
    );
    assert!(!files.path().join("environments/harbor/fix-mean").exists());
    // Under the limit nothing is removed; a removed environment is rebuilt on demand.
    assert!(!builder.ensure(&mean).await.unwrap().cached);
    assert!(builder.collect_garbage(u64::MAX).await.unwrap().is_empty());
}

/// Two environments of one batch that need the same Python are built at once: the
/// interpreter is copied into the store once, and both builds succeed (they raced for the
/// copy, and one failed "publishing the interpreter copy", before the copy was locked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builds_needing_one_interpreter_share_its_copy() {
    use arl_imagebuilder::recipe::{Recipe, Source};
    let files = tempfile::tempdir().unwrap();
    // A stand-in pyenv interpreter, large enough that copying it takes a moment.
    let bin = files.path().join("pyenv/versions/9.9.9/bin");
    std::fs::create_dir_all(&bin).unwrap();
    for i in 0..2000 {
        std::fs::write(bin.join(format!("module{i}.py")), "x = 1\n").unwrap();
    }
    let builder = LocalBuilder::new(LocalConfig {
        root: files.path().join("environments"),
        pyenv_root: files.path().join("pyenv"),
        pip_cache: files.path().join("pip"),
        timeout: Duration::from_secs(60),
    });
    let recipe = |name: &str| Recipe {
        name: format!("swebench/{name}"),
        workdir: "/testbed".into(),
        python: Some("9.9.9".into()),
        source: Source::Folder(examples().join("fix-mean/environment/app")),
        script: "true".into(),
        digest: name.into(),
        shared: None,
        system_packages: Vec::new(),
    };
    let (first, second) = (recipe("first"), recipe("second"));
    let (a, b) = tokio::join!(builder.ensure(&first), builder.ensure(&second));
    a.unwrap();
    b.unwrap();
    let store: Vec<_> = std::fs::read_dir(files.path().join("environments/python"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(store, ["9.9.9"], "one copy, no leftovers");
}

/// A build past its time limit is stopped and reported as a timeout, with the log's tail,
/// and nothing is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_past_its_time_limit_is_a_timeout() {
    use arl_imagebuilder::local::BuildError;
    use arl_imagebuilder::recipe::{Recipe, Source};
    let files = tempfile::tempdir().unwrap();
    let builder = local_builder(files.path(), Duration::from_secs(2));
    let slow = Recipe {
        name: "harbor/slow".into(),
        workdir: "/app".into(),
        python: None,
        source: Source::Folder(examples().join("fix-mean/environment/app")),
        script: "echo installing a very large package; sleep 60".into(),
        digest: "slow".into(),
        shared: None,
        system_packages: Vec::new(),
    };
    let started = std::time::Instant::now();
    let error = builder.ensure(&slow).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(matches!(error, BuildError::Timeout(..)), "{error}");
    assert!(
        error
            .to_string()
            .contains("installing a very large package"),
        "{error}"
    );
    assert!(!files.path().join("environments/harbor/slow").exists());
}

/// A repository shipped as a tar archive is unpacked by the recipe's own commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tarball_source_builds() {
    use arl_imagebuilder::recipe::{Recipe, Source};
    let files = tempfile::tempdir().unwrap();
    let archive = files.path().join("repo.tar");
    let status = std::process::Command::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(examples().join("fix-mean/environment/app"))
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
    let builder = local_builder(files.path(), Duration::from_secs(60));
    let recipe = Recipe {
        name: "swebench/from-tarball".into(),
        workdir: "/testbed".into(),
        python: None,
        source: Source::Tarball(archive),
        script: "tar -xf \"$SOURCE_REPO\" -C \"$TESTBED\"".into(),
        digest: "tarball".into(),
        shared: None,
        system_packages: Vec::new(),
    };
    let built = builder.ensure(&recipe).await.unwrap();
    assert!(built.dir.join("tree/stats.py").is_file());
}

/// A builder starting over a root where a crashed one left a half-built environment
/// removes it; complete environments stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leftovers_of_a_crashed_build_are_removed_at_start() {
    use arl_imagebuilder::recipe::Recipe;
    let files = tempfile::tempdir().unwrap();
    let config = LocalConfig {
        root: files.path().join("environments"),
        pyenv_root: files.path().join("no-pyenv"),
        pip_cache: files.path().join("pip"),
        timeout: Duration::from_secs(60),
    };
    let mean = Recipe::from_harbor(&examples().join("fix-mean")).unwrap();
    LocalBuilder::new(config.clone())
        .ensure(&mean)
        .await
        .unwrap();
    let leftover = config.root.join(".build/harbor_half-built-1234");
    std::fs::create_dir_all(leftover.join("tree")).unwrap();
    let builder = LocalBuilder::new(config.clone());
    assert!(!leftover.exists());
    assert!(builder.ensure(&mean).await.unwrap().cached);
}

/// A setup script runs as the root of a user namespace of its own: no capabilities,
/// no-new-privs, no further namespaces — it cannot act as the machine's root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_scripts_run_without_privileges() {
    use arl_imagebuilder::recipe::{Recipe, Source};
    let files = tempfile::tempdir().unwrap();
    let builder = local_builder(files.path(), Duration::from_secs(60));
    let probe = |script: &str, digest: &str| Recipe {
        name: format!("harbor/{digest}"),
        workdir: "/app".into(),
        python: None,
        source: Source::Folder(examples().join("fix-mean/environment/app")),
        script: script.into(),
        digest: digest.into(),
        shared: None,
        system_packages: Vec::new(),
    };
    let confined = probe(
        "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status > confinement.txt; \
         if unshare -Ur true 2>/dev/null; then echo nested >> confinement.txt; fi; \
         if mount -t tmpfs none /tmp 2>/dev/null; then echo mounted >> confinement.txt; fi",
        "confined",
    );
    let built = builder.ensure(&confined).await.unwrap();
    let seen = std::fs::read_to_string(built.dir.join("tree/confinement.txt")).unwrap();
    assert!(seen.contains("CapEff:\t0000000000000000"), "{seen}");
    assert!(seen.contains("NoNewPrivs:\t1"), "{seen}");
    assert!(
        !seen.contains("nested") && !seen.contains("mounted"),
        "{seen}"
    );
}
