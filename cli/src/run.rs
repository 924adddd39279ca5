//! `arl run …`: submit a spec, read and follow a run's state from the controller's bucket.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use arl_runtime::args::default_model_dir;
use arl_runtime::bus::BusConfig;
use arl_runtime::{Bus, Metrics};
use arl_schemas::events::{RunCancelRequestedV1, RunRequestedV1};
use arl_schemas::spec::{ResumeFrom, RunSpec};
use arl_schemas::spec_layers::{self, Layered, Override};
use arl_schemas::state::{RunStateV1, RunStatus};
use arl_schemas::verl::IgnoredKey;
use arl_schemas::{Bucket, FieldError, Namespace, RunId};
use async_nats::jetstream::kv;
use futures::StreamExt;

use crate::cli::{BusArgs, RunCommand};
use crate::epochs::{self, StepsFromEpochs};

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{path}: invalid run spec:\n{}", list(errors))]
    InvalidSpec {
        path: String,
        errors: Vec<FieldError>,
    },
    #[error("cannot read {path}: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Bus(String),
    /// A part this command starts on this machine (a private nats-server, the sandbox)
    /// could not start (exit 3, like an unreachable bus).
    #[error("{0}")]
    Unavailable(String),
    #[error("no run {0} in this deployment; `arl run list` shows the runs there are")]
    NotFound(String),
    /// Something else asked for is not there (exit 4, like a missing run).
    #[error("{0}")]
    Missing(String),
    #[error("gave up waiting for run {0}")]
    TimedOut(String),
    /// The run already ended: there is nothing to cancel (exit 1).
    #[error("{0}")]
    Ended(String),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            CliError::InvalidSpec { .. } | CliError::Unreadable { .. } | CliError::Usage(_) => 2,
            CliError::Bus(_) | CliError::Unavailable(_) => 3,
            CliError::NotFound(_) | CliError::Missing(_) => 4,
            CliError::TimedOut(_) => 5,
            CliError::Ended(_) => 1,
        })
    }
}

impl From<arl_runtime::BusError> for CliError {
    fn from(err: arl_runtime::BusError) -> Self {
        CliError::Bus(err.to_string())
    }
}

