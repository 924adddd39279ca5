//! The evaluator on a real `nats-server -js`, with the real controller and dataset
//! service: after an evaluation step the validation split goes out as a batch, each
//! validation trial's outcome is counted once (a retry replaces an earlier attempt, a
//! final failure counts as unresolved, training trials are not counted), and the
//! resolution rate with its interval and pass@k reaches the run's state.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use arl_controller::{Controller, ControllerConfig};
use arl_dataset::service::DatasetService;
use arl_evaluator::service::Evaluator;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_schemas::events::{
    EvaluationCompletedV1, Example, FailureClass, RewardScoredV2, RunRequestedV1, Split,
    TaskBatchV1, TrainStepV1, TrainStepV2, TrialFailedV1, TrialSlot,
};
use arl_schemas::spec::RunSpec;
use arl_schemas::{Domain, Event, Namespace, RunId, TaskId, TrialId};
use arl_testkit::{NatsServer, test_namespace, wait_for};

async fn replay<E: Event>(
    bus: &Bus,
    ns: &Namespace,
    run: &RunId,
    domain: Domain,
    event: &str,
) -> Vec<E> {
    bus.replay::<E>(domain, ns.event_subject(domain, run, event))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_runs_after_evaluation_steps_and_its_rate_reaches_the_run() {
    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    // Admission only checks that the model is there and looks like GGUF.
    let models = tempfile::tempdir().unwrap();
    std::fs::write(
        models.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        b"GGUF\x03\0\0\0",
    )
    .unwrap();
    let shutdown = Shutdown::new();
    Controller::new(
        bus.clone(),
        ControllerConfig {
            model_dir: models.path().to_path_buf(),
            admission_concurrency: 2,
            tensorboard_dir: None,
            ..ControllerConfig::default()
        },
    )
    .await
    .unwrap()
    .start(&shutdown);
    DatasetService::new(bus.clone()).start(&shutdown);
    Evaluator::new(bus.clone()).start(&shutdown);

    let mut spec = RunSpec::default();
    spec.data.dataset = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/tasks")
        .display()
        .to_string();
    spec.data.val_size = 2;
    spec.rollout.val_n = 2;
    spec.rollout.val_temperature = 1.0;
    spec.trainer.total_steps = 3;
    spec.trainer.eval_every = 2;
    let run = RunId::generate();
    bus.publish(&RunRequestedV1 {
        run_id: run.clone(),
        spec,
        ..RunRequestedV1::example()
    })
    .await
    .unwrap();
    wait_for(
        "the registered dataset",
        Duration::from_secs(30),
        || async {
            bus.run_state(&run)
                .await
                .unwrap()
                .filter(|s| s.dataset_digest.is_some())
        },
    )
    .await;

    // val_before_train (the default): the base model is evaluated as step 0.
    let before = wait_for(
        "the evaluation before training",
        Duration::from_secs(30),
        || async {
            replay::<TaskBatchV1>(&bus, &ns, &run, Domain::Task, "batch")
                .await
                .into_iter()
                .find(|b| b.split == Split::Validation)
        },
    )
    .await;
    assert_eq!((before.step, before.tasks.len()), (0, 2));

    // Step 1 is not an evaluation step; step 2 is.
    for step in [1, 2] {
        bus.publish(&TrainStepV1 {
            run_id: run.clone(),
            step,
            policy_version: u64::from(step),
            ..TrainStepV1::example()
        })
        .await
        .unwrap();
    }
    let validation = wait_for("the validation batch", Duration::from_secs(30), || async {
        replay::<TaskBatchV1>(&bus, &ns, &run, Domain::Task, "batch")
            .await
            .into_iter()
            .find(|b| b.split == Split::Validation && b.step > 0)
    })
    .await;
    assert_eq!((validation.step, validation.samples_per_task), (2, 2));
    assert_eq!(validation.tasks.len(), 2);
    let tasks: Vec<TaskId> = validation.tasks.iter().map(|t| t.task_id.clone()).collect();

    let slot = |task: usize, sample: u32, attempt: u32, split: Split| TrialSlot {
        task_id: tasks[task].clone(),
        step: 2,
        split,
        sample_index: sample,
        attempt,
    };
    let scored = |slot: TrialSlot, resolved: bool| RewardScoredV2 {
        run_id: run.clone(),
        // Trial ids are unique per slot (one per split, step, task and sample).
        trial_id: TrialId::new(format!(
            "{:?}-{}-{}",
            slot.split, slot.task_id, slot.sample_index
        ))
        .unwrap(),
        slot,
        resolved,
        reward: if resolved { 1.0 } else { 0.0 },
        ..RewardScoredV2::example()
    };
    let failed = |slot: TrialSlot, will_retry: bool| TrialFailedV1 {
        run_id: run.clone(),
        trial_id: TrialId::new(format!(
            "f-{task}-{}",
            slot.sample_index,
            task = slot.task_id
        ))
        .unwrap(),
        slot,
        class: FailureClass::Infrastructure,
        message: "sandbox lost".into(),
        will_retry,
        failed_at: chrono::Utc::now(),
    };
    // Task 0: sample 0 fails, then its retry resolves; sample 1 does not resolve.
    // Task 1: sample 0 resolves; sample 1 fails, is retried, and fails for good.
    // A training trial of the same step is not counted.
    bus.publish(&scored(slot(0, 0, 0, Split::Validation), false))
        .await
        .unwrap();
    bus.publish(&scored(slot(0, 0, 1, Split::Validation), true))
        .await
        .unwrap();
    bus.publish(&scored(slot(0, 1, 0, Split::Validation), false))
        .await
        .unwrap();
    bus.publish(&scored(slot(1, 0, 0, Split::Train), false))
        .await
        .unwrap();
    bus.publish(&scored(slot(1, 0, 0, Split::Validation), true))
        .await
        .unwrap();
    bus.publish(&failed(slot(1, 1, 0, Split::Validation), true))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        replay::<EvaluationCompletedV1>(&bus, &ns, &run, Domain::Eval, "completed")
            .await
            .is_empty(),
        "a failure that will be retried does not decide its sample"
    );
    bus.publish(&failed(slot(1, 1, 1, Split::Validation), false))
        .await
        .unwrap();

    let completed = wait_for("the evaluation", Duration::from_secs(30), || async {
        replay::<EvaluationCompletedV1>(&bus, &ns, &run, Domain::Eval, "completed")
            .await
            .pop()
    })
    .await;
    assert_eq!((completed.step, completed.policy_version), (2, 2));
    assert_eq!((completed.tasks, completed.samples_per_task), (2, 2));
    assert_eq!(completed.resolved_samples, 2);
    assert_eq!(completed.resolution_rate, 0.5);
    // Wilson 95% for 2 of 4: (0.1500, 0.8500).
    assert!(
        (completed.ci95_low - 0.1500).abs() < 1e-3,
        "{}",
        completed.ci95_low
    );
    assert!(
        (completed.ci95_high - 0.8500).abs() < 1e-3,
        "{}",
        completed.ci95_high
    );
    // Each task resolved 1 of 2: pass@1 = 0.5, pass@2 = 1.
    let pass: Vec<(u32, f64)> = completed.pass_at_k.iter().map(|p| (p.k, p.value)).collect();
    assert_eq!(pass, [(1, 0.5), (2, 1.0)]);

    let state = wait_for(
        "the evaluation in the run's state",
        Duration::from_secs(30),
        || async {
            bus.run_state(&run)
                .await
                .unwrap()
                .filter(|s| !s.evaluations.is_empty())
        },
    )
    .await;
    assert_eq!(state.evaluations[0].step, 2);
    assert_eq!(state.evaluations[0].resolution_rate, 0.5);
    assert_eq!(state.evaluations[0].pass_at_k.get(&2), Some(&1.0));
    // … and `arl run status` shows it (the real CLI; `cargo build --bins` first).
    let status = std::process::Command::new(arl_testkit::built_binary("arl"))
        .args(["run", "status", run.as_str(), "--nats-url", &server.url()])
        .args(["--prefix", ns.prefix().unwrap()])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{shown}");
    assert!(
        shown.contains("50.0%  [ 15.0%,  85.0%]  @1=0.500 @2=1.000"),
        "{shown}"
    );
    assert!(shown.contains("registered  sha256:"), "{shown}");

    // The last step is always evaluated.
    bus.publish(&TrainStepV2 {
        run_id: run.clone(),
        step: 3,
        policy_version: 3,
        ..TrainStepV2::example()
    })
    .await
    .unwrap();
    wait_for(
        "the final validation batch",
        Duration::from_secs(30),
        || async {
            replay::<TaskBatchV1>(&bus, &ns, &run, Domain::Task, "batch")
                .await
                .into_iter()
                .find(|b| b.split == Split::Validation && b.step == 3)
        },
    )
    .await;
    shutdown.trigger();
    shutdown.wait().await;
}
