//! The rollout service. `task.batch` fans out into one `trial.requested` per (task,
//! sample); replicas share a durable consumer on those, each running up to its
//! concurrency at once. A trial: wait until the run's weights are fresh enough → lease a
//! sandbox of the task's environment → issue a proxy key → run the agent within the turn
//! limit and the wall-clock budget → `git diff` → release → revoke the key →
//! `trial.finished` → wait for its grade → assemble the trajectory from the proxy's
//! `llm.call` records → `trajectory.ready`. Each failure has a class, and the run's
//! policy for that class decides: retry (a new request, next attempt, fresh sandbox),
//! mask, fail the group, or score zero.
//!
//! Exactly once: the `ARL_TRIALS` bucket records each trial's attempt and phase. A
//! request for an attempt that is already done, or superseded, is acknowledged without
//! running; one found `running` was held by a replica that died — it is failed as
//! `infrastructure` ("replica lost") and the policy applies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arl_runtime::consumer::run_consumer;
use arl_runtime::rpc::RequestError;
use arl_runtime::{Bus, ConsumerSpec, Delivery, HandlerError, Shutdown};
use arl_sandbox_client::{Lease, SandboxClient, SandboxError};
use arl_schemas::dataset::TaskRecord;
use arl_schemas::events::{
    FailureClass, LlmCallV1, RewardScoredV2, SampleStatus, Split, TaskBatchV1, TaskKind,
    TrajectoryV1, TrialFailedV1, TrialFinishedV1, TrialRequestedV1, TrialSlot, TrialStartedV1,
};
use arl_schemas::rpc::{
    LeaseRequestV1, ProxyOp, RpcErrorCode, SandboxLimits, TrialKeyGrantV1, TrialKeyRequestV1,
    TrialKeyRevokeV1, TrialKeyRevokedV1,
};
use arl_schemas::spec::{AgentKind, FailureAction, RunSpec};
use arl_schemas::state::{RunStateV1, TrialRecordV1};
use arl_schemas::{Bucket, Domain, RunId, TrialId};

use crate::agent::{self, AgentContext, AgentOutcome};
use crate::llm::{LlmClient, Sampling, TrialError};
use crate::metrics::RolloutMetrics;
use crate::trajectory::{Assembled, assemble};
use crate::watch::{Grade, Watch};

const SERVICE: &str = "rollout";

#[derive(Clone, Debug)]
pub struct RolloutConfig {
    /// Trials this replica runs at once.
    pub concurrency: usize,
    /// How long a trial waits for its environment to exist (the image builder may still
    /// be building it) and for fresh enough weights.
    pub wait_limit: Duration,
    /// How long a finished trial waits for its grade.
    pub grading_timeout: Duration,
    /// How soon a trial held by a replica that stopped signalling comes back.
    pub ack_wait: Duration,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            concurrency: 8,
            wait_limit: Duration::from_secs(1800),
            grading_timeout: Duration::from_secs(3600),
            ack_wait: Duration::from_secs(60),
        }
    }
}

#[derive(Clone)]
pub struct Rollout {
    bus: Bus,
    sandboxes: SandboxClient,
    llm: LlmClient,
    config: Arc<RolloutConfig>,
    metrics: RolloutMetrics,
    watch: Watch,
}

/// The trial id of a slot: stable, so a retry keeps it.
pub fn trial_id(run: &RunId, slot: &TrialSlot, task_index: usize) -> Result<TrialId, String> {
    let split = match slot.split {
        Split::Train => 's',
        Split::Validation => 'v',
    };
    TrialId::new(format!(
        "{run}-{split}{}-t{task_index}-k{}",
        slot.step, slot.sample_index
    ))
    .map_err(|e| e.to_string())
}

/// The id the proxy records an attempt's calls under: each attempt has its own record.
fn call_scope(trial: &TrialId, attempt: u32) -> Result<TrialId, String> {
    if attempt == 0 {
        return Ok(trial.clone());
    }
    TrialId::new(format!("{trial}-a{attempt}")).map_err(|e| e.to_string())
}

/// What a run is doing with one trial.
struct Trial {
    request: TrialRequestedV1,
    spec: RunSpec,
    task: TaskRecord,
    started: Instant,
    started_at: chrono::DateTime<chrono::Utc>,
}

/// The agent's part of a trial, done.
struct Ran {
    outcome: AgentOutcome,
    patch: String,
    calls: Vec<LlmCallV1>,
}

impl Rollout {
    /// A replica; subscribes to the calls and grades its trials will wait for.
    pub async fn new(bus: Bus, config: RolloutConfig, shutdown: &Shutdown) -> Result<Self, String> {
        let watch = Watch::start(&bus, shutdown).await?;
        Ok(Self {
            watch,

            sandboxes: SandboxClient::new(bus.clone()),
            llm: LlmClient::default(),
            metrics: RolloutMetrics::register(bus.metrics()),
            bus,
            config: Arc::new(config),
        })
    }