fn list(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|e| format!("  - {e}"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub async fn execute(args: &BusArgs, command: RunCommand) -> Result<ExitCode, CliError> {
    match command {
        RunCommand::Submit {
            spec,
            overrides,
            strict,
            dry_run,
            skip_resource_check,
            wait,
        } => {
            let request = Submit {
                spec,
                overrides,
                strict,
                check_resources: !skip_resource_check,
                dry_run,
                wait,
            };
            submit(args, request).await
        }
        RunCommand::Cancel {
            run_id,
            reason,
            wait,
        } => cancel(args, &run_id, reason, wait).await,
        RunCommand::Resume {
            run_id,
            from,
            overrides,
            wait,
        } => resume(args, &run_id, from, &overrides, wait).await,
        RunCommand::Status { run_id, json } => status(args, &run_id, json).await,
        RunCommand::Watch { run_id, timeout_s } => watch(args, &run_id, timeout_s).await,
        RunCommand::List { json } => list_runs(args, json).await,
        RunCommand::Plot { run_id, out } => plot(args, &run_id, &out).await,
    }
}

async fn connect(args: &BusArgs) -> Result<Bus, CliError> {
    let namespace = Namespace::from_option(Some(args.prefix.as_str()))
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let mut config = BusConfig::new(&args.nats_url, namespace, "arl-cli");
    config.auth = args.nats.clone();
    config.wait_for_server = false;
    config.publish_timeout = Duration::from_secs(15);
    let bus = Bus::connect(config, Metrics::new()).await?;
    bus.check_server().await?;
    Ok(bus)
}

/// The spec to submit, with what the user should be told about how it was read.
#[derive(Debug)]
pub struct LoadedSpec {
    pub spec: RunSpec,
    /// VeRL keys left out as meaningless here.
    pub ignored: Vec<IgnoredKey>,
    /// How `trainer.total_steps` came from VeRL's `trainer.total_epochs`, when it did.
    pub steps_from_epochs: Option<StepsFromEpochs>,
}

/// Builds and checks the spec to submit: the file (if any), then the `--set` overrides.
/// Relative paths are resolved against the file's folder, or the current folder without a
/// file. VeRL keys left out as meaningless here are an error when `strict`; epochs without
/// steps are turned into steps over the dataset's training split (see [`crate::epochs`]).
pub fn load_spec(
    path: Option<&Path>,
    overrides: &[Override],
    strict: bool,
    check_resources: bool,
) -> Result<LoadedSpec, CliError> {
    let shown = path.map_or("--set".into(), |p| p.display().to_string());
    let invalid = |errors| CliError::InvalidSpec {
        path: shown.clone(),
        errors,
    };
    let document = match path {
        Some(path) => read_document(path)?,
        None => serde_json::Value::Object(Default::default()),
    };
    let Layered {
        mut spec,
        ignored,
        total_epochs,
    } = spec_layers::build(document, overrides).map_err(invalid)?;
    if strict && !ignored.is_empty() {
        let errors = ignored
            .iter()
            .map(|k| FieldError::new(&k.path, format!("means nothing in ARL ({})", k.why)))
            .collect();
        return Err(invalid(errors));
    }
    let base = path
        .and_then(Path::parent)
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let base = std::fs::canonicalize(base).unwrap_or_else(|_| base.to_path_buf());
    spec.resolve_relative_paths(&base);
    let resource_errors = |spec: &RunSpec| -> Vec<FieldError> {
        if !check_resources {
            return Vec::new();
        }
        arl_controller::resources::check(spec, &default_model_dir())
            .err()
            .unwrap_or_default()
    };
    // A zero batch counts no steps; the spec's check below says what is wrong with it.
    let steps_from_epochs = match total_epochs {
        Some(epochs) if spec.data.train_batch_size > 0 => {
            // Admission's question first: a dataset file that is not there is that, not a
            // missing step count.
            let missing = resource_errors(&spec);
            if !missing.is_empty() {
                return Err(invalid(missing));
            }
            let derived = epochs::derive(&spec, epochs).map_err(|e| invalid(vec![e]))?;
            spec.trainer.total_steps = derived.steps;
            Some(derived)
        }
        _ => None,
    };
    let mut errors = spec.check();
    if errors.is_empty() && steps_from_epochs.is_none() {
        errors.extend(resource_errors(&spec));
    }
    if !errors.is_empty() {
        return Err(invalid(errors));
    }
    Ok(LoadedSpec {
        spec,
        ignored,
        steps_from_epochs,
    })
}

/// A spec file's keys as a document: JSON by its extension, TOML otherwise.
fn read_document(path: &Path) -> Result<serde_json::Value, CliError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|err| CliError::Unreadable {
        path: shown.clone(),
        reason: err.to_string(),
    })?;
    let parsed = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text)
            .map_err(|err| FieldError::new("", format!("not valid JSON: {err}")))
    } else {
        spec_layers::toml_document(&text)
    };
    parsed.map_err(|error| CliError::InvalidSpec {
        path: shown,
        errors: vec![error],
    })
}

