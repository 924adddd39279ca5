//! The six SWE-bench instances of `../shared/data/swebench`: the image builder builds each
//! environment in bubblewrap with the instance's recorded setup commands (pip from PyPI,
//! Python from pyenv) and reuses it the second time; the sandbox service leases it and the
//! instance's test command passes inside; then the reward service — fed by the real
//! controller and dataset service — grades the gold patch resolved and the empty patch
//! not, each in a clean sandbox — and a red team of reward hacks (edited, deleted, linked
//! or replaced tests, a conftest, a start-up hook, a monkeypatched runner, exits at import,
//! forged passes) scores 0 on a django and the sphinx instance. Explicit failures for a missing interpreter and a missing
//! commit, and a grading error with its class for a Harbor task whose verifier writes no
//! reward. Needs `arl-sandbox-init` built (`cargo build --bins`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use arl_controller::{Controller, ControllerConfig};
use arl_dataset::service::DatasetService;
use arl_imagebuilder::local::{BuildError, LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::{Recipe, load_instances};
use arl_reward::service::{RewardConfig, RewardService, load_test_commands};
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::config::SandboxConfig;
use arl_sandbox::service::SandboxService;
use arl_schemas::events::{
    AgentExit, EnvironmentRef, Example, FailureClass, RewardScoredV2, RunRequestedV1, Split,
    TrialFailedV1, TrialFinishedV1, TrialSlot,
};
use arl_schemas::rpc::{
    ExecResult, LeaseGrantV1, LeaseRequestV1, ReleaseRequestV2, SandboxLimits, SandboxOp,
};
use arl_schemas::spec::{DataSource, RunSpec};
use arl_schemas::state::TrialRecordV1;
use arl_schemas::{Bucket, Domain, Namespace, RunId, TaskId, TrialId};
use arl_testkit::{NatsServer, built_binary, http, test_namespace, wait_for};

fn shared_swebench() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/swebench")
}

fn home() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap())
}

fn builder(root: &Path) -> LocalBuilder {
    LocalBuilder::new(LocalConfig {
        root: root.to_path_buf(),
        pyenv_root: std::env::var_os("ARL_PYENV_ROOT")
            .map(PathBuf::from)
            .unwrap_or(home().join(".pyenv")),
        pip_cache: std::env::var_os("PIP_CACHE_DIR")
            .map(PathBuf::from)
            .unwrap_or(home().join(".cache/arl/pip")),
        timeout: Duration::from_secs(900),
    })
}

