//! `arl dataset validate SPEC`: datasets you can trust before you train. What SWE-bench's
//! harness does with the gold predictions, for a run spec's tasks: every task's
//! environment is built, its reference solution must resolve it and an empty patch must
//! not — graded by the same code that will grade the policy (the image builder's
//! builder, the sandbox service, the reward service's grader, all in this process:
//! [`harness`]). Tasks are checked `--jobs` at a time; the report is a table or JSON
//! lines ([`report`]), and the exit status is 1 when any task is bad.
//!
//! - [`plan`]: the spec's tasks as the dataset service would register them, with their
//!   reference solutions (kept out of the manifest);
//! - [`check`]: one task's build and gradings; [`solution`]: a Harbor solution run as
//!   Harbor's oracle runs it.

mod check;
mod harness;
mod plan;
mod report;
mod solution;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use arl_schemas::dataset::InvalidRow;
use arl_schemas::events::TaskKind;
use futures::StreamExt;

use crate::cli::ValidateArgs;
use crate::run::{CliError, load_spec};
use harness::{Harness, HarnessConfig};
use plan::Plan;
use report::{Summary, TaskOutcome};

/// Exit status when interrupted (128 + SIGINT, as shells report it).
const INTERRUPTED: u8 = 130;

pub async fn execute(args: ValidateArgs) -> Result<ExitCode, CliError> {
    let started = Instant::now();
    // The spec as `arl run submit` reads it; whether this machine has the model is no
    // concern of the data's.
    let spec = load_spec(Some(&args.spec), &args.overrides, false, false)?.spec;
    let plan = plan::load(&spec.data)?;
    let jobs = args.jobs.unwrap_or_else(cores).max(1);
    eprintln!(
        "validating {} of {} ({} at a time)",
        report::tasks(plan.tasks.len()),
        plan.dataset.display(),
        jobs
    );
    let harness = if plan.needs_environments() {
        let config = harness_config(&args, &plan);
        eprintln!("environments in {}", config.environments.display());
        Some(Harness::start(config).await?)
    } else {
        None
    };
    let checked = interruptible(check_all(harness.as_ref(), &plan, jobs)).await;
    if let Some(harness) = harness {
        harness.stop().await;
    }
    let Some(mut outcomes) = checked else {
        eprintln!("interrupted");
        return Ok(ExitCode::from(INTERRUPTED));
    };
    outcomes.extend(
        plan.invalid_rows
            .iter()
            .map(|row| invalid_row(row, plan.kind)),
    );
    let summary = Summary::of(&outcomes, started.elapsed().as_secs_f64());
    if args.json {
        print!("{}", report::json_lines(&outcomes, &summary));
    } else {
        print!("{}", report::table(&outcomes, &summary));
    }
    Ok(if summary.bad.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

fn harness_config(args: &ValidateArgs, plan: &Plan) -> HarnessConfig {
    HarnessConfig {
        dataset: plan.dataset.clone(),
        environments: args
            .environments_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("arl-environments")),
        swebench_recipes: args.swebench_recipes.clone(),
        swebench_repos: args.swebench_repos.clone(),
        pyenv_root: args.pyenv_root.clone(),
        pip_cache: args.pip_cache.clone(),
        build_timeout: Duration::from_secs(args.build_timeout_s),
        test_timeout: Duration::from_secs(args.test_timeout_s),
    }
}

/// Every task's outcome, in the dataset's order, `jobs` checked at once; each is
/// announced on stderr as it ends (a cold SWE-bench validation takes minutes).
async fn check_all(harness: Option<&Harness>, plan: &Plan, jobs: usize) -> Vec<TaskOutcome> {
    let total = plan.tasks.len();
    let mut done = 0;
    let mut outcomes: Vec<(usize, TaskOutcome)> = futures::stream::iter(plan.tasks.iter())
        .enumerate()
        .map(|(index, task)| async move { (index, check::check(harness, task).await) })
        .buffer_unordered(jobs)
        .inspect(|(_, outcome)| {
            done += 1;
            eprintln!("[{done}/{total}] {}", progress(outcome));
        })
        .collect()
        .await;
    outcomes.sort_by_key(|(index, _)| *index);
    outcomes.into_iter().map(|(_, outcome)| outcome).collect()
}

fn progress(outcome: &TaskOutcome) -> String {
    let problems = outcome.problems();
    let verdict = if problems.is_empty() {
        "valid".to_owned()
    } else {
        format!("BAD: {}", problems.join("; "))
    };
    let verdict = verdict.lines().next().unwrap_or_default().to_owned();
    match outcome.build_seconds {
        Some(seconds) => format!("{} {verdict} (environment {seconds:.1} s)", outcome.task_id),
        None => format!("{} {verdict}", outcome.task_id),
    }
}

/// A row that did not load is a bad task of its own, named by where it is.
fn invalid_row(row: &InvalidRow, kind: TaskKind) -> TaskOutcome {
    TaskOutcome {
        error: Some(format!(
            "the row did not load: field {}: {}",
            row.field, row.reason
        )),
        ..TaskOutcome::new(format!("{}:{}", row.file, row.row), kind)
    }
}

/// `work`'s result, or None when SIGINT or SIGTERM came first (`work` is then dropped:
/// its builds and sandboxed commands are killed with it).
async fn interruptible<T>(work: impl std::future::Future<Output = T>) -> Option<T> {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        result = work => Some(result),
        _ = tokio::signal::ctrl_c() => None,
        _ = terminate => None,
    }
}