async fn submit(args: &BusArgs, submit: Submit) -> Result<ExitCode, CliError> {
    let LoadedSpec {
        spec,
        ignored,
        steps_from_epochs,
    } = load_spec(
        submit.spec.as_deref(),
        &submit.overrides,
        submit.strict,
        submit.check_resources,
    )?;
    if let Some(derived) = &steps_from_epochs {
        eprintln!("{derived}");
    }
    if !ignored.is_empty() {
        eprintln!(
            "warning: these VeRL keys mean nothing in ARL and were left out (--strict refuses them):\n{}",
            ignored
                .iter()
                .map(|k| format!("  - {k}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    if submit.dry_run {
        println!(
            "{}",
            serde_json::to_string_pretty(&spec).unwrap_or_default()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let bus = connect(args).await?;
    // Idempotent; lets a first submit work before any service has started.
    bus.provision().await?;
    let request = RunRequestedV1 {
        run_id: RunId::generate(),
        spec,
        submitted_at: chrono::Utc::now(),
        submitted_by: submitter(),
    };
    request_run(&bus, request, submit.wait).await
}

/// Publishes the request and, with `wait`, follows it until the controller decides;
/// exits 1 if it was rejected.
async fn request_run(bus: &Bus, request: RunRequestedV1, wait: bool) -> Result<ExitCode, CliError> {
    bus.publish(&request).await?;
    println!("{}", request.run_id);
    if !wait {
        return Ok(ExitCode::SUCCESS);
    }
    // The controller writes the state only once it has decided.
    let state = follow(bus, &request.run_id, Duration::from_secs(120), |_| true).await?;
    eprintln!("{}", render_status(&state));
    Ok(if state.status == RunStatus::Rejected {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

async fn cancel(
    args: &BusArgs,
    run_id: &str,
    reason: String,
    wait: bool,
) -> Result<ExitCode, CliError> {
    let run_id = parse_run_id(run_id)?;
    let bus = connect(args).await?;
    let state = read_state(&bus, &run_id)
        .await?
        .ok_or_else(|| CliError::NotFound(run_id.to_string()))?;
    if state.status.is_terminal() {
        return Err(CliError::Ended(format!(
            "run {run_id} already ended ({}); there is nothing to cancel",
            state.status.as_str()
        )));
    }
    bus.publish(&RunCancelRequestedV1 {
        run_id: run_id.clone(),
        requested_at: chrono::Utc::now(),
        requested_by: submitter(),
        reason,
    })
    .await?;
    eprintln!("cancel requested for run {run_id}");
    if !wait {
        return Ok(ExitCode::SUCCESS);
    }
    let state = follow(&bus, &run_id, Duration::from_secs(120), |s| {
        s.status.is_terminal()
    })
    .await?;
    eprintln!("{}", render_status(&state));
    Ok(if state.status == RunStatus::Cancelled {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn resume(
    args: &BusArgs,
    run_id: &str,
    from: u32,
    overrides: &[Override],
    wait: bool,
) -> Result<ExitCode, CliError> {
    let source_id = parse_run_id(run_id)?;
    let bus = connect(args).await?;
    let source = read_state(&bus, &source_id)
        .await?
        .ok_or_else(|| CliError::NotFound(source_id.to_string()))?;
    let spec = resumed_spec(&source, from, overrides)?;
    let request = RunRequestedV1 {
        run_id: RunId::generate(),
        spec,
        submitted_at: chrono::Utc::now(),
        submitted_by: submitter(),
    };
    eprintln!("resuming run {source_id} from step-{from} as a new run");
    request_run(&bus, request, wait).await
}

/// The spec of a run resumed from `source`'s checkpoint after step `from`: the source's
/// spec, then `overrides`, then `trainer.resume_from`. Refused when `from` is not a
/// checkpoint the source saved.
fn resumed_spec(
    source: &RunStateV1,
    from: u32,
    overrides: &[Override],
) -> Result<RunSpec, CliError> {
    let run_id = &source.run_id;
    let spec = source.spec.as_ref().ok_or_else(|| {
        CliError::Missing(format!(
            "run {run_id} has no spec (its request could not be read), so it cannot be resumed"
        ))
    })?;
    let saved_every = spec.trainer.save_every.max(1);
    let is_checkpoint = from.is_multiple_of(saved_every) || from == spec.trainer.total_steps;
    if from > source.step || !is_checkpoint {
        let checkpoints: Vec<String> = (1..=source.step)
            .filter(|s| s.is_multiple_of(saved_every) || *s == spec.trainer.total_steps)
            .map(|s| format!("step-{s}"))
            .collect();
        return Err(CliError::Usage(format!(
            "run {run_id} has no checkpoint step-{from}: it committed {} steps and saves one              every {saved_every} (trainer.save_every); its checkpoints: {}",
            source.step,
            if checkpoints.is_empty() {
                "none".to_owned()
            } else {
                checkpoints.join(", ")
            }
        )));
    }
    let document = serde_json::to_value(spec).map_err(|e| CliError::Usage(e.to_string()))?;
    let invalid = |errors| CliError::InvalidSpec {
        path: format!("run {run_id}'s spec"),
        errors,
    };
    let Layered { mut spec, .. } = spec_layers::build(document, overrides).map_err(invalid)?;
    spec.trainer.resume_from = Some(ResumeFrom {
        run_id: run_id.clone(),
        step: from,
    });
    let errors = spec.check();
    if !errors.is_empty() {
        return Err(invalid(errors));
    }
    Ok(spec)
}

/// What `arl run submit` was asked, past the bus arguments.
struct Submit {
    spec: Option<PathBuf>,
    overrides: Vec<Override>,
    strict: bool,
    check_resources: bool,
    dry_run: bool,
    wait: bool,
}

fn submitter() -> String {
    let user = ["USER", "LOGNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .or_else(|| {
            let output = std::process::Command::new("id").arg("-un").output().ok()?;
            Some(String::from_utf8_lossy(&output.stdout).trim().to_owned())
                .filter(|u| !u.is_empty())
        })
        .unwrap_or_else(|| "unknown".into());
    let host = arl_runtime::host::host_name();
    format!("{user}@{host}")
}

fn parse_run_id(run_id: &str) -> Result<RunId, CliError> {
    RunId::new(run_id).map_err(|e| CliError::Usage(e.to_string()))
}

async fn read_state(bus: &Bus, run_id: &RunId) -> Result<Option<RunStateV1>, CliError> {
    let store = bus.bucket(Bucket::RunState).await?;
    let bytes = store
        .get(run_id.as_str())
        .await
        .map_err(|e| CliError::Bus(format!("reading run {run_id}: {e}")))?;
    bytes
        .map(|b| RunStateV1::decode(&b))
        .transpose()
        .map_err(|e| CliError::Bus(format!("the state of run {run_id} is unreadable: {e}")))
}

async fn status(args: &BusArgs, run_id: &str, json: bool) -> Result<ExitCode, CliError> {
    let run_id = parse_run_id(run_id)?;
    let bus = connect(args).await?;
    let state = read_state(&bus, &run_id)
        .await?
        .ok_or_else(|| CliError::NotFound(run_id.to_string()))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&state).unwrap_or_default()
        );
    } else {
        println!("{}", render_status(&state));
    }
    Ok(exit_for(&state))
}

fn exit_for(state: &RunStateV1) -> ExitCode {
    match state.status {
        RunStatus::Rejected | RunStatus::Failed | RunStatus::Cancelled => ExitCode::from(1),
        _ => ExitCode::SUCCESS,
    }
}

/// Waits on the run's key until `done` holds, or `limit` passes. A watch the server drops
/// (a missed heartbeat on a busy machine, a server restart) is opened again — it starts
/// from the key's latest value, so nothing is missed; only a watch that cannot be opened
/// again within a few tries is an error.
async fn follow(
    bus: &Bus,
    run_id: &RunId,
    limit: Duration,
    mut on_update: impl FnMut(&RunStateV1) -> bool,
) -> Result<RunStateV1, CliError> {
    const REOPEN_TRIES: u32 = 5;
    let store = bus.bucket(Bucket::RunState).await?;
    let deadline = (!limit.is_zero()).then(|| tokio::time::Instant::now() + limit);
    let mut failed_opens = 0;
    loop {
        let mut updates = match store.watch_with_history(run_id.as_str()).await {
            Ok(updates) => updates,
            Err(e) if failed_opens + 1 < REOPEN_TRIES => {
                failed_opens += 1;
                eprintln!("watching run {run_id}: {e}; trying again");
                tokio::time::sleep(Duration::from_secs(u64::from(failed_opens))).await;
                continue;
            }
            Err(e) => return Err(CliError::Bus(format!("watching run {run_id}: {e}"))),
        };
        loop {
            let next = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, updates.next())
                    .await
                    .map_err(|_| CliError::TimedOut(run_id.to_string()))?,
                None => updates.next().await,
            };
            let entry = match next {
                Some(Ok(entry)) => entry,
                Some(Err(err)) => {
                    eprintln!("watching run {run_id}: {err}; watching again");
                    break;
                }
                None => break,
            };
            failed_opens = 0;
            if entry.operation != kv::Operation::Put {
                continue;
            }
            let state = RunStateV1::decode(&entry.value).map_err(|e| {
                CliError::Bus(format!("the state of run {run_id} is unreadable: {e}"))
            })?;
            if on_update(&state) {
                return Ok(state);
            }
        }
    }
}

async fn watch(args: &BusArgs, run_id: &str, timeout_s: u64) -> Result<ExitCode, CliError> {
    let run_id = parse_run_id(run_id)?;
    let bus = connect(args).await?;
    let interactive = std::io::stderr().is_terminal();
    let bar = indicatif::ProgressBar::new(100);
    if interactive {
        bar.set_style(
            indicatif::ProgressStyle::with_template("{prefix} [{bar:40}] {pos:>3}% {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(run_id.to_string());
        bar.set_message("waiting for the controller");
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut log = ProgressLog::default();
    let state = follow(&bus, &run_id, Duration::from_secs(timeout_s), |state| {
        let line = progress_line(state);
        bar.set_position(u64::from(state.percent().round() as u8));
        bar.set_message(line.clone());
        if !interactive && log.should_print(state, Instant::now()) {
            eprintln!("{:>3}% {line}", state.percent().round());
        }
        state.status.is_terminal()
    })
    .await;
    bar.finish_and_clear();
    let state = state?;
    println!("{}", render_status(&state));
    Ok(exit_for(&state))
}

/// `arl run watch` without a terminal (a log file, CI): a line per state change would be a
/// line per finished trial (11,540 for a 40-step GPU run), so a line is printed when the
/// run's status, phase, step, failures or evaluations change, and otherwise (trials
/// finishing) at most every [`ProgressLog::EVERY`].
#[derive(Default)]
struct ProgressLog {
    last: Option<(String, Instant)>,
}

impl ProgressLog {
    const EVERY: Duration = Duration::from_secs(10);

    fn should_print(&mut self, state: &RunStateV1, now: Instant) -> bool {
        let milestone = format!(
            "{} {:?} {} {} {}",
            state.status.as_str(),
            state.phase,
            state.step,
            state.failures.total(),
            state.evaluations.len()
        );
        let print = match &self.last {
            None => true,
            Some((last, at)) => *last != milestone || now.duration_since(*at) >= Self::EVERY,
        };
        if print {
            self.last = Some((milestone, now));
        }
        print
    }
}

fn progress_line(state: &RunStateV1) -> String {
    let phase = serde_json::to_value(state.phase)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let mut line = format!(
        "{} ({phase}) step {}/{} · trials {} finished, {} failed",
        state.status.as_str(),
        state.step,
        state.total_steps,
        state.trials_finished,
        state.failures.total()
    );
    let idle = state.steps.iter().filter(|s| s.trained_nothing()).count();
    if idle > 0 {
        line.push_str(&format!(" · {idle} step(s) trained nothing"));
    }
    // Where the run started and where it is: the first and the latest evaluation.
    let rate = |e: &arl_schemas::state::EvaluationSummary| {
        format!("{:.0}% at step {}", e.resolution_rate * 100.0, e.step)
    };
    match (state.evaluations.first(), state.evaluations.last()) {
        (Some(first), Some(last)) if first.step != last.step => {
            line.push_str(&format!(" · validation {} → {}", rate(first), rate(last)));
        }
        (Some(only), _) => line.push_str(&format!(" · validation {}", rate(only))),
        _ => {}
    }
    line
}

async fn list_runs(args: &BusArgs, json: bool) -> Result<ExitCode, CliError> {
    let bus = connect(args).await?;
    let mut states = Vec::new();
    for run_id in bus.run_ids().await? {
        if let Some(state) = read_state(&bus, &run_id).await? {
            states.push(state);
        }
    }
    states.sort_by_key(|s| s.submitted_at);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&states).unwrap_or_default()
        );
        return Ok(ExitCode::SUCCESS);
    }
    if states.is_empty() {
        println!("no runs yet; submit one with `arl run submit SPEC`");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<38} {:<10} {:>7} {:<20} SUBMITTED",
        "RUN", "STATUS", "STEP", "NAME"
    );
    for s in &states {
        println!(
            "{:<38} {:<10} {:>7} {:<20} {}",
            s.run_id,
            s.status.as_str(),
            format!("{}/{}", s.step, s.total_steps),
            s.name,
            s.submitted_at.format("%Y-%m-%d %H:%M:%S")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The human view of a run's state.
pub fn render_status(state: &RunStateV1) -> String {
    let mut out = vec![
        format!("run         {}", state.run_id),
        format!("name        {}", state.name),
        format!("status      {}", progress_line(state)),
        format!("progress    {:.0}%", state.percent()),
        format!(
            "submitted   {} by {}",
            state.submitted_at.format("%Y-%m-%d %H:%M:%S UTC"),
            state.submitted_by
        ),
    ];
    if let Some(from) = state
        .spec
        .as_ref()
        .and_then(|s| s.trainer.resume_from.as_ref())
    {
        out.push(format!(
            "resumed     from run {} step-{}",
            from.run_id, from.step
        ));
    }
    if let Some(model) = &state.model_path {
        out.push(format!("model       {model}"));
    }
    if let Some(dataset) = &state.dataset_path {
        out.push(format!("dataset     {dataset}"));
    }
    if let Some(digest) = &state.dataset_digest {
        out.push(format!("registered  {digest}"));
    }
    if let Some(uri) = &state.checkpoint_uri {
        out.push(format!("checkpoint  {uri}"));
    }
    if let Some(reason) = &state.failure_reason {
        let label = if state.status == RunStatus::Cancelled {
            "cancelled  "
        } else {
            "failure    "
        };
        out.push(format!("{label} {reason}"));
    }
    if !state.errors.is_empty() {
        out.push("errors:".into());
        out.extend(state.errors.iter().map(|e| format!("  - {e}")));
    }
    if state.failures.total() > 0 {
        let f = &state.failures;
        out.push(format!(
            "failures    infrastructure {} · agent_error {} · timeout {} · context_overflow {} · grading_error {}",
            f.infrastructure, f.agent_error, f.timeout, f.context_overflow, f.grading_error
        ));
    }
    if !state.steps.is_empty() {
        // Tool calls only where a step made any (tool-using agents over MCP).
        let tools = state
            .steps
            .iter()
            .any(|s| s.tool_calls_mean.is_some_and(|t| t > 0.0));
        out.push(format!(
            "steps:       step  policy  reward_mean   pg_loss  grad_norm  seconds  samples trained  zero-adv groups{}",
            if tools { "  tool calls" } else { "" }
        ));
        for s in &state.steps {
            let note = if s.trained_nothing() {
                "  nothing trained"
            } else {
                ""
            };
            let (trained, flat) = match &s.batch {
                Some(b) => (
                    format!("{}/{}", b.samples_trained, b.trajectories),
                    format!("{}/{}", b.zero_advantage_groups, b.groups),
                ),
                None => ("-".into(), "-".into()),
            };
            let tool_calls = match (tools, s.tool_calls_mean) {
                (false, _) => String::new(),
                (true, Some(t)) => format!("  {t:>10.2}"),
                (true, None) => format!("  {:>10}", "-"),
            };
            out.push(format!(
                "             {:>4}  {:>6}  {:>11.4}  {:>8.4}  {:>9.4}  {:>7.1}  {trained:>15}  {flat:>15}{tool_calls}{note}",
                s.step, s.policy_version, s.reward_mean, s.pg_loss, s.grad_norm, s.seconds
            ));
        }
        let idle: Vec<String> = state
            .steps
            .iter()
            .filter(|s| s.trained_nothing())
            .map(|s| s.step.to_string())
            .collect();
        let unproven: u64 = state
            .steps
            .iter()
            .filter_map(|s| s.batch.as_ref())
            .map(|b| u64::from(b.unproven_tokens))
            .sum();
        if unproven > 0 {
            out.push(format!(
                "warning:    {unproven} completion tokens were not trained on: their serving policy \
                 version is not known (a vLLM or SGLang behind the proxy without \
                 --follow-weights, or a call across a weight update) or they carry no logprobs"
            ));
        }
        if !idle.is_empty() {
            out.push(format!(
                "warning:    {} of {} steps trained nothing (step {}): every group's trials got \
                 the same reward (no advantage to learn from) or no trial gave a sample; the \
                 policy did not change there",
                idle.len(),
                state.steps.len(),
                idle.join(", ")
            ));
        }
    }
    if !state.evaluations.is_empty() {
        out.push("evaluations: step  resolved  95% CI            pass@k".into());
        for e in &state.evaluations {
            let pass: Vec<_> = e
                .pass_at_k
                .iter()
                .map(|(k, v)| format!("@{k}={v:.3}"))
                .collect();
            out.push(format!(
                "             {:>4}  {:>7.1}%  [{:>5.1}%, {:>5.1}%]  {}",
                e.step,
                e.resolution_rate * 100.0,
                e.ci95_low * 100.0,
                e.ci95_high * 100.0,
                pass.join(" ")
            ));
        }
    }
    out.join("\n")
}

async fn plot(args: &BusArgs, run_id: &str, out: &std::path::Path) -> Result<ExitCode, CliError> {
    let run_id = parse_run_id(run_id)?;
    let bus = connect(args).await?;
    let state = read_state(&bus, &run_id)
        .await?
        .ok_or_else(|| CliError::NotFound(run_id.to_string()))?;
    std::fs::write(out, reward_curve_svg(&state))
        .map_err(|e| CliError::Usage(format!("writing {}: {e}", out.display())))?;
    println!("{}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// An SVG line chart: mean training reward per step (blue) and the validation resolution
/// rate at each evaluation (orange, with its 95% interval; step 0 is the evaluation before
/// training), on labelled axes with ticks, gridlines and a legend.
pub fn reward_curve_svg(state: &RunStateV1) -> String {
    let (width, height) = (720.0_f64, 400.0_f64);
    let (left, right, top_margin, bottom) = (64.0_f64, 24.0_f64, 64.0_f64, 56.0_f64);
    let last_step = state
        .steps
        .iter()
        .map(|s| s.step)
        .chain(state.evaluations.iter().map(|e| e.step))
        .max()
        .unwrap_or(1)
        .max(1);
    // The y axis runs to 1 (a rate) or to the largest reward with bonuses, rounded up.
    let top = state
        .steps
        .iter()
        .map(|s| s.reward_mean)
        .chain(state.evaluations.iter().map(|e| e.ci95_high))
        .fold(1.0_f64, f64::max);
    let top = (top * 4.0).ceil() / 4.0;
    let (plot_w, plot_h) = (width - left - right, height - top_margin - bottom);
    let x = |step: u32| left + plot_w * f64::from(step) / f64::from(last_step);
    let y = |v: f64| top_margin + plot_h * (1.0 - (v / top).clamp(0.0, 1.0));
    let baseline = top_margin + plot_h;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"22\" font-size=\"15\">{}</text>\n",
        escape(&state.name),
    );
    // y ticks and gridlines: five steps of the scale.
    for i in 0..=4 {
        let value = top * f64::from(i) / 4.0;
        let ty = y(value);
        svg.push_str(&format!(
            "<line x1=\"{left}\" y1=\"{ty:.1}\" x2=\"{:.1}\" y2=\"{ty:.1}\" stroke=\"#e0e0e0\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{value:.2}</text>\n",
            width - right,
            left - 6.0,
            ty + 4.0
        ));
    }
    // x ticks: every step, or every k-th so that at most ten are labelled.
    let every = last_step.div_ceil(10).max(1);
    for step in (0..=last_step).filter(|s| s % every == 0 || *s == last_step) {
        let tx = x(step);
        svg.push_str(&format!(
            "<line x1=\"{tx:.1}\" y1=\"{baseline:.1}\" x2=\"{tx:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\n\
             <text x=\"{tx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{step}</text>\n",
            baseline + 5.0,
            baseline + 18.0
        ));
    }
    svg.push_str(&format!(
        "<line x1=\"{left}\" y1=\"{baseline:.1}\" x2=\"{:.1}\" y2=\"{baseline:.1}\" stroke=\"black\"/>\n\
         <line x1=\"{left}\" y1=\"{top_margin}\" x2=\"{left}\" y2=\"{baseline:.1}\" stroke=\"black\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">training step (0 = before training)</text>\n\
         <text x=\"16\" y=\"{:.1}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {:.1})\">reward / resolution rate</text>\n",
        width - right,
        left + plot_w / 2.0,
        height - 12.0,
        top_margin + plot_h / 2.0,
        top_margin + plot_h / 2.0,
    ));
    // Legend.
    svg.push_str(&format!(
        "<line x1=\"{left}\" y1=\"42\" x2=\"{:.1}\" y2=\"42\" stroke=\"#1f77b4\" stroke-width=\"2\"/>\n\
         <text x=\"{:.1}\" y=\"46\">mean training reward per step</text>\n\
         <line x1=\"{:.1}\" y1=\"42\" x2=\"{:.1}\" y2=\"42\" stroke=\"#ff7f0e\" stroke-width=\"2\"/>\n\
         <text x=\"{:.1}\" y=\"46\">validation resolution rate (95% interval)</text>\n",
        left + 24.0,
        left + 30.0,
        left + 260.0,
        left + 284.0,
        left + 290.0,
    ));
    let line = |points: Vec<String>, color: &str| {
        if points.is_empty() {
            String::new()
        } else {
            format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
                points.join(" ")
            )
        }
    };
    svg.push_str(&line(
        state
            .steps
            .iter()
            .map(|s| format!("{:.1},{:.1}", x(s.step), y(s.reward_mean)))
            .collect(),
        "#1f77b4",
    ));
    for s in &state.steps {
        svg.push_str(&format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"#1f77b4\"><title>step {}: reward {:.3}</title></circle>\n",
            x(s.step),
            y(s.reward_mean),
            s.step,
            s.reward_mean
        ));
    }
    svg.push_str(&line(
        state
            .evaluations
            .iter()
            .map(|e| format!("{:.1},{:.1}", x(e.step), y(e.resolution_rate)))
            .collect(),
        "#ff7f0e",
    ));
    for e in &state.evaluations {
        svg.push_str(&format!(
            "<line x1=\"{cx:.1}\" y1=\"{:.1}\" x2=\"{cx:.1}\" y2=\"{:.1}\" stroke=\"#ff7f0e\"/>\n\
             <circle cx=\"{cx:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"#ff7f0e\"><title>step {}: resolved {:.1}%</title></circle>\n",
            y(e.ci95_low),
            y(e.ci95_high),
            y(e.resolution_rate),
            e.step,
            e.resolution_rate * 100.0,
            cx = x(e.step),
        ));
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a terminal, trials finishing print a line at most every 10 s; a new step
    /// or evaluation prints at once.
    #[test]
    fn the_progress_log_prints_milestones_at_once_and_trial_counts_every_10_s() {
        let mut log = ProgressLog::default();
        let mut state = state();
        let t0 = Instant::now();
        assert!(log.should_print(&state, t0), "the first state");
        state.trials_finished += 1;
        assert!(!log.should_print(&state, t0 + Duration::from_secs(1)));
        state.trials_finished += 1;
        assert!(log.should_print(&state, t0 + Duration::from_secs(11)));
        state.step += 1;
        assert!(
            log.should_print(&state, t0 + Duration::from_secs(12)),
            "a new step"
        );
        state.trials_finished += 1;
        assert!(!log.should_print(&state, t0 + Duration::from_secs(13)));
        state.evaluations.push(state.evaluations[0].clone());
        assert!(
            log.should_print(&state, t0 + Duration::from_secs(14)),
            "an evaluation"
        );
    }

    fn state() -> RunStateV1 {
        let step = |step: u32, reward: f64| {
            serde_json::json!({"step": step, "policy_version": step, "reward_mean": reward,
                               "pg_loss": 0.0, "grad_norm": 1.0, "seconds": 1.0})
        };
        let eval = |step: u32, rate: f64| {
            serde_json::json!({"step": step, "resolution_rate": rate, "ci95_low": rate / 2.0,
                               "ci95_high": (rate * 1.5).min(1.0), "pass_at_k": {}})
        };
        serde_json::from_value(serde_json::json!({
            "run_id": "run-plot", "name": "plot <test>", "status": "completed", "phase": "finishing",
            "submitted_by": "t", "submitted_at": "2026-12-01T00:00:00Z",
            "updated_at": "2026-12-01T00:00:00Z", "total_steps": 3, "step": 3,
            "policy_version": 3, "trials_finished": 0,
            "failures": {"infrastructure": 0, "agent_error": 0, "timeout": 0,
                         "context_overflow": 0, "grading_error": 0},
            "progress_sequence": 0,
            "steps": [step(1, 0.1), step(2, 0.3), step(3, 0.6)],
            "evaluations": [eval(0, 0.1), eval(3, 0.5)],
        }))
        .unwrap()
    }

    #[test]
    fn steps_that_trained_nothing_are_called_out() {
        let mut idle = state();
        idle.steps[1].grad_norm = 0.0;
        let status = render_status(&idle);
        assert!(status.contains("nothing trained"), "{status}");
        assert!(
            status.contains("warning:    1 of 3 steps trained nothing (step 2)"),
            "{status}"
        );
        assert!(progress_line(&idle).contains("1 step(s) trained nothing"));
        assert!(!render_status(&state()).contains("warning"));

        // With batch counts, samples trained decide (not the gradient norm).
        let mut counted = state();
        counted.steps[2].batch = Some(arl_schemas::events::BatchCounts {
            trajectories: 8,
            masked: 0,
            stale: 0,
            groups: 2,
            zero_advantage_groups: 2,
            samples_trained: 0,
            unproven_tokens: 0,
        });
        assert!(!render_status(&counted).contains("completion tokens were not trained on"));
        let mut unproven = counted.clone();
        if let Some(batch) = unproven.steps[2].batch.as_mut() {
            batch.unproven_tokens = 37;
        }
        assert!(
            render_status(&unproven)
                .contains("warning:    37 completion tokens were not trained on"),
            "{}",
            render_status(&unproven)
        );
        let status = render_status(&counted);
        assert!(status.contains("0/8") && status.contains("2/2"), "{status}");
        assert!(
            status.contains("steps trained nothing (step 3)"),
            "{status}"
        );
    }

    #[test]
    fn tool_calls_per_trajectory_are_shown_once_a_step_made_any() {
        let plain = render_status(&state());
        assert!(!plain.contains("tool calls"), "{plain}");
        let mut tools = state();
        tools.steps[0].tool_calls_mean = Some(0.0);
        tools.steps[2].tool_calls_mean = Some(1.75);
        let status = render_status(&tools);
        assert!(status.contains("zero-adv groups  tool calls"), "{status}");
        let last_column: Vec<&str> = status
            .lines()
            .skip_while(|l| !l.starts_with("steps:"))
            .skip(1)
            .take(3)
            .filter_map(|l| l.split_whitespace().last())
            .collect();
        // Step 2 was recorded before the controller kept tool calls: "-", not a made-up 0.
        assert_eq!(last_column, ["0.00", "-", "1.75"], "{status}");
    }

    #[test]
    fn the_progress_line_shows_validation_before_and_after() {
        let line = progress_line(&state());
        assert!(
            line.contains("validation 10% at step 0 → 50% at step 3"),
            "{line}"
        );
    }

    #[test]
    fn the_reward_curve_has_axes_ticks_a_legend_and_before_and_after() {
        let svg = reward_curve_svg(&state());
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("plot &lt;test&gt;"), "the name is escaped");
        for label in [
            "training step (0 = before training)",
            "reward / resolution rate",
            "mean training reward per step",
            "validation resolution rate (95% interval)",
        ] {
            assert!(svg.contains(label), "{label}");
        }
        for tick in ["0.00", "0.50", "1.00"] {
            assert!(svg.contains(&format!(">{tick}</text>")), "y tick {tick}");
        }
        for step in 0..=3 {
            assert!(svg.contains(&format!(">{step}</text>")), "x tick {step}");
        }
        // One line for the training reward, one joining the evaluations before and after.
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("step 0: resolved 10.0%") && svg.contains("step 3: resolved 50.0%"));
    }
}