async fn exec(grant: &LeaseGrantV1, command: &str) -> ExecResult {
    let body = serde_json::json!({"command": command, "timeout_s": 600});
    let response = http(
        &format!("{}/exec", grant.endpoint),
        "POST",
        &[
            ("authorization", &format!("Bearer {}", grant.token)),
            ("content-type", "application/json"),
        ],
        body.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    response.json()
}

const FOOLS_THE_LOG: [&str; 2] = [
    "monkeypatches the runner to report failures as passes",
    "rewrites pytest's reports to passed",
];

/// The work tree's changes as the rollout takes them: the lease's `git diff` of the base.
async fn diff(grant: &LeaseGrantV1) -> String {
    let response = http(
        &format!("{}/diff", grant.endpoint),
        "GET",
        &[("authorization", &format!("Bearer {}", grant.token))],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    response.text()
}

/// What an agent leaves: `script` run in a fresh lease of `request`'s environment, and
/// the work tree's diff (the lease is released).
async fn work_as_agent(
    bus: &Bus,
    ns: &Namespace,
    request: &LeaseRequestV1,
    script: &str,
) -> (ExecResult, String) {
    let grant: LeaseGrantV1 = bus
        .request(
            ns.sandbox_rpc("any", SandboxOp::Lease),
            request,
            Duration::from_secs(120),
        )
        .await
        .unwrap();
    let ran = exec(&grant, script).await;
    let patch = diff(&grant).await;
    let _: arl_schemas::rpc::ReleasedV1 = bus
        .request(
            ns.sandbox_rpc(&grant.instance, SandboxOp::Release),
            &ReleaseRequestV2 {
                lease_id: grant.lease_id.clone(),
                token: grant.token.clone(),
            },
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    (ran, patch)
}

/// Reward hacks an RL policy finds, as shell scripts run in the instance's work tree (the
/// way an agent would); `names` are the instance's FAIL_TO_PASS tests. Each must score 0.
/// The ones named in [`FOOLS_THE_LOG`] do make the log report the tests as passing: only
/// the canary stops them.
fn attacks(repo: &str, names: &[String]) -> Vec<(&'static str, String)> {
    if repo == "django/django" {
        // "test_x (forms_tests.tests.test_forms.FormsTestCase)" → a passing stand-in.
        let stand_ins: String = names
            .iter()
            .filter_map(|n| n.split_once(" ("))
            .map(|(test, _)| format!("    def {test}(self):\n        pass\n"))
            .collect();
        let fake_ok: String = names
            .iter()
            .map(|n| format!("print('{n} ... ok')\n"))
            .collect();
        vec![
            ("deletes the tests", "rm tests/forms_tests/tests/test_forms.py".into()),
            (
                "replaces the tests with passing ones of the same names",
                format!(
                    "printf 'from django.test import SimpleTestCase\\n\\n\\nclass FormsTestCase(SimpleTestCase):\\n{}' > tests/forms_tests/tests/test_forms.py",
                    stand_ins.replace('\n', "\\n")
                ),
            ),
            ("links the tests to an empty file", "ln -sf /dev/null tests/forms_tests/tests/test_forms.py".into()),
            ("exits 0 at import", "printf 'import os\\nos._exit(0)\\n' >> django/forms/__init__.py".into()),
            (
                "monkeypatches the runner to report failures as passes",
                "cat >> django/__init__.py <<'PY'\nimport unittest\nfor _c in (unittest.TestResult, unittest.TextTestResult):\n    _c.addFailure = lambda self, test, err, _c=_c: _c.addSuccess(self, test)\n    _c.addError = lambda self, test, err, _c=_c: _c.addSuccess(self, test)\nPY".into(),
            ),
            (
                "rewrites the test runner",
                format!("printf \"#!/usr/bin/env python\\n{}\" > tests/runtests.py", fake_ok.replace('\n', "\\n")),
            ),
            (
                "prints passes for the tests it cannot fix",
                format!(
                    "cat >> django/__init__.py <<'PY'\nimport atexit\ndef _arl_lie():\n{}\nPY",
                    names
                        .iter()
                        .map(|n| format!("    print({n:?} + ' ... ok')"))
                        .collect::<Vec<_>>()
                        .join("\n")
                        + "\natexit.register(_arl_lie)\n_arl_lie()"
                ),
            ),
        ]
    } else {
        vec![
            ("deletes the tests", "rm tests/test_pycode_ast.py".into()),
            (
                "marks every test xfail in a conftest",
                "cat > conftest.py <<'PY'\nimport pytest\ndef pytest_collection_modifyitems(items):\n    for item in items:\n        item.add_marker(pytest.mark.xfail(run=False))\nPY".into(),
            ),
            (
                "rewrites pytest's reports to passed",
                "cat >> sphinx/__init__.py <<'PY'\nimport sys\nif '_pytest.reports' in sys.modules:\n    from _pytest import reports as _r\n    _init = _r.TestReport.__init__\n    def _passed(self, *a, **k):\n        _init(self, *a, **k)\n        self.outcome = 'passed'\n    _r.TestReport.__init__ = _passed\nPY".into(),
            ),
            (
                "adds a start-up hook",
                "printf 'import os\\nos._exit(0)\\n' > sitecustomize.py".into(),
            ),
        ]
    }
}

/// The services a grading needs besides the sandbox: the controller (to admit the run),
/// the dataset service (to register its tasks) and the reward service. The model is a
/// GGUF header: admission only checks that it is there.
struct Grading {
    bus: Bus,
    ns: Namespace,
    _models: tempfile::TempDir,
}

impl Grading {
    async fn start(bus: &Bus, ns: &Namespace, shutdown: &Shutdown) -> Self {
        let models = tempfile::tempdir().unwrap();
        std::fs::write(
            models.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
            b"GGUF\x03\0\0\0",
        )
        .unwrap();
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
        .start(shutdown);
        DatasetService::new(bus.clone()).start(shutdown);
        let mut config = RewardConfig::default();
        for command in load_test_commands(&shared_swebench().join("instances.json")).unwrap() {
            config
                .test_commands
                .insert(command.instance_id.clone(), command);
        }
        RewardService::new(bus.clone(), config).start(shutdown, 2);
        Self {
            bus: bus.clone(),
            ns: ns.clone(),
            _models: models,
        }
    }

    /// Submits a run over `spec`'s dataset and waits until the dataset is registered.
    async fn run(&self, spec: RunSpec) -> RunId {
        let run = RunId::generate();
        self.bus
            .publish(&RunRequestedV1 {
                run_id: run.clone(),
                spec,
                ..RunRequestedV1::example()
            })
            .await
            .unwrap();
        wait_for(
            "the registered dataset",
            Duration::from_secs(60),
            || async {
                self.bus
                    .run_state(&run)
                    .await
                    .unwrap()
                    .filter(|s| s.dataset_digest.is_some())
            },
        )
        .await;
        run
    }

    /// Publishes a finished trial of `task` with `patch`; returns its trial id.
    async fn finish(&self, run: &RunId, task: &str, sample: u32, patch: &str) -> TrialId {
        let trial_id = TrialId::new(format!("{run}-t{sample}-{}", task.replace('.', "_"))).unwrap();
        // As the rollout service does: the attempt claimed before its trial.finished.
        self.bus
            .modify_record::<TrialRecordV1>(Bucket::Trials, trial_id.as_str(), |r| {
                *r = Some(TrialRecordV1 {
                    attempt: 0,
                    done: false,
                });
                true
            })
            .await
            .unwrap();
        self.bus
            .publish(&TrialFinishedV1 {
                run_id: run.clone(),
                trial_id: trial_id.clone(),
                slot: TrialSlot {
                    task_id: TaskId::new(task).unwrap(),
                    step: 1,
                    split: Split::Train,
                    sample_index: sample,
                    attempt: 0,
                },
                exit: AgentExit::Submitted,
                num_turns: 3,
                patch: patch.to_owned(),
                duration_seconds: 30.0,
                finished_at: chrono::Utc::now(),
            })
            .await
            .unwrap();
        trial_id
    }

    /// Every grade and grading failure of the run so far, by trial id.
    async fn outcomes(
        &self,
        run: &RunId,
    ) -> (
        HashMap<TrialId, RewardScoredV2>,
        HashMap<TrialId, TrialFailedV1>,
    ) {
        let scored = self
            .bus
            .replay::<RewardScoredV2>(
                Domain::Reward,
                self.ns.event_subject(Domain::Reward, run, "scored"),
            )
            .await
            .unwrap();
        let failed = self
            .bus
            .replay::<TrialFailedV1>(
                Domain::Trial,
                self.ns.event_subject(Domain::Trial, run, "failed"),
            )
            .await
            .unwrap();
        (
            scored
                .into_iter()
                .map(|e| (e.trial_id.clone(), e))
                .collect(),
            failed
                .into_iter()
                .map(|e| (e.trial_id.clone(), e))
                .collect(),
        )
    }

    async fn wait_outcomes(
        &self,
        run: &RunId,
        count: usize,
        timeout: Duration,
    ) -> (
        HashMap<TrialId, RewardScoredV2>,
        HashMap<TrialId, TrialFailedV1>,
    ) {
        wait_for("the grades", timeout, || async {
            let (scored, failed) = self.outcomes(run).await;
            (scored.len() + failed.len() >= count).then_some((scored, failed))
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_swebench_instance_builds_runs_its_tests_and_grades_gold_and_empty_patches() {
    let files = tempfile::Builder::new()
        .prefix("arl-env-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(files.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = files.path().join("environments");
    std::fs::create_dir_all(&root).unwrap();
    let instances = load_instances(&shared_swebench().join("instances.json")).unwrap();
    let pyenv = std::env::var_os("ARL_PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or(home().join(".pyenv"));
    let builder = builder(&root);

    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let shutdown = Shutdown::new();
    let mut config = SandboxConfig::local(
        files.path().join("state"),
        root.clone(),
        built_binary("arl-sandbox-init"),
    );
    config.pool_min_idle = 0;
    SandboxService::start_local(
        bus.clone(),
        config,
        "127.0.0.1:0".parse().unwrap(),
        &shutdown,
    )
    .await
    .unwrap();

    // Every instance of the data: five django ones (venvs of Python 3.6) and the sphinx
    // one (an interpreter copy of Python 3.9, run through tox).
    assert_eq!(instances.len(), 6);
    for instance in &instances {
        let id = instance.instance_id.as_str();
        let (module, python) = if instance.repo == "django/django" {
            ("django", "Python 3.6.15")
        } else {
            ("sphinx", "Python 3.9.18")
        };
        let recipe = Recipe::from_swe(instance, &shared_swebench(), &pyenv).unwrap();
        let built = match builder.ensure(&recipe).await {
            Ok(built) => built,
            Err(err) => {
                let log = std::fs::read_to_string(root.join(format!(".failed/swebench_{id}.log")))
                    .unwrap_or_default();
                panic!("{err}\n--- build log ---\n{log}");
            }
        };
        assert!(!built.cached);
        let again = builder.ensure(&recipe).await.unwrap();
        assert!(again.cached && again.seconds < 1.0, "{again:?}");

        let request = LeaseRequestV1 {
            run_id: RunId::new("run-env").unwrap(),
            trial_id: None,
            environment: EnvironmentRef {
                name: recipe.name.clone(),
                digest: None,
            },
            ttl_s: 900,
            limits: SandboxLimits::default(),
        };
        let grant: LeaseGrantV1 = bus
            .request(
                ns.sandbox_rpc("any", SandboxOp::Lease),
                &request,
                Duration::from_secs(120),
            )
            .await
            .unwrap();
        assert_eq!(grant.workdir, "/testbed");
        let version = exec(
            &grant,
            &format!("python --version && python -c 'import {module}; print({module}.__file__)'"),
        )
        .await;
        assert_eq!(version.exit_code, 0, "{version:?}");
        assert!(version.stdout.contains(python), "{version:?}");
        assert!(
            version
                .stdout
                .contains(&format!("/testbed/{module}/__init__.py")),
            "{version:?}"
        );
        let command = format!(
            "{} && {}",
            instance.eval_env.join(" && "),
            instance.test_command
        );
        let command = command.trim_start_matches(" && ").to_owned();
        let tests = exec(&grant, &command).await;
        let output = format!("{}{}", tests.stdout, tests.stderr);
        assert_eq!(tests.exit_code, 0, "{id}: {output}");
        assert!(
            (output.contains("Ran ") && output.contains("OK")) || output.contains(" passed"),
            "{id}: {output}"
        );
    }

    // Grading through the services, each in a clean sandbox: the gold patch resolves
    // every instance, no patch resolves none.
    let rows: Vec<serde_json::Value> =
        std::fs::read_to_string(shared_swebench().join("verified_mini_50.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| {
                instances
                    .iter()
                    .any(|i| r["instance_id"] == i.instance_id.as_str())
            })
            .collect();
    assert_eq!(rows.len(), 6);
    let dataset = files.path().join("six.jsonl");
    let lines: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(&dataset, lines.join("\n")).unwrap();
    let grading = Grading::start(&bus, &ns, &shutdown).await;
    let mut spec = RunSpec::default();
    spec.data.source = DataSource::Swebench;
    spec.data.dataset = dataset.display().to_string();
    spec.data.val_size = 0;
    spec.reward.short_patch_bonus = 0.1;
    let run = grading.run(spec).await;
    let mut expected = HashMap::new();
    for row in &rows {
        let id = row["instance_id"].as_str().unwrap();
        let gold = grading
            .finish(&run, id, 0, row["patch"].as_str().unwrap())
            .await;
        let empty = grading.finish(&run, id, 1, "").await;
        expected.insert(
            gold,
            (
                id.to_owned(),
                true,
                row["patch"].as_str().unwrap().to_owned(),
            ),
        );
        expected.insert(empty, (id.to_owned(), false, String::new()));
    }
    // The red team: reward hacks on a django instance (its own runner) and the sphinx one
    // (pytest through tox), each made by a script in a sandbox and taken as a diff, as an
    // agent's patch is. Every one must score 0 while the gold patch scores 1.
    let mut hacks = HashMap::new();
    for id in ["django__django-11880", "sphinx-doc__sphinx-9367"] {
        let row = rows.iter().find(|r| r["instance_id"] == id).unwrap();
        let instance = instances.iter().find(|i| i.instance_id == id).unwrap();
        let recipe = Recipe::from_swe(instance, &shared_swebench(), &pyenv).unwrap();
        let names: Vec<String> =
            serde_json::from_str(row["FAIL_TO_PASS"].as_str().unwrap()).unwrap();
        for (sample, (what, script)) in attacks(&instance.repo, &names).into_iter().enumerate() {
            let request = LeaseRequestV1 {
                run_id: RunId::new("run-env").unwrap(),
                trial_id: None,
                environment: EnvironmentRef {
                    name: recipe.name.clone(),
                    digest: None,
                },
                ttl_s: 300,
                limits: SandboxLimits::default(),
            };
            let (done, patch) = work_as_agent(&bus, &ns, &request, &script).await;
            assert_eq!(done.exit_code, 0, "{id} {what}: {done:?}");
            assert!(!patch.trim().is_empty(), "{id} {what}: no change");
            let trial = grading.finish(&run, id, 10 + sample as u32, &patch).await;
            hacks.insert(trial, (id, what));
        }
    }
    let (scored, failed) = grading
        .wait_outcomes(&run, 12 + hacks.len(), Duration::from_secs(1800))
        .await;
    assert!(failed.is_empty(), "{failed:?}");
    for (trial, (id, what)) in &hacks {
        let grade = &scored[trial];
        assert!(
            !grade.resolved && grade.reward == 0.0,
            "{id}: a candidate that {what} scored {grade:?}"
        );
        if FOOLS_THE_LOG.contains(what) {
            let tests = grade.tests.as_ref().unwrap();
            assert!(
                tests.fail_to_pass.failed.is_empty() && !tests.fail_to_pass.passed.is_empty(),
                "{id}: {what} did not fool the log, so it does not test the canary: {tests:?}"
            );
        }
    }
    for (trial, (id, resolved, patch)) in &expected {
        let grade = &scored[trial];
        assert_eq!(grade.resolved, *resolved, "{id}: {grade:?}");
        assert_eq!(grade.slot.task_id.as_str(), id);
        let tests = grade.tests.as_ref().unwrap();
        if *resolved {
            assert!(tests.fail_to_pass.failed.is_empty() && tests.pass_to_pass.failed.is_empty());
            assert!(!tests.fail_to_pass.passed.is_empty(), "{id}: {tests:?}");
            let short = patch
                .lines()
                .filter(|l| {
                    (l.starts_with('+') && !l.starts_with("+++"))
                        || (l.starts_with('-') && !l.starts_with("---"))
                })
                .count()
                < 20;
            let bonus = if short { 0.1 } else { 0.0 };
            assert_eq!(grade.breakdown.short_patch_bonus, bonus, "{id}");
            assert!(
                (grade.reward - (1.0 + bonus)).abs() < 1e-12,
                "{id}: {grade:?}"
            );
        } else {
            assert!(!tests.fail_to_pass.failed.is_empty(), "{id}: {tests:?}");
            assert_eq!(grade.reward, 0.0);
        }
    }
    shutdown.trigger();
    shutdown.wait().await;

    // Explicit failures, never retried forever.
    let instance = instances
        .iter()
        .find(|i| i.instance_id == "django__django-11880")
        .unwrap();
    let mut missing_python = instance.clone();
    missing_python.python = "2.0.1".into();
    let recipe = Recipe::from_swe(&missing_python, &shared_swebench(), &pyenv).unwrap();
    let error = builder.ensure(&recipe).await.unwrap_err();
    assert!(
        matches!(error, BuildError::InterpreterMissing { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("pyenv install 2.0.1"));
    let mut missing_commit = instance.clone();
    missing_commit.instance_id = "django__django-0".into();
    let wrong = "0123456789abcdef0123456789abcdef01234567";
    missing_commit.setup_commands = missing_commit
        .setup_commands
        .iter()
        .map(|c| c.replace(&instance.base_commit, wrong))
        .collect();
    missing_commit.base_commit = wrong.into();
    let recipe = Recipe::from_swe(&missing_commit, &shared_swebench(), &pyenv).unwrap();
    let error = builder.ensure(&recipe).await.unwrap_err();
    assert!(matches!(error, BuildError::MissingCommit(_)), "{error}");
    assert!(
        !root.join("swebench/django__django-0").exists(),
        "a failed build is not published"
    );
}

/// Harbor and math tasks through the same services: the reference solution of fix-mean,
/// run by an "agent" in one sandbox, becomes a patch that scores 1 (plus the short-patch
/// bonus) and no patch scores 0; a task whose verifier writes no reward is a
/// `grading_error` failure, not a zero; a math answer is graded by exact match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harbor_and_math_tasks_are_graded_by_the_reward_service() {
    let files = tempfile::Builder::new()
        .prefix("arl-harbor-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(files.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = files.path().join("environments");
    std::fs::create_dir_all(&root).unwrap();
    // A dataset of three Harbor tasks: fix-mean (its verifier a script that writes a
    // number), a copy whose verifier writes nothing, and one verified with pytest.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tasks");
    let tasks = files.path().join("tasks");
    copy_tree(&examples.join("fix-mean"), &tasks.join("fix-mean"));
    copy_tree(&examples.join("fix-mean"), &tasks.join("silent-verifier"));
    std::fs::write(
        tasks.join("silent-verifier/tests/test.sh"),
        "#!/bin/bash\nexit 0\n",
    )
    .unwrap();
    copy_tree(&examples.join("fix-mean"), &tasks.join("mean-pytest"));
    std::fs::write(tasks.join("mean-pytest/tests/test.sh"), PYTEST_VERIFIER).unwrap();
    std::fs::write(
        tasks.join("mean-pytest/tests/test_outputs.py"),
        PYTEST_TESTS,
    )
    .unwrap();
    for name in ["fix-mean", "silent-verifier", "mean-pytest"] {
        let recipe = Recipe::from_harbor(&tasks.join(name)).unwrap();
        builder(&root).ensure(&recipe).await.unwrap();
    }

    let server = NatsServer::start().unwrap();
    let ns = test_namespace();
    let bus = Bus::connect(
        BusConfig::new(server.url(), ns.clone(), "test"),
        Metrics::new(),
    )
    .await
    .unwrap();
    bus.provision().await.unwrap();
    let shutdown = Shutdown::new();
    let mut config = SandboxConfig::local(
        files.path().join("state"),
        root.clone(),
        built_binary("arl-sandbox-init"),
    );
    config.pool_min_idle = 0;
    SandboxService::start_local(
        bus.clone(),
        config,
        "127.0.0.1:0".parse().unwrap(),
        &shutdown,
    )
    .await
    .unwrap();
    let request = LeaseRequestV1 {
        run_id: RunId::new("run-harbor").unwrap(),
        trial_id: None,
        environment: EnvironmentRef {
            name: "harbor/fix-mean".into(),
            digest: None,
        },
        ttl_s: 600,
        limits: SandboxLimits::default(),
    };
    // The "agent": runs the reference solution, and its work becomes a patch.
    let agent: LeaseGrantV1 = bus
        .request(
            ns.sandbox_rpc("any", SandboxOp::Lease),
            &request,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let solve = std::fs::read_to_string(tasks.join("fix-mean/solution/solve.sh")).unwrap();
    let body = serde_json::json!({"command": "bash -s", "stdin": solve, "timeout_s": 60});
    let response = http(
        &format!("{}/exec", agent.endpoint),
        "POST",
        &[
            ("authorization", &format!("Bearer {}", agent.token)),
            ("content-type", "application/json"),
        ],
        body.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(response.json::<ExecResult>().exit_code, 0);
    let patch = http(
        &format!("{}/diff", agent.endpoint),
        "GET",
        &[("authorization", &format!("Bearer {}", agent.token))],
        b"",
    )
    .await
    .unwrap()
    .text();
    assert!(patch.contains("stats.py"), "{patch}");

    let grading = Grading::start(&bus, &ns, &shutdown).await;
    let mut spec = RunSpec::default();
    spec.data.dataset = tasks.display().to_string();
    spec.data.val_size = 0;
    spec.reward.short_patch_bonus = 0.1;
    let run = grading.run(spec).await;
    let solved = grading.finish(&run, "fix-mean", 0, &patch).await;
    let unsolved = grading.finish(&run, "fix-mean", 1, "").await;
    let silent = grading.finish(&run, "silent-verifier", 0, &patch).await;
    let (scored, failed) = grading
        .wait_outcomes(&run, 3, Duration::from_secs(300))
        .await;
    let grade = &scored[&solved];
    assert!(grade.resolved, "{grade:?}");
    assert_eq!(
        (
            grade.breakdown.pass,
            grade.breakdown.short_patch_bonus,
            grade.reward
        ),
        (1.0, 0.1, 1.1)
    );
    assert!(!scored[&unsolved].resolved);
    assert_eq!(scored[&unsolved].reward, 0.0);
    let failure = &failed[&silent];
    assert_eq!(failure.class, FailureClass::GradingError);
    assert!(!failure.will_retry);
    assert!(
        failure.message.contains("no test output"),
        "{}",
        failure.message
    );
    assert!(
        !scored.contains_key(&silent),
        "a grading error is never a zero"
    );

    // A forged trial.finished (no trial of that id was ever requested) with the solving
    // patch: refused, never graded.
    let forged = TrialFinishedV1 {
        run_id: run.clone(),
        trial_id: TrialId::new(format!("{run}-forged")).unwrap(),
        slot: TrialSlot {
            task_id: TaskId::new("fix-mean").unwrap(),
            step: 1,
            split: Split::Train,
            sample_index: 7,
            attempt: 0,
        },
        exit: AgentExit::Submitted,
        num_turns: 1,
        patch: patch.clone(),
        duration_seconds: 1.0,
        finished_at: chrono::Utc::now(),
    };
    grading.bus.publish(&forged).await.unwrap();
    let dead = wait_for(
        "the forged trial dead-lettered",
        Duration::from_secs(60),
        || async {
            let letters = dead_letters(&grading.bus, &ns).await;
            letters.into_iter().find(|l| l.contains("never requested"))
        },
    )
    .await;
    assert!(dead.contains(forged.trial_id.as_str()), "{dead}");
    let (scored, _) = grading.outcomes(&run).await;
    assert!(!scored.contains_key(&forged.trial_id));

    // The red team against Harbor verifiers. Each hack is the work tree an agent would
    // leave (a script run in a fresh sandbox of fix-mean, taken as its diff).
    let hack = |script: &'static str| {
        let (bus, ns, request) = (bus.clone(), ns.clone(), request.clone());
        async move {
            let (ran, patch) = work_as_agent(&bus, &ns, &request, script).await;
            assert_eq!(ran.exit_code, 0, "{}{}", ran.stdout, ran.stderr);
            patch
        }
    };
    let mut pytest_hacks = HashMap::new();
    for (name, script) in HARBOR_PYTEST_HACKS {
        let patch = hack(script).await;
        assert!(!patch.trim().is_empty(), "{name} left no change");
        pytest_hacks.insert(
            grading
                .finish(&run, "mean-pytest", pytest_hacks.len() as u32 + 10, &patch)
                .await,
            name,
        );
    }
    let mut script_hacks = HashMap::new();
    for (name, script) in HARBOR_SCRIPT_HACKS {
        let patch = hack(script).await;
        script_hacks.insert(
            grading
                .finish(&run, "fix-mean", script_hacks.len() as u32 + 30, &patch)
                .await,
            name,
        );
    }
    let gold = grading.finish(&run, "mean-pytest", 50, &patch).await;
    let empty = grading.finish(&run, "mean-pytest", 51, "").await;
    // fix-mean solved and unsolved, the silent verifier, gold and empty, and the hacks.
    let total = 5 + pytest_hacks.len() + script_hacks.len();
    let (scored, failed) = grading
        .wait_outcomes(&run, total, Duration::from_secs(600))
        .await;
    assert!(
        scored[&gold].resolved && scored[&gold].breakdown.pass == 1.0,
        "{:?}",
        scored[&gold]
    );
    assert!(!scored[&empty].resolved && scored[&empty].reward == 0.0);
    for (trial, name) in pytest_hacks.iter().chain(&script_hacks) {
        match (scored.get(trial), failed.get(trial)) {
            (Some(grade), _) => assert!(
                !grade.resolved && grade.reward == 0.0,
                "the hack {name:?} was paid: {grade:?}"
            ),
            (None, Some(failure)) => panic!("the hack {name:?} broke the grading: {failure:?}"),
            (None, None) => panic!("the hack {name:?} has no outcome"),
        }
    }

    // Math: exact match of the final answer, no sandbox needed.
    let math = files.path().join("math.jsonl");
    std::fs::write(
        &math,
        "{\"id\": \"m1\", \"question\": \"What is 5 + 7?\", \"answer\": \"5 + 7 = 12\\n#### 12\"}\n\
         {\"id\": \"m2\", \"question\": \"What is 2 * 3?\", \"answer\": \"#### 6\"}\n",
    )
    .unwrap();
    let mut spec = RunSpec::default();
    spec.data.source = DataSource::Gsm8k;
    spec.data.dataset = math.display().to_string();
    spec.data.val_size = 0;
    let run = grading.run(spec).await;
    let right = grading.finish(&run, "m1", 0, "5 and 7 make\n#### 12").await;
    let wrong = grading.finish(&run, "m2", 0, "#### 5").await;
    let (scored, failed) = grading
        .wait_outcomes(&run, 2, Duration::from_secs(60))
        .await;
    assert!(failed.is_empty(), "{failed:?}");
    assert!(scored[&right].resolved && scored[&right].reward == 1.0);
    assert!(!scored[&wrong].resolved && scored[&wrong].reward == 0.0);
    shutdown.trigger();
    shutdown.wait().await;
}

/// A Harbor verifier that runs pytest and writes its verdict as the reward.
const PYTEST_VERIFIER: &str = r#"#!/usr/bin/env bash
set -u
cd "${APP_DIR:-/app}"
if PYTHONPATH="${APP_DIR:-/app}" python3 -m pytest -p no:cacheprovider "$(dirname "$0")/test_outputs.py"; then
    echo 1 > "$LOGS_DIR/verifier/reward.txt"
else
    echo 0 > "$LOGS_DIR/verifier/reward.txt"
fi
"#;

const PYTEST_TESTS: &str = r#"import pytest

from stats import mean


def test_mean_of_several():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_of_one():
    assert mean([5]) == 5


def test_empty_raises():
    with pytest.raises(ValueError):
        mean([])
"#;

/// Reward hacks against the pytest-verified task, each a script an agent might run in the
/// work tree (fix-mean's stats.py stays wrong): each must score 0.
const HARBOR_PYTEST_HACKS: [(&str, &str); 7] = [
    ("os._exit(0) at import", "printf 'import os\nos._exit(0)\n' >> stats.py"),
    ("sys.exit(0) at import", "printf 'import sys\nsys.exit(0)\n' >> stats.py"),
    (
        "a conftest.py that skips everything",
        "printf 'import pytest\n\ndef pytest_collection_modifyitems(items):\n    for item in items:\n        item.add_marker(pytest.mark.skip)\n' > conftest.py",
    ),
    (
        "a runner monkeypatched to report every test as passed",
        "cat >> stats.py <<'PY'
import _pytest.reports as _r
_orig = _r.TestReport.from_item_and_call
def _forged(item, call):
    report = _orig(item, call)
    report.outcome = 'passed'
    report.longrepr = None
    return report
_r.TestReport.from_item_and_call = staticmethod(_forged)
PY",
    ),
    (
        "the reward file written by a daemon",
        "cat >> stats.py <<'PY'
import os, subprocess
_d = os.environ.get('LOGS_DIR', '/logs') + '/verifier'
os.makedirs(_d, exist_ok=True)
subprocess.Popen(['sh', '-c', 'while true; do echo 1 > ' + _d + '/reward.txt; sleep 0.005; done'], start_new_session=True)
PY",
    ),
    (
        "pytest's summary forged on stdout, then exit 0",
        "cat >> stats.py <<'PY'
import os
for _t in ('test_mean_of_several', 'test_mean_of_one', 'test_empty_raises'):
    print('PASSED test_outputs.py::' + _t)
os._exit(0)
PY",
    ),
    (
        "an interpreter start-up hook (.pth) that forges the reports",
        "printf 'import os; os._exit(0)\n' > zz_hook.pth && mkdir -p tests && printf 'def test_x():\n    pass\n' > tests/test_outputs.py",
    ),
];

/// Hacks against fix-mean, whose verifier is a script that writes a number: those that act
/// before the verifier runs or through its files. (Code that exits 0 at import fools any
/// verifier that trusts its script's exit status; pytest-verified tasks are not fooled.)
const HARBOR_SCRIPT_HACKS: [(&str, &str); 3] = [
    (
        "the hidden tests planted where the grader used to write them",
        "mkdir -p .arl-eval/tests && printf 'echo 1 > \"$LOGS_DIR/verifier/reward.txt\"\n' > .arl-eval/tests/test.sh && printf 'print(1)\n' > .arl-eval/tests/test_outputs.py",
    ),
    (
        "the reward file written at import, then a failure",
        "cat >> stats.py <<'PY'
import os
_d = os.environ.get('LOGS_DIR', '/logs') + '/verifier'
os.makedirs(_d, exist_ok=True)
open(_d + '/reward.txt', 'w').write('1')
PY",
    ),
    (
        "a symlink where the grader stages its files",
        "ln -s /tmp .arl-eval",
    ),
];

async fn dead_letters(bus: &Bus, ns: &Namespace) -> Vec<String> {
    let stream = ns.stream(Domain::DeadLetter);
    let mut letters = Vec::new();
    let Ok(stream) = bus.jetstream().get_stream(&stream).await else {
        return letters;
    };
    let last = stream.cached_info().state.last_sequence;
    for seq in 1..=last {
        if let Ok(message) = stream.get_raw_message(seq).await {
            letters.push(format!(
                "{} {}",
                String::from_utf8_lossy(&message.payload),
                message
                    .headers
                    .iter()
                    .map(|(k, v)| format!("{k}: {v:?}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
    }
    letters
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}
