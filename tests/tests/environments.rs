//! The six SWE-bench instances of `../shared/data/swebench`: the image builder builds each
//! environment in bubblewrap with the instance's recorded setup commands (pip from PyPI,
//! Python from pyenv) and reuses it the second time; the sandbox service leases it and the
//! instance's test command passes inside; in clean sandboxes the gold patch grades resolved
//! and the empty patch does not. Explicit failures for a missing interpreter and a missing
//! commit. Needs `arl-sandbox-init` built (`cargo build --bins`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use arl_imagebuilder::local::{BuildError, LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::{Recipe, load_instances};
use arl_reward::grading::{Resolution, grade};
use arl_reward::swebench::eval_plan;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics, Shutdown};
use arl_sandbox::config::SandboxConfig;
use arl_sandbox::service::SandboxService;
use arl_schemas::RunId;
use arl_schemas::events::EnvironmentRef;
use arl_schemas::rpc::{ExecResult, LeaseGrantV1, LeaseRequestV1, SandboxLimits, SandboxOp};
use arl_testkit::{NatsServer, built_binary, http, test_namespace};

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

/// The dataset row of an instance: gold patch, test patch, FAIL_TO_PASS, PASS_TO_PASS.
fn dataset_row(id: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(shared_swebench().join("verified_mini_50.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["instance_id"] == id)
        .unwrap()
}

async fn write(grant: &LeaseGrantV1, path: &str, content: &str) {
    let response = http(
        &format!("{}/files?path={path}", grant.endpoint),
        "PUT",
        &[("authorization", &format!("Bearer {}", grant.token))],
        content.as_bytes(),
    )
    .await
    .unwrap();
    assert!(response.status < 300, "{}", response.text());
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

        // Grading in clean sandboxes: the gold patch resolves the instance, no patch does not.
        let row = dataset_row(id);
        let list = |field: &str| -> Vec<String> {
            serde_json::from_str(row[field].as_str().unwrap()).unwrap()
        };
        let (f2p, p2p) = (list("FAIL_TO_PASS"), list("PASS_TO_PASS"));
        for (candidate, expected) in [
            (row["patch"].as_str().unwrap(), Resolution::ResolvedFull),
            ("", Resolution::ResolvedNo),
        ] {
            let clean: LeaseGrantV1 = bus
                .request(
                    ns.sandbox_rpc("any", SandboxOp::Lease),
                    &request,
                    Duration::from_secs(120),
                )
                .await
                .unwrap();
            let plan = eval_plan(
                candidate,
                row["test_patch"].as_str().unwrap(),
                &instance.eval_env,
                &instance.test_command,
            );
            for (path, content) in &plan.files {
                write(&clean, path, content).await;
            }
            let run = exec(&clean, &plan.command).await;
            let log = format!("{}{}", run.stdout, run.stderr);
            let report = grade(&instance.repo, &log, &f2p, &p2p)
                .unwrap_or_else(|e| panic!("{id}: {e}\n{log}"));
            assert_eq!(report.resolution, expected, "{id}: {report:?}\n{log}");
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

/// A Harbor task graded the same way: the reference solution, run by an "agent" in one
/// sandbox, becomes a patch; in clean sandboxes that patch scores 1 and no patch scores 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harbor_task_scores_its_solution_1_and_nothing_0() {
    let files = tempfile::Builder::new()
        .prefix("arl-harbor-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(files.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = files.path().join("environments");
    std::fs::create_dir_all(&root).unwrap();
    let task = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tasks/fix-mean");
    let recipe = Recipe::from_harbor(&task).unwrap();
    builder(&root).ensure(&recipe).await.unwrap();

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
            name: recipe.name.clone(),
            digest: None,
        },
        ttl_s: 600,
        limits: SandboxLimits::default(),
    };
    let lease = || async {
        bus.request::<_, LeaseGrantV1>(
            ns.sandbox_rpc("any", SandboxOp::Lease),
            &request,
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    };
    // The "agent": runs the reference solution, and its work becomes a patch.
    let agent = lease().await;
    let solve = std::fs::read_to_string(task.join("solution/solve.sh")).unwrap();
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

    let tests: Vec<(String, String)> = ["test.sh", "test_outputs.py"]
        .iter()
        .map(|f| {
            (
                (*f).to_owned(),
                std::fs::read_to_string(task.join("tests").join(f)).unwrap(),
            )
        })
        .collect();
    for (candidate, expected) in [(patch.as_str(), 1.0), ("", 0.0)] {
        let clean = lease().await;
        let plan = arl_reward::harbor::eval_plan(candidate, &tests, &clean.workdir);
        for (path, content) in &plan.files {
            write(&clean, path, content).await;
        }
        let run = exec(&clean, &plan.command).await;
        let log = format!("{}{}", run.stdout, run.stderr);
        let reward =
            arl_reward::harbor::reward_from_log(&log).unwrap_or_else(|e| panic!("{e}\n{log}"));
        assert_eq!(reward, expected, "{log}");
    }
    shutdown.trigger();
    shutdown.wait().await;
}