    pub fn start(&self, shutdown: &Shutdown) {
        let ns = self.bus.namespace();
        let batches = ConsumerSpec::new(
            Domain::Task,
            SERVICE,
            vec![ns.event_filter(Domain::Task, "batch")],
        );
        let mut trials = ConsumerSpec::new(
            Domain::Trial,
            SERVICE,
            vec![ns.event_filter(Domain::Trial, "requested")],
        )
        .held(self.config.concurrency.max(1));
        // A replica that dies mid-trial stops the in-progress signal: the trial comes
        // back within a minute; the record tells the next replica what happened.
        trials.ack_wait = self.config.ack_wait;
        trials.max_deliver = 10;
        let this = Arc::new(self.clone());
        let on_batch = this.clone();
        shutdown.spawn(run_consumer(
            self.bus.clone(),
            batches,
            move |delivery: Delivery| {
                let this = on_batch.clone();
                async move { this.on_batch(delivery).await }
            },
            shutdown.clone(),
        ));
        shutdown.spawn(run_consumer(
            self.bus.clone(),
            trials,
            move |delivery: Delivery| {
                let this = this.clone();
                async move { this.on_trial(delivery).await }
            },
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
                    trial_id(&batch.run_id, &slot, index).map_err(HandlerError::DeadLetter)?;
                self.bus
                    .publish(&TrialRequestedV1 {
                        run_id: batch.run_id.clone(),
                        trial_id,
                        slot,
                        task: task.clone(),
                    })
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
            .modify_record::<TrialRecordV1>(Bucket::Trials, request.trial_id.as_str(), |r| {
                verdict = match r {
                    Some(r) if r.attempt > attempt || (r.attempt == attempt && r.done) => {
                        Claim::Skip
                    }
                    Some(r) if r.attempt == attempt => Claim::Orphaned,
                    _ => Claim::Run,
                };
                if verdict == Claim::Run {
                    *r = Some(TrialRecordV1 {
                        attempt,
                        done: false,
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
            return self.fail(&trial, error, None, true).await;
        }
        match self.run(&trial).await {
            Ok(ran) => self.grade_and_publish(&trial, ran).await,
            Err((error, calls)) => self.fail(&trial, error, calls, true).await,
        }
    }

    /// The agent's part: everything up to the patch and the recorded calls.
    async fn run(&self, trial: &Trial) -> Result<Ran, (TrialError, Option<Vec<LlmCallV1>>)> {
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
            .map_err(|e| (TrialError::new(FailureClass::Infrastructure, e), None))?;
        self.watch.expect_calls(&scope);
        let key = match self.issue_key(trial, &scope, version).await {
            Ok(key) => key,
            Err(error) => {
                self.watch.take_calls(&scope, 0, Duration::ZERO).await;
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
        let agent = tokio::time::timeout(
            budget,
            self.agent(&ctx, spec, lease.as_ref(), &key.trial_key),
        )
        .await;
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
        let recorded = self.revoke_key(&key).await;
        let calls = match recorded {
            Ok(count) => self.recorded_calls(trial, &scope, count).await,
            Err(error) => Err(error),
        };
        let calls = match calls {
            Ok(calls) => calls,
            Err(error) => return Err((error, None)),
        };
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
        trial_key: &str,
    ) -> Result<AgentOutcome, TrialError> {
        let Some(lease) = lease else {
            return agent::run_math(ctx).await;
        };
        match spec.rollout.agent {
            AgentKind::SweText => agent::run_text(ctx, lease).await,
            AgentKind::Swe => agent::run_tools(ctx, lease).await,
            AgentKind::MiniSweAgent => agent::run_mini_swe_agent(ctx, lease, trial_key).await,
        }
    }

    /// Waits until the run's weights are fresh enough for the trial: a training trial of
    /// step s needs version ≥ s - 1 - max_staleness, a validation trial of step s the
    /// weights of step s. Returns the version.
    async fn wait_for_weights(&self, trial: &Trial) -> Result<u64, TrialError> {
        let slot = &trial.request.slot;
        let needed = match slot.split {
            Split::Train => u64::from(slot.step)
                .saturating_sub(1 + u64::from(trial.spec.algorithm.max_staleness)),
            Split::Validation => u64::from(slot.step),
        };
        let limit = Instant::now() + self.config.wait_limit;
        loop {
            let state = self
                .run_state(&trial.request.run_id)
                .await
                .map_err(|e| infrastructure(e.to_string()))?;
            if state.policy_version >= needed {
                return Ok(state.policy_version);
            }
            if Instant::now() > limit {
                return Err(infrastructure(format!(
                    "weights of version {needed} never arrived (the run is at {})",
                    state.policy_version
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
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

    async fn revoke_key(&self, key: &TrialKeyGrantV1) -> Result<u32, TrialError> {
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
        Ok(revoked.calls)
    }

    /// The proxy's records of this attempt's calls (stored before each answer ended).
    async fn recorded_calls(
        &self,
        trial: &Trial,
        scope: &TrialId,
        count: u32,
    ) -> Result<Vec<LlmCallV1>, TrialError> {
        if let Some(calls) = self
            .watch
            .take_calls(scope, count as usize, Duration::from_secs(5))
            .await
        {
            return Ok(calls);
        }
        // Not all came through the subscription: read them from the stream.
        let ns = self.bus.namespace();
        let filter = ns.event_subject(Domain::Llm, &trial.request.run_id, "call");
        let since = trial.started_at - chrono::Duration::seconds(5);
        for _ in 0..50 {
            let calls: Vec<LlmCallV1> = self
                .bus
                .replay_since::<LlmCallV1>(Domain::Llm, filter.clone(), Some(since))
                .await
                .map_err(|e| infrastructure(e.to_string()))?
                .into_iter()
                .filter(|c| &c.trial_id == scope)
                .collect();
            if calls.len() >= count as usize {
                return Ok(calls);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(infrastructure(format!(
            "the proxy counted {count} calls for {scope}, but not all are in the stream"
        )))
    }

    async fn grade_and_publish(&self, trial: &Trial, ran: Ran) -> Result<(), HandlerError> {
        let req = &trial.request;
        let finished_at = chrono::Utc::now();
        self.watch.expect_grade(&req.trial_id, req.slot.attempt);
        self.bus
            .publish(&TrialFinishedV1 {
                run_id: req.run_id.clone(),
                trial_id: req.trial_id.clone(),
                slot: req.slot.clone(),
                exit: ran.outcome.exit,
                num_turns: ran.outcome.turns,
                patch: ran.patch.clone(),
                duration_seconds: trial.started.elapsed().as_secs_f64(),
                finished_at,
            })
            .await?;
        tracing::info!(trial = %req.trial_id, turns = ran.outcome.turns, exit = ?ran.outcome.exit, "trial finished; waiting for its grade");
        let grade = self.wait_for_grade(trial, finished_at).await;
        self.watch.forget_grade(&req.trial_id, req.slot.attempt);
        match grade? {
            Grade::Scored(scored) => {
                let status = if self.group_failed(trial).await? {
                    SampleStatus::Masked
                } else {
                    SampleStatus::Scored
                };
                self.metrics.trial("scored", None);
                self.metrics.turns.inc_by(u64::from(ran.outcome.turns));
                self.metrics
                    .parse_failures
                    .inc_by(u64::from(ran.outcome.parse_failures));
                self.publish_trajectory(
                    trial,
                    status,
                    scored.reward,
                    &ran.calls,
                    ran.outcome.turns,
                    ran.outcome.parse_failures,
                )
                .await?;
                self.mark_done(req).await
            }
            Grade::Failed(failed) => {
                // The reward service already announced the failure.
                let error = TrialError::new(failed.class, failed.message);
                self.fail(trial, error, Some(ran.calls), false).await
            }
        }
    }

    async fn wait_for_grade(
        &self,
        trial: &Trial,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<Grade, HandlerError> {
        let req = &trial.request;
        let ns = self.bus.namespace();
        let since = Some(since - chrono::Duration::seconds(5));
        let limit = Instant::now() + self.config.grading_timeout;
        loop {
            if let Some(grade) = self
                .watch
                .grade(&req.trial_id, req.slot.attempt, Duration::from_secs(30))
                .await
            {
                return Ok(grade);
            }
            // Nothing through the subscription for a while: read the streams (a failed
            // read is tried again later; grading may just be slow).
            let scored = self
                .bus
                .replay_since::<RewardScoredV2>(
                    Domain::Reward,
                    ns.event_subject(Domain::Reward, &req.run_id, "scored"),
                    since,
                )
                .await
                .unwrap_or_else(|err| {
                    tracing::warn!(%err, "reading grades back");
                    Vec::new()
                });
            if let Some(s) = scored
                .into_iter()
                .find(|s| s.trial_id == req.trial_id && s.slot.attempt == req.slot.attempt)
            {
                return Ok(Grade::Scored(s));
            }
            let failed = self
                .bus
                .replay_since::<TrialFailedV1>(
                    Domain::Trial,
                    ns.event_subject(Domain::Trial, &req.run_id, "failed"),
                    since,
                )
                .await
                .unwrap_or_else(|err| {
                    tracing::warn!(%err, "reading grading failures back");
                    Vec::new()
                });
            if let Some(f) = failed.into_iter().find(|f| {
                f.trial_id == req.trial_id
                    && f.slot.attempt == req.slot.attempt
                    && f.class == FailureClass::GradingError
            }) {
                return Ok(Grade::Failed(f));
            }
            if Instant::now() > limit {
                return Ok(Grade::Failed(TrialFailedV1 {
                    run_id: req.run_id.clone(),
                    trial_id: req.trial_id.clone(),
                    slot: req.slot.clone(),
                    class: FailureClass::GradingError,
                    message: "no grade within the grading timeout".into(),
                    will_retry: false,
                    failed_at: chrono::Utc::now(),
                }));
            }
        }
    }

    /// Applies the run's policy for the failure's class. `announce`: publish the
    /// `trial.failed` (false when the reward service already did).
    async fn fail(
        &self,
        trial: &Trial,
        error: TrialError,
        calls: Option<Vec<LlmCallV1>>,
        announce: bool,
    ) -> Result<(), HandlerError> {
        let req = &trial.request;
        let spec = &trial.spec;
        let mut action = spec.rollout.on_failure.action(error.class);
        let retry =
            action == FailureAction::Retry && req.slot.attempt + 1 < spec.rollout.max_attempts;
        if action == FailureAction::Retry && !retry {
            action = FailureAction::Mask;
        }
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
            self.fail_group(trial).await?;
        }
        let status = match action {
            FailureAction::ScoreZero if !self.group_failed(trial).await? => {
                SampleStatus::ScoredZero
            }
            _ => SampleStatus::Masked,
        };
        let calls = calls.unwrap_or_default();
        let turns = u32::try_from(calls.len()).unwrap_or(u32::MAX);
        self.publish_trajectory(trial, status, 0.0, &calls, turns, 0)
            .await?;
        self.mark_done(req).await
    }

    async fn publish_trajectory(
        &self,
        trial: &Trial,
        status: SampleStatus,
        reward: f64,
        calls: &[LlmCallV1],
        turns: u32,
        parse_failures: u32,
    ) -> Result<(), HandlerError> {
        let req = &trial.request;
        // Validation trials are graded for the evaluator, never trained on.
        if req.slot.split == Split::Validation {
            return Ok(());
        }
        let Assembled {
            branches,
            calls: spans,
            unproven_tokens,
        } = assemble(calls);
        tracing::info!(trial = %req.trial_id, branches = branches.len(), unproven_tokens, parse_failures, ?status, reward, "trajectory");
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
                tool_parse_failures: parse_failures,
            })
            .await?;
        Ok(())
    }

    fn group_key(trial: &Trial) -> String {
        let slot = &trial.request.slot;
        arl_schemas::state::failed_group_key(
            &trial.request.run_id,
            slot.split,
            slot.step,
            &slot.task_id,
        )
    }

    async fn fail_group(&self, trial: &Trial) -> Result<(), HandlerError> {
        self.bus
            .modify_record::<bool>(Bucket::Trials, &Self::group_key(trial), |failed| {
                *failed = Some(true);
                true
            })
            .await?;
        Ok(())
    }

    async fn group_failed(&self, trial: &Trial) -> Result<bool, HandlerError> {
        let record = self
            .bus
            .get_record::<bool>(Bucket::Trials, &Self::group_key(trial))
            .await?;
        Ok(record.unwrap_or(false))
    }

    async fn mark_done(&self, request: &TrialRequestedV1) -> Result<(), HandlerError> {
        let attempt = request.slot.attempt;
        self.bus
            .modify_record::<TrialRecordV1>(
                Bucket::Trials,
                request.trial_id.as_str(),
                |r| match r {
                    Some(r) if r.attempt > attempt => false,
                    _ => {
                        *r = Some(TrialRecordV1 {
                            attempt,
                            done: true,
                        });
                        true
                    }
                },
            )
            .await?;
        Ok(())
    }

    async fn run_state(&self, run: &RunId) -> Result<RunStateV1, HandlerError> {
        self.bus
            .run_state(run)
            .await?
            .ok_or_else(|| HandlerError::Retry(format!("run {run} has no state yet")))
    }

    async fn task(&self, request: &TrialRequestedV1) -> Result<TaskRecord, HandlerError> {
        let digest = &request.task.dataset_digest;
        let manifest = self.bus.dataset_manifest(digest).await?.ok_or_else(|| {
            HandlerError::DeadLetter(format!("dataset {digest} is not registered"))
        })?;
        manifest
            .task(&request.slot.task_id)
            .cloned()
            .ok_or_else(|| {
                HandlerError::DeadLetter(format!(
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

fn infrastructure(message: String) -> TrialError {
    TrialError::new(FailureClass::Infrastructure, message)
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
