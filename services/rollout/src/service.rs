//! The rollout service. `task.batch` fans out into one `trial.requested` per (task,
//! sample); replicas share a durable consumer on those, each running up to its
//! concurrency at once. A trial is a saga of durable hand-offs, never one long-held
//! handler:
//!
//! 1. here, on `trial.requested`: wait until the run's weights are fresh enough (a watch
//!    on the run's state) → lease a sandbox of the task's environment → issue a proxy
//!    key → run the agent within the turn limit and the wall-clock budget → `git diff` →
//!    release → revoke the key → `trial.finished` → record the hand-off in `ARL_TRIALS`
//!    and let the request go: grading (which can take an hour) holds no slot;
//! 2. in [`crate::join`], on the grade (`reward.scored`, or the grader's `trial.failed`):
//!    read the attempt's `llm.call` records by their subject and assemble them into
//!    `trajectory.ready` — on whichever replica takes the grade.
//!
//! Each failure has a class, and the run's policy for that class decides: retry (a new
//! request, next attempt, fresh sandbox), mask, fail the group, or score zero.
//!
//! Exactly once: the `ARL_TRIALS` bucket records each trial's attempt and phase. A
//! request for an attempt that is already done, or superseded, is acknowledged without
//! running; one found claimed but not done was held by a replica that died — it is failed
//! as `infrastructure` ("replica lost") and the policy applies; a grade for an attempt
//! that is done or superseded joins nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use arl_runtime::consumer::run_consumer;
use arl_runtime::rpc::RequestError;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_sandbox_client::{Lease, SandboxClient, SandboxError};
use arl_schemas::dataset::TaskRecord;
use arl_schemas::events::{
    FailureClass, LlmCallV2, SampleStatus, Split, TaskBatchV1, TaskKind, TrajectoryV1,
    TrialFailedV1, TrialFinishedV1, TrialRequestedV1, TrialSlot, TrialStartedV1,
};
use arl_schemas::rpc::{
    LeaseRequestV1, ProxyOp, RpcErrorCode, SandboxLimits, TrialKeyGrantV1, TrialKeyRequestV1,
    TrialKeyRevokeV1, TrialKeyRevokedV1,
};
use arl_schemas::spec::{ARL_MCP_SERVER, AgentKind, FailureAction, RunSpec};
use arl_schemas::state::DONE_TRIAL_RECORD_KEPT_SECONDS;
use arl_schemas::state::{FinishedAttemptV1, RunStatus, TrialRecordV2};
use arl_schemas::{Bucket, Domain, RunId, TrialId};

use crate::agent::{self, AgentContext, AgentOutcome};
use crate::llm::{LlmClient, Sampling, TrialError};
use crate::metrics::RolloutMetrics;
use crate::trajectory::{Assembled, assemble};

pub(crate) const SERVICE: &str = "rollout";

#[derive(Clone, Debug)]
pub struct RolloutConfig {
    /// Trials this replica runs at once.
    pub concurrency: usize,
    /// How long a trial waits for its environment to exist (the image builder may still
    /// be building it) and for fresh enough weights.
    pub wait_limit: Duration,
    /// How soon a trial held by a replica that stopped signalling comes back.
    pub ack_wait: Duration,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            concurrency: 8,
            wait_limit: Duration::from_secs(1800),
            ack_wait: Duration::from_secs(60),
        }
    }
}

#[derive(Clone)]
pub struct Rollout {
    pub(crate) bus: Bus,
    sandboxes: SandboxClient,
    llm: LlmClient,
    config: Arc<RolloutConfig>,
    pub(crate) metrics: RolloutMetrics,
}

/// The trial id of a slot: stable, so a retry keeps it.
pub fn trial_id(
    run: &RunId,
    slot: &TrialSlot,
    task_index: usize,
) -> Result<TrialId, arl_schemas::IdError> {
    let split = match slot.split {
        Split::Train => 's',
        Split::Validation => 'v',
    };
    TrialId::new(format!(
        "{run}-{split}{}-t{task_index}-k{}",
        slot.step, slot.sample_index
    ))
}

/// The id the proxy records an attempt's calls under: each attempt has its own record.
pub(crate) fn call_scope(trial: &TrialId, attempt: u32) -> Result<TrialId, arl_schemas::IdError> {
    if attempt == 0 {
        return Ok(trial.clone());
    }
    TrialId::new(format!("{trial}-a{attempt}"))
}

/// What a run is doing with one trial.
struct Trial {
    request: TrialRequestedV1,
    spec: RunSpec,
    task: TaskRecord,
    started: Instant,
    started_at: chrono::DateTime<chrono::Utc>,
}

/// The URLs of `rollout.mcp_servers`: `arl` is the trial's own sandbox tools, at the MCP
/// URL the proxy issued with the trial's key.
fn mcp_servers(listed: &[String], key: &TrialKeyGrantV1) -> Result<Vec<String>, TrialError> {
    listed
        .iter()
        .map(|server| match (server.as_str(), &key.mcp_url) {
            (ARL_MCP_SERVER, Some(url)) => Ok(url.clone()),
            (ARL_MCP_SERVER, None) => Err(TrialError::new(
                FailureClass::Infrastructure,
                "the token proxy issued no MCP URL with the trial's key: it is older than this \
                 rollout service (upgrade arl-proxy)",
            )),
            (url, _) => Ok(url.to_owned()),
        })
        .collect()
}

/// What the agent did besides its LLM calls, reported with the trajectory.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AgentCounts {
    /// Replies that broke the action protocol.
    pub parse_failures: u32,
    /// Tool calls made (MCP tools).
    pub tool_calls: u32,
}

/// The agent's part of a trial, done.
struct Ran {
    outcome: AgentOutcome,
    patch: String,
    /// Where the proxy stored the attempt's calls in the LLM stream, in the order stored.
    calls: Vec<u64>,
}

/// A failed agent's part: the error, and where the proxy stored its calls, when known
/// (their records become the masked or zero-scored trajectory).
type RunFailure = (TrialError, Option<Vec<u64>>);

impl Rollout {
    pub fn new(bus: Bus, config: RolloutConfig) -> Self {
        Self {
            sandboxes: SandboxClient::new(bus.clone()),
            llm: LlmClient::default(),
            metrics: RolloutMetrics::register(bus.metrics()),
            bus,
            config: Arc::new(config),
        }
    }

    pub fn start(&self, shutdown: &Shutdown) {
        let ns = self.bus.namespace();
        let batches = ConsumerSpec::for_event::<TaskBatchV1>(ns, SERVICE);
        let mut trials = ConsumerSpec::for_event::<TrialRequestedV1>(ns, SERVICE)
            .held(self.config.concurrency.max(1));
        // A replica that dies mid-trial stops the in-progress signal: the trial comes
        // back within a minute; the record tells the next replica what happened.
        trials.ack_wait = self.config.ack_wait;
        trials.max_deliver = 10;
        let this = Arc::new(self.clone());
        this.consume(shutdown, batches, |r, d| async move { r.on_batch(d).await });
        this.consume(shutdown, trials, |r, d| async move { r.on_trial(d).await });
        crate::join::start(&this, shutdown);
    }

    /// Runs `handler` on every delivery of `spec`, on a task shutdown waits for.
    pub(crate) fn consume<F, Fut>(
        self: &Arc<Self>,
        shutdown: &Shutdown,
        spec: ConsumerSpec,
        handler: F,
    ) where
        F: Fn(Arc<Rollout>, Delivery) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let this = self.clone();
        shutdown.spawn(run_consumer(
            self.bus.clone(),
            spec,
            move |delivery: Delivery| handler(this.clone(), delivery),
            shutdown.clone(),
        ));
    }

    async fn on_batch(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let batch: TaskBatchV1 = delivery.decode()?;
        for (index, task) in batch.tasks.iter().enumerate() {
            for sample_index in 0..batch.samples_per_task {
                let slot = TrialSlot {
                    task_id: task.task_id.clone(),
                    step: batch.step,
                    split: batch.split,
                    sample_index,
                    attempt: 0,
                };
                let trial_id =
                    trial_id(&batch.run_id, &slot, index).map_err(HandlerError::dead_letter)?;
                // One trace per trial: its request is published in a root span of its own,
                // linked to this batch; every hop of the trial (lease, agent, LLM calls,
                // grade, trajectory) continues that trace.
                let span = tracing::info_span!(
                    parent: None,
                    "trial",
                    openinference.span.kind = "AGENT",
                    run = %batch.run_id,
                    trial = %trial_id,
                    step = batch.step,
                    task = %task.task_id,
                    sample = sample_index,
                );
                arl_runtime::telemetry::link_to_current(&span);
                self.bus
                    .publish(&TrialRequestedV1 {
                        run_id: batch.run_id.clone(),
                        trial_id,
                        slot,
                        task: task.clone(),
                    })
                    .instrument(span)
                    .await?;
            }
        }
        Ok(())
    }

    async fn on_trial(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let request: TrialRequestedV1 = delivery.decode()?;
        let attempt = request.slot.attempt;
        // What the trial needs, read before it is claimed: if this fails, the request
        // simply comes back.
        let arl_runtime::RunContext { state, spec } = self.bus.run_context(&request.run_id).await?;
        let task = self.task(&request).await?;
        // Claim the attempt; learn whether a replica died holding it.
        let mut verdict = Claim::Run;
        self.bus
            .modify_record::<TrialRecordV2>(Bucket::Trials, request.trial_id.as_str(), |r| {
                verdict = match r {
                    // Done, superseded, or handed to grading (the join finishes it).
                    Some(r)
                        if r.attempt > attempt
                            || (r.attempt == attempt && (r.done || r.finished.is_some())) =>
                    {
                        Claim::Skip
                    }
                    Some(r) if r.attempt == attempt => Claim::Orphaned,
                    _ => Claim::Run,
                };
                if verdict == Claim::Run {
                    *r = Some(TrialRecordV2 {
                        attempt,
                        done: false,
                        finished: None,
                    });
                    return true;
                }
                false
            })
            .await?;
        if verdict == Claim::Skip {
            return Ok(());
        }
        if state.status.is_terminal() {
            tracing::info!(trial = %request.trial_id, "run is over; trial not run");
            return self.mark_done(&request).await;
        }
        let trial = Trial {
            request,
            spec,
            task,
            started: Instant::now(),
            started_at: chrono::Utc::now(),
        };
        if verdict == Claim::Orphaned {
            let error = TrialError::new(
                FailureClass::Infrastructure,
                "the rollout replica running this attempt was lost",
            );
            return self
                .fail(&trial.request, &trial.spec, error, None, true)
                .await;
        }
        match self.run(&trial).await {
            Ok(ran) => {
                let calls = ran.calls.clone();
                match self.hand_off(&trial, ran).await {
                    // A diff too large to be an event is the agent's doing: the trial
                    // fails with that class instead of its message dying undelivered.
                    Err(HandOffError::TooLarge(error)) => {
                        let error = TrialError::new(FailureClass::AgentError, error.to_string());
                        self.fail(&trial.request, &trial.spec, error, Some(calls), true)
                            .await
                    }
                    Err(HandOffError::Handler(error)) => Err(error),
                    Ok(()) => Ok(()),
                }
            }
            Err((error, calls)) => {
                if let Some(status) = self.run_ended_as(&trial.request.run_id).await {
                    return self.drop_for_ended_run(&trial.request, status, error).await;
                }
                self.fail(&trial.request, &trial.spec, error, calls, true)
                    .await
            }
        }
    }

    /// How the run ended, once it has (cancelled, failed, completed).
    async fn run_ended_as(&self, run: &arl_schemas::RunId) -> Option<RunStatus> {
        match self.bus.run_state(run).await {
            Ok(Some(state)) if state.status.is_terminal() => Some(state.status),
            _ => None,
        }
    }

    /// An attempt stopped because its run ended: nothing will train on it or retry it,
    /// yet it may have announced `trial.started`, so it still ends with an outcome — a
    /// `trial.failed` that says why — and every observer sees each attempt settle.
    async fn drop_for_ended_run(
        &self,
        request: &TrialRequestedV1,
        status: RunStatus,
        error: TrialError,
    ) -> Result<(), HandlerError> {
        tracing::info!(trial = %request.trial_id, message = %error.message, "run is over; trial dropped");
        self.bus
            .publish(&TrialFailedV1 {
                run_id: request.run_id.clone(),
                trial_id: request.trial_id.clone(),
                slot: request.slot.clone(),
                class: error.class,
                message: format!(
                    "the run ended ({}); the trial was stopped: {}",
                    status.as_str(),
                    error.message
                ),
                will_retry: false,
                failed_at: chrono::Utc::now(),
            })
            .await?;
        self.metrics.trial("dropped", Some(error.class));
        self.mark_done(request).await
    }

    /// The agent's part: everything up to the patch and the recorded calls.
    async fn run(&self, trial: &Trial) -> Result<Ran, RunFailure> {
        let req = &trial.request;
        let spec = &trial.spec;
        let version = self.wait_for_weights(trial).await.map_err(|e| (e, None))?;
        self.bus
            .publish(&TrialStartedV1 {
                run_id: req.run_id.clone(),
                trial_id: req.trial_id.clone(),
                slot: req.slot.clone(),
                policy_version: version,
                started_at: trial.started_at,
            })
            .await
            .map_err(|e| (infrastructure(e.to_string()), None))?;
        let lease = if req.task.kind == TaskKind::Math {
            None
        } else {
            Some(self.lease(trial).await.map_err(|e| (e, None))?)
        };
        let scope = call_scope(&req.trial_id, req.slot.attempt)
            .map_err(|e| (infrastructure(e.to_string()), None))?;
        let key = match self.issue_key(trial, &scope, version).await {
            Ok(key) => key,
            Err(error) => {
                if let Some(lease) = lease {
                    lease.release().await;
                }
                return Err((error, None));
            }
        };
        let deadline = trial.started + Duration::from_secs(u64::from(spec.rollout.timeout_s));
        let ctx = AgentContext {
            llm: &self.llm,
            base_url: &key.base_url,
            instruction: &trial.task.instruction,
            messages: trial.task.messages.as_deref(),
            sampling: Sampling {
                temperature: match trial.request.slot.split {
                    Split::Train => spec.rollout.temperature,
                    Split::Validation => spec.rollout.val_temperature,
                },
                top_p: spec.rollout.top_p,
                max_tokens: spec.rollout.max_response_tokens,
            },
            max_turns: spec.rollout.max_turns,
            max_observation_chars: spec.rollout.max_observation_chars as usize,
            deadline,
        };
        let budget = deadline.saturating_duration_since(Instant::now());
        let agent = tokio::select! {
            agent = tokio::time::timeout(
                budget,
                self.agent(&ctx, spec, lease.as_ref(), &key),
            ) => agent,
            // A cancelled (or failed) run's trials stop now and give their sandboxes back.
            () = self.run_ended(&req.run_id, budget) => Ok(Err(TrialError::new(
                FailureClass::Infrastructure,
                "the run ended while the trial ran",
            ))),
        };
        let outcome = match agent {
            Ok(result) => result,
            Err(_) => Err(TrialError::new(
                FailureClass::Timeout,
                format!(
                    "the trial ran past rollout.timeout_s = {} s",
                    spec.rollout.timeout_s
                ),
            )),
        };
        let patch = match (&outcome, &lease) {
            (Ok(_), Some(lease)) => lease.diff().await.map_err(TrialError::from_sandbox),
            _ => Ok(String::new()),
        };
        if let Some(lease) = lease {
            lease.release().await;
        }
        let calls = self.revoke_key(&key).await.map_err(|e| (e, None))?;
        let mut outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => return Err((error, Some(calls))),
        };
        // A turn is an LLM call, as the proxy recorded it (a command agent's own count
        // leaves out replies it rejected).
        outcome.turns = u32::try_from(calls.len()).unwrap_or(u32::MAX);
        let patch = match patch {
            Ok(patch) => patch,
            Err(error) => return Err((error, Some(calls))),
        };
        // A math agent's output is its answer; a code agent's is the sandbox's diff.
        let patch = outcome.answer.take().unwrap_or(patch);
        Ok(Ran {
            outcome,
            patch,
            calls,
        })
    }

    async fn agent(
        &self,
        ctx: &AgentContext<'_>,
        spec: &RunSpec,
        lease: Option<&Lease>,
        key: &TrialKeyGrantV1,
    ) -> Result<AgentOutcome, TrialError> {
        match (spec.rollout.agent, lease) {
            (AgentKind::McpTools, None) => {
                let servers = mcp_servers(&spec.rollout.mcp_servers, key)?;
                agent::run_mcp_tools(ctx, &servers).await
            }
            (_, None) => agent::run_math(ctx).await,
            (AgentKind::SweText, Some(lease)) => agent::run_text(ctx, lease).await,
            (AgentKind::Swe, Some(lease)) => agent::run_tools(ctx, lease).await,
            (AgentKind::MiniSweAgent, Some(lease)) => {
                agent::run_mini_swe_agent(ctx, lease, &key.trial_key).await
            }
            (AgentKind::McpTools, Some(_)) => Err(TrialError::new(
                FailureClass::Infrastructure,
                "the mcp-tools agent answers math tasks; this run's admission should have \
                 refused it for a code task",
            )),
        }
    }

    /// Returns once the run has ended (cancelled, failed, completed) within `limit`;
    /// otherwise never.
    async fn run_ended(&self, run: &arl_schemas::RunId, limit: Duration) {
        let state = self
            .bus
            .await_run_state(run, limit, |s| s.status.is_terminal())
            .await;
        if !matches!(state, Ok(Some(s)) if s.status.is_terminal()) {
            std::future::pending::<()>().await;
        }
    }

    /// Waits until the run's weights are fresh enough for the trial: a training trial of
    /// step s needs version ≥ s - 1 - max_staleness, a validation trial of step s the
    /// weights of step s. Watches the run's state (no polling). Returns the version.
    async fn wait_for_weights(&self, trial: &Trial) -> Result<u64, TrialError> {
        let slot = &trial.request.slot;
        let needed = match slot.split {
            Split::Train => u64::from(slot.step)
                .saturating_sub(1 + u64::from(trial.spec.algorithm.max_staleness)),
            Split::Validation => u64::from(slot.step),
        };
        // A resumed run has no version below its checkpoint's (its version 0 would be the
        // base model, not the policy it resumed).
        let needed = needed.max(u64::from(trial.spec.trainer.first_step()));
        let run = &trial.request.run_id;
        let state = self
            .bus
            .await_run_state(run, self.config.wait_limit, |s| {
                s.policy_version >= needed || s.status.is_terminal()
            })
            .await
            .map_err(|e| infrastructure(e.to_string()))?;
        match state {
            Some(state) if state.policy_version >= needed => Ok(state.policy_version),
            Some(state) if state.status.is_terminal() => Err(infrastructure(format!(
                "the run ended ({}) before weights of version {needed} arrived",
                state.status.as_str()
            ))),
            Some(state) => Err(infrastructure(format!(
                "weights of version {needed} never arrived within {} s (the run is at {})",
                self.config.wait_limit.as_secs(),
                state.policy_version
            ))),
            None => Err(infrastructure(format!(
                "run {run} has no state (deleted mid-run?)"
            ))),
        }
    }

    /// A sandbox of the task's environment, waiting while the environment is still being
    /// built.
    async fn lease(&self, trial: &Trial) -> Result<Lease, TrialError> {
        let req = &trial.request;
        let request = LeaseRequestV1 {
            run_id: req.run_id.clone(),
            trial_id: Some(req.trial_id.clone()),
            environment: trial.task.environment.clone(),
            ttl_s: u64::from(trial.spec.rollout.timeout_s) + 300,
            limits: SandboxLimits::default(),
        };
        let limit = Instant::now() + self.config.wait_limit;
        loop {
            match self
                .sandboxes
                .lease(&request, Duration::from_secs(120))
                .await
            {
                Ok(lease) => return Ok(lease),
                Err(SandboxError::Lease {
                    source: RequestError::Refused(err),
                    ..
                }) if err.code == RpcErrorCode::NotFound && Instant::now() < limit => {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                Err(error) => return Err(TrialError::from_sandbox(error)),
            }
        }
    }

    async fn issue_key(
        &self,
        trial: &Trial,
        scope: &TrialId,
        version: u64,
    ) -> Result<TrialKeyGrantV1, TrialError> {
        let ns = self.bus.namespace();
        self.bus
            .request(
                ns.proxy_rpc("any", ProxyOp::Issue),
                &TrialKeyRequestV1 {
                    run_id: trial.request.run_id.clone(),
                    trial_id: scope.clone(),
                    policy_version: version,
                    max_staleness: Some(u64::from(trial.spec.algorithm.max_staleness)),
                },
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| infrastructure(format!("no trial key from the token proxy: {e}")))
    }

    /// Ends the attempt's key; where the proxy stored each of its calls.
    async fn revoke_key(&self, key: &TrialKeyGrantV1) -> Result<Vec<u64>, TrialError> {
        let ns = self.bus.namespace();
        let revoked: TrialKeyRevokedV1 = self
            .bus
            .request(
                ns.proxy_rpc(&key.instance, ProxyOp::Revoke),
                &TrialKeyRevokeV1 {
                    trial_key: key.trial_key.clone(),
                },
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| infrastructure(format!("revoking the trial key: {e}")))?;
        if revoked.call_sequences.len() != revoked.calls as usize {
            return Err(infrastructure(format!(
                "the token proxy counted {} calls but said where {} of them are stored: it is \
                 older than this rollout service (upgrade arl-proxy)",
                revoked.calls,
                revoked.call_sequences.len()
            )));
        }
        Ok(revoked.call_sequences)
    }

    /// The attempt's calls as the proxy recorded them (each stored before its answer
    /// ended), read at the stream sequences it reported. An error when one is no longer
    /// in the stream or is not a call of this attempt.
    pub(crate) async fn recorded_calls(
        &self,
        request: &TrialRequestedV1,
        sequences: &[u64],
    ) -> Result<Vec<LlmCallV2>, TrialError> {
        let scope = call_scope(&request.trial_id, request.slot.attempt)
            .map_err(|e| infrastructure(e.to_string()))?;
        let reads = sequences
            .iter()
            .map(|&sequence| self.bus.read_at::<LlmCallV2>(Domain::Llm, sequence));
        let mut calls = futures::future::try_join_all(reads)
            .await
            .map_err(|e| infrastructure(format!("reading the calls of {scope}: {e}")))?;
        if let Some(stray) = calls
            .iter()
            .find(|c| c.run_id != request.run_id || c.trial_id != scope)
        {
            return Err(infrastructure(format!(
                "a call recorded for {scope} of run {} reads as one of {} of run {}",
                request.run_id, stray.trial_id, stray.run_id
            )));
        }
        // In turn order, one record per turn (a duplicate publish reports the sequence of
        // the record first stored, so the same sequence may be listed twice).
        calls.sort_by_key(|c| c.turn_index);
        calls.dedup_by_key(|c| c.turn_index);
        Ok(calls)
    }

    /// Hands the finished attempt on: `trial.finished` for the grader, then the record
    /// the join reads when the grade comes. In this order, so that a replica dying in
    /// between leaves an attempt claimed without a hand-off: redelivered, it is failed
    /// once as `infrastructure` and its grade (if any) joins nothing.
    async fn hand_off(&self, trial: &Trial, ran: Ran) -> Result<(), HandOffError> {
        let req = &trial.request;
        let published = self
            .bus
            .publish(&TrialFinishedV1 {
                run_id: req.run_id.clone(),
                trial_id: req.trial_id.clone(),
                slot: req.slot.clone(),
                exit: ran.outcome.exit,
                num_turns: ran.outcome.turns,
                patch: ran.patch,
                duration_seconds: trial.started.elapsed().as_secs_f64(),
                finished_at: chrono::Utc::now(),
            })
            .await;
        match published {
            Err(error @ arl_runtime::BusError::TooLarge { .. }) => {
                return Err(HandOffError::TooLarge(error));
            }
            other => other.map_err(HandlerError::from)?,
        };
        let attempt = req.slot.attempt;
        let finished = FinishedAttemptV1 {
            task: req.task.clone(),
            calls: u32::try_from(ran.calls.len()).unwrap_or(u32::MAX),
            call_sequences: ran.calls,
            parse_failures: ran.outcome.parse_failures,
            tool_calls: ran.outcome.tool_calls,
        };
        self.bus
            .modify_record::<TrialRecordV2>(Bucket::Trials, req.trial_id.as_str(), |r| match r {
                Some(r) if r.attempt == attempt && !r.done => {
                    r.finished = Some(finished.clone());
                    true
                }
                _ => false,
            })
            .await?;
        tracing::info!(trial = %req.trial_id, turns = ran.outcome.turns, exit = ?ran.outcome.exit, "trial finished; handed to grading");
        Ok(())
    }

    /// Applies the run's policy for the failure's class. `announce`: publish the
    /// `trial.failed` (false when the reward service already did).
    pub(crate) async fn fail(
        &self,
        req: &TrialRequestedV1,
        spec: &RunSpec,
        error: TrialError,
        calls: Option<Vec<u64>>,
        announce: bool,
    ) -> Result<(), HandlerError> {
        let mut action = spec.rollout.on_failure.action(error.class);
        let retry =
            action == FailureAction::Retry && req.slot.attempt + 1 < spec.rollout.max_attempts;
        if action == FailureAction::Retry && !retry {
            action = FailureAction::Mask;
        }
        // The records of a trajectory to be published (training trials that end here),
        // read before the failure is announced: if they cannot be read, the message comes
        // back and nothing was said twice. Validation trials are never trained on.
        let calls = match calls {
            Some(sequences) if !retry && req.slot.split == Split::Train => self
                .recorded_calls(req, &sequences)
                .await
                .map_err(|e| HandlerError::retry(e.message))?,
            _ => Vec::new(),
        };
        tracing::warn!(trial = %req.trial_id, attempt = req.slot.attempt, class = error.class.as_str(), ?action, message = %error.message, "trial failed");
        if announce {
            self.bus
                .publish(&TrialFailedV1 {
                    run_id: req.run_id.clone(),
                    trial_id: req.trial_id.clone(),
                    slot: req.slot.clone(),
                    class: error.class,
                    message: error.message.clone(),
                    will_retry: retry,
                    failed_at: chrono::Utc::now(),
                })
                .await?;
        }
        let outcome = match (retry, action) {
            (true, _) => "retried",
            (_, FailureAction::ScoreZero) => "scored_zero",
            _ => "masked",
        };
        self.metrics.trial(outcome, Some(error.class));
        if retry {
            let mut next = req.clone();
            next.slot.attempt += 1;
            // Back off before the next attempt (exponential, jittered, ≤ 30 s): a failure
            // of the infrastructure rarely mends itself in milliseconds.
            tokio::time::sleep(crate::llm::Backoff::before_attempt(next.slot.attempt)).await;
            self.bus.publish(&next).await?;
            return self.mark_done(req).await;
        }
        if action == FailureAction::FailGroup {
            self.fail_group(req).await?;
        }
        let status = match action {
            FailureAction::ScoreZero if !self.group_failed(req).await? => SampleStatus::ScoredZero,
            _ => SampleStatus::Masked,
        };
        let turns = u32::try_from(calls.len()).unwrap_or(u32::MAX);
        self.publish_trajectory(req, status, 0.0, &calls, turns, AgentCounts::default())
            .await?;
        self.mark_done(req).await
    }

    pub(crate) async fn publish_trajectory(
        &self,
        req: &TrialRequestedV1,
        status: SampleStatus,
        reward: f64,
        calls: &[LlmCallV2],
        turns: u32,
        counts: AgentCounts,
    ) -> Result<(), HandlerError> {
        // Validation trials are graded for the evaluator, never trained on.
        if req.slot.split == Split::Validation {
            return Ok(());
        }
        let Assembled {
            branches,
            calls: spans,
            unproven_tokens,
        } = assemble(calls);
        tracing::info!(trial = %req.trial_id, branches = branches.len(), unproven_tokens, counts.parse_failures, counts.tool_calls, ?status, reward, "trajectory");
        self.metrics.trajectories.inc();
        self.metrics.branches.inc_by(branches.len() as u64);
        self.metrics
            .completion_tokens
            .inc_by(spans.iter().map(|c| u64::from(c.completion_len)).sum());
        self.metrics
            .unproven_tokens
            .inc_by(u64::from(unproven_tokens));
        self.bus
            .publish(&TrajectoryV1 {
                run_id: req.run_id.clone(),
                trial_id: req.trial_id.clone(),
                slot: req.slot.clone(),
                status,
                reward,
                num_turns: turns,
                branches,
                calls: spans,
                unproven_tokens,
                tool_parse_failures: counts.parse_failures,
                tool_calls: counts.tool_calls,
            })
            .await?;
        Ok(())
    }

    fn group_key(req: &TrialRequestedV1) -> String {
        let slot = &req.slot;
        arl_schemas::state::failed_group_key(&req.run_id, slot.split, slot.step, &slot.task_id)
    }

    async fn fail_group(&self, req: &TrialRequestedV1) -> Result<(), HandlerError> {
        self.bus
            .modify_record::<bool>(Bucket::Trials, &Self::group_key(req), |failed| {
                *failed = Some(true);
                true
            })
            .await?;
        Ok(())
    }

    pub(crate) async fn group_failed(&self, req: &TrialRequestedV1) -> Result<bool, HandlerError> {
        let record = self
            .bus
            .get_record::<bool>(Bucket::Trials, &Self::group_key(req))
            .await?;
        Ok(record.unwrap_or(false))
    }

    /// Settles the attempt's record as done. It is kept for a while
    /// ([`DONE_TRIAL_RECORD_KEPT_SECONDS`]), so that a copy of the request that can still
    /// come finds the attempt done, and then expires: records of every trial a deployment
    /// ever ran do not pile up in `ARL_TRIALS` (nats-server keeps state for every key). A
    /// copy later still runs the attempt again; the trainer admits one trajectory per slot.
    pub(crate) async fn mark_done(&self, request: &TrialRequestedV1) -> Result<(), HandlerError> {
        let attempt = request.slot.attempt;
        let keep_for = Duration::from_secs(DONE_TRIAL_RECORD_KEPT_SECONDS);
        self.bus
            .settle_record::<TrialRecordV2>(
                Bucket::Trials,
                request.trial_id.as_str(),
                |r| match r {
                    Some(r) if r.attempt > attempt => false,
                    _ => {
                        *r = Some(TrialRecordV2 {
                            attempt,
                            done: true,
                            finished: None,
                        });
                        true
                    }
                },
                keep_for,
            )
            .await?;
        Ok(())
    }

    async fn task(&self, request: &TrialRequestedV1) -> Result<TaskRecord, HandlerError> {
        let digest = &request.task.dataset_digest;
        let manifest = self.bus.dataset_manifest(digest).await?.ok_or_else(|| {
            HandlerError::dead_letter(format!("dataset {digest} is not registered"))
        })?;
        manifest
            .task(&request.slot.task_id)
            .cloned()
            .ok_or_else(|| {
                HandlerError::dead_letter(format!(
                    "task {} is not in dataset {digest}",
                    request.slot.task_id
                ))
            })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Claim {
    Run,
    Skip,
    Orphaned,
}

pub(crate) fn infrastructure(message: String) -> TrialError {
    TrialError::new(FailureClass::Infrastructure, message)
}

/// Why a finished trial was not handed to grading.
enum HandOffError {
    /// Its `trial.finished` (the diff) cannot be an event.
    TooLarge(arl_runtime::BusError),
    Handler(HandlerError),
}

impl From<HandlerError> for HandOffError {
    fn from(error: HandlerError) -> Self {
        HandOffError::Handler(error)
    }
}

impl From<arl_runtime::BusError> for HandOffError {
    fn from(error: arl_runtime::BusError) -> Self {
        HandOffError::Handler(error.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trial_ids_are_stable_per_slot_and_attempts_get_their_own_call_scope() {
        let run = RunId::new("run-abc").unwrap();
        let slot = TrialSlot {
            task_id: arl_schemas::TaskId::new("fix-mean").unwrap(),
            step: 3,
            split: Split::Validation,
            sample_index: 1,
            attempt: 2,
        };
        let id = trial_id(&run, &slot, 4).unwrap();
        assert_eq!(id.as_str(), "run-abc-v3-t4-k1");
        assert_eq!(call_scope(&id, 0).unwrap(), id);
        assert_eq!(call_scope(&id, 2).unwrap().as_str(), "run-abc-v3-t4-k1-a2");
    }
}
