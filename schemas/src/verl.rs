//! VeRL's config keys, read as ARL run-spec keys: which ones are aliases of ours, which
//! have no meaning here (reported, then left out), and which mean something ARL does not do
//! (refused, saying why). A key is only ever mapped to a field with the same meaning: where
//! VeRL's meaning differs, mapping "close enough" would change results without anyone
//! noticing, so it is refused instead.
//!
//! Keys are dotted paths as VeRL's Hydra overrides write them
//! (`actor_rollout_ref.rollout.n`). A few keys only mean something together
//! (`use_kl_loss` with `kl_loss_coef`); they are kept as written while the spec is layered
//! and settled by [`resolve_combined`] once every layer is in.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::FieldError;

/// What a VeRL key becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The same setting as our key `to`, with the value translated by `value`.
    Alias { to: &'static str, value: Translate },
    /// Means nothing here (parallelism, memory, logging): reported and left out.
    Ignored { why: &'static str },
    /// Means something ARL does not do: an error saying why.
    Refused { why: &'static str },
    /// Only means something with other keys: settled by [`resolve_combined`].
    Combined,
}

/// How an aliased key's value becomes ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Translate {
    /// The value is already ours (same units, same names).
    Same,
    /// VeRL's KL estimator names (`kl`, `mse`, `low_var_kl`, `k1`..`k3`) to ours.
    KlLossType,
    /// VeRL's loss aggregation modes to ours (one has no counterpart).
    LossAggMode,
}

const ALIASES: &[(&str, &str, Translate)] = &[
    (
        "actor_rollout_ref.model.path",
        "model.path",
        Translate::Same,
    ),
    ("actor_rollout_ref.rollout.n", "rollout.n", Translate::Same),
    (
        "actor_rollout_ref.rollout.temperature",
        "rollout.temperature",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.rollout.top_p",
        "rollout.top_p",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.rollout.val_kwargs.n",
        "rollout.val_n",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "rollout.val_temperature",
        Translate::Same,
    ),
    // VeRL's response_length caps the tokens of one generation; ours caps one LLM call,
    // the same thing for single-call tasks (GSM8K) and per turn for agents.
    (
        "data.max_response_length",
        "rollout.max_response_tokens",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.clip_ratio_low",
        "algorithm.clip_ratio_low",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.clip_ratio_high",
        "algorithm.clip_ratio_high",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.clip_ratio_c",
        "algorithm.clip_ratio_c",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.entropy_coeff",
        "algorithm.entropy_coeff",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.kl_loss_type",
        "algorithm.kl_loss_type",
        Translate::KlLossType,
    ),
    (
        "actor_rollout_ref.actor.loss_agg_mode",
        "algorithm.loss_agg_mode",
        Translate::LossAggMode,
    ),
    (
        "actor_rollout_ref.actor.ppo_epochs",
        "trainer.ppo_epochs",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.grad_clip",
        "optim.grad_clip",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.optim.lr",
        "optim.lr",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.optim.weight_decay",
        "optim.weight_decay",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "optim.lr_warmup_steps",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.optim.min_lr_ratio",
        "optim.min_lr_ratio",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.actor.optim.warmup_style",
        "optim.lr_scheduler",
        Translate::Same,
    ),
    (
        "trainer.total_training_steps",
        "trainer.total_steps",
        Translate::Same,
    ),
    (
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "trainer.activation_checkpointing",
        Translate::Same,
    ),
    ("trainer.test_freq", "trainer.eval_every", Translate::Same),
    ("trainer.save_freq", "trainer.save_every", Translate::Same),
];

const PLACEMENT: &str = "ARL places and sizes its services itself";
const BATCHING: &str = "per-GPU batching does not change results; ARL splits batches by \
                        trainer.micro_batch_tokens";
const LOGGING: &str = "ARL reports to its own run state, metrics and traces";

/// Keys with no meaning here, and why. A key ending in `.` covers everything under it.
const IGNORED: &[(&str, &str)] = &[
    ("trainer.n_gpus_per_node", PLACEMENT),
    ("trainer.nnodes", PLACEMENT),
    (
        "actor_rollout_ref.rollout.name",
        "ARL runs its own inference service",
    ),
    (
        "actor_rollout_ref.rollout.mode",
        "ARL runs its own inference service",
    ),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        PLACEMENT,
    ),
    (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        PLACEMENT,
    ),
    (
        "actor_rollout_ref.rollout.enable_chunked_prefill",
        PLACEMENT,
    ),
    ("actor_rollout_ref.rollout.free_cache_engine", PLACEMENT),
    ("actor_rollout_ref.rollout.enforce_eager", PLACEMENT),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        BATCHING,
    ),
    (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        BATCHING,
    ),
    (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        BATCHING,
    ),
    ("actor_rollout_ref.actor.use_dynamic_bsz", BATCHING),
    ("actor_rollout_ref.actor.fsdp_config.", PLACEMENT),
    (
        "actor_rollout_ref.ref.",
        "ARL's trainer keeps the reference model itself",
    ),
    (
        "actor_rollout_ref.model.use_remove_padding",
        "ARL never pads sequences",
    ),
    (
        "data.max_prompt_length",
        "ARL does not cap prompts; a trial that outgrows the model's context is a \
         context_overflow failure (rollout.on_failure)",
    ),
    ("data.filter_overlong_prompts", "ARL does not cap prompts"),
    ("data.truncation", "ARL does not cap prompts"),
    ("trainer.logger", LOGGING),
    ("trainer.project_name", LOGGING),
    ("trainer.experiment_name", LOGGING),
    (
        "trainer.default_local_dir",
        "checkpoints go to ARL's object store",
    ),
    ("trainer.critic_warmup", "GRPO and RLOO have no critic"),
];

const REWARD_KL: &str = "VeRL's algorithm.kl_ctrl / use_kl_in_reward subtract a KL penalty \
     from the reward; ARL has no reward-side KL. ARL's algorithm.kl_coef is the KL loss \
     term, VeRL's actor_rollout_ref.actor.kl_loss_coef (with use_kl_loss=true)";

const REFUSED: &[(&str, &str)] = &[("algorithm.kl_ctrl.", REWARD_KL)];

const COMBINED: &[&str] = &[
    USE_KL_IN_REWARD,
    USE_KL_LOSS,
    KL_LOSS_COEF,
    NORM_ADV_BY_STD,
    TOTAL_EPOCHS,
    PPO_MINI_BATCH_SIZE,
    CLIP_RATIO,
    TRAIN_FILES,
    VAL_FILES,
];

const USE_KL_IN_REWARD: &str = "algorithm.use_kl_in_reward";
const USE_KL_LOSS: &str = "actor_rollout_ref.actor.use_kl_loss";
const KL_LOSS_COEF: &str = "actor_rollout_ref.actor.kl_loss_coef";
const NORM_ADV_BY_STD: &str = "algorithm.norm_adv_by_std_in_grpo";
const TOTAL_EPOCHS: &str = "trainer.total_epochs";
const PPO_MINI_BATCH_SIZE: &str = "actor_rollout_ref.actor.ppo_mini_batch_size";
const CLIP_RATIO: &str = "actor_rollout_ref.actor.clip_ratio";
const TRAIN_FILES: &str = "data.train_files";
const VAL_FILES: &str = "data.val_files";

/// The rule for a VeRL key; None when `path` is not a VeRL key ARL knows (it may be ours).
pub fn rule(path: &str) -> Option<Rule> {
    let covers = |key: &str| key == path || (key.ends_with('.') && path.starts_with(key));
    if let Some((_, to, value)) = ALIASES.iter().find(|(from, _, _)| *from == path) {
        return Some(Rule::Alias { to, value: *value });
    }
    if let Some((_, why)) = IGNORED.iter().find(|(key, _)| covers(key)) {
        return Some(Rule::Ignored { why });
    }
    if let Some((_, why)) = REFUSED.iter().find(|(key, _)| covers(key)) {
        return Some(Rule::Refused { why });
    }
    COMBINED.contains(&path).then_some(Rule::Combined)
}

/// Translates an aliased key's value into ours; `Err` says why it has no counterpart.
/// A value of the wrong type passes through, for decoding to report against our key.
pub fn translate(how: Translate, value: Value) -> Result<Value, String> {
    let Value::String(name) = &value else {
        return Ok(value);
    };
    let ours = match (how, name.as_str()) {
        (Translate::Same, _) => return Ok(value),
        (Translate::KlLossType, "kl" | "k1") => "k1",
        (Translate::KlLossType, "mse" | "k2") => "k2",
        (Translate::KlLossType, "low_var_kl" | "k3") => "low_var_kl",
        (Translate::KlLossType, _) => {
            return Err(format!(
                "VeRL's KL estimator {name:?} has no ARL counterpart; ARL has low_var_kl \
                 (k3), k1 (kl) and k2 (mse)"
            ));
        }
        (Translate::LossAggMode, "seq-mean-token-sum-norm") => {
            return Err(
                "seq-mean-token-sum-norm divides the summed token losses by a constant \
                 (the maximum response length), which ARL does not do; \
                 seq-mean-token-sum (Dr.GRPO's per-sequence sum, averaged over sequences) \
                 has the same direction at a different scale, so set it explicitly if \
                 that is what you want"
                    .into(),
            );
        }
        (Translate::LossAggMode, _) => return Ok(value),
    };
    Ok(Value::String(ours.into()))
}

/// One key as the layers left it: the value, and the path it was written under.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    pub written: String,
    pub value: Value,
}

/// A key with no meaning here that the spec gave, and why it was left out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IgnoredKey {
    pub path: String,
    pub why: String,
}

impl std::fmt::Display for IgnoredKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.path, self.why)
    }
}

/// Settles the keys that only mean something together, replacing them by ours in
/// `settings` (keyed by our path, or by the VeRL path for [`Rule::Combined`] keys).
/// Keys that end up with no effect (as they would have none in VeRL) go to `ignored`.
/// Returns `trainer.total_epochs` when it is given without a step count: the steps are
/// then epochs × batches per epoch, which only the dataset can tell (see [`steps_for_epochs`]).
pub fn resolve_combined(
    settings: &mut BTreeMap<String, Setting>,
    ignored: &mut Vec<IgnoredKey>,
) -> Result<Option<u32>, Vec<FieldError>> {
    let mut errors = Vec::new();
    // false (VeRL's default) is what ARL does: nothing to map.
    match take_bool(settings, USE_KL_IN_REWARD) {
        Ok(None | Some(false)) => {}
        Ok(Some(true)) => errors.push(FieldError::new(USE_KL_IN_REWARD, REWARD_KL)),
        Err(e) => errors.push(e),
    }
    if let Err(e) = resolve_kl_loss(settings, ignored) {
        errors.push(e);
    }
    if let Err(e) = resolve_std_normalisation(settings, ignored) {
        errors.push(e);
    }
    resolve_clip_ratio(settings, ignored);
    errors.extend(resolve_files(settings));
    let epochs = resolve_epochs(settings, ignored).unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    if let Err(e) = resolve_mini_batch_size(settings) {
        errors.push(e);
    }
    if errors.is_empty() {
        Ok(epochs)
    } else {
        Err(errors)
    }
}

fn take_bool(
    settings: &mut BTreeMap<String, Setting>,
    path: &str,
) -> Result<Option<bool>, FieldError> {
    match settings.remove(path) {
        None => Ok(None),
        Some(Setting {
            value: Value::Bool(b),
            ..
        }) => Ok(Some(b)),
        Some(Setting { value, .. }) => Err(FieldError::new(
            path,
            format!("must be true or false, got {value}"),
        )),
    }
}

fn set(settings: &mut BTreeMap<String, Setting>, ours: &str, written: &str, value: Value) {
    settings.insert(
        ours.into(),
        Setting {
            written: written.into(),
            value,
        },
    );
}

/// VeRL trains with a KL loss only when `use_kl_loss` is true, weighted by
/// `kl_loss_coef` (default 0.001); ours is on when `algorithm.kl_coef` > 0 (default 0).
/// So `use_kl_loss` decides, and a coefficient without it is ambiguous: refused.
fn resolve_kl_loss(
    settings: &mut BTreeMap<String, Setting>,
    ignored: &mut Vec<IgnoredKey>,
) -> Result<(), FieldError> {
    let use_kl_loss = take_bool(settings, USE_KL_LOSS)?;
    let coef = settings.remove(KL_LOSS_COEF);
    let ours = settings.get("algorithm.kl_coef");
    if let (Some(_), Some(ours)) = (&coef, ours) {
        return Err(FieldError::new(
            KL_LOSS_COEF,
            format!("is the same setting as {}, also given", ours.written),
        ));
    }
    match use_kl_loss {
        None if coef.is_some() => Err(FieldError::new(
            KL_LOSS_COEF,
            format!(
                "VeRL uses it only with {USE_KL_LOSS}=true (its default is false): say \
                 {USE_KL_LOSS}=true to train with a KL loss, or leave the coefficient out"
            ),
        )),
        None => Ok(()),
        Some(true) => match coef {
            Some(coef) => {
                set(settings, "algorithm.kl_coef", KL_LOSS_COEF, coef.value);
                Ok(())
            }
            None if ours.is_some() => Ok(()),
            None => Err(FieldError::new(
                USE_KL_LOSS,
                format!(
                    "is true but no coefficient is given; VeRL's default {KL_LOSS_COEF} is \
                     0.001 and ARL's algorithm.kl_coef is 0 (off): give {KL_LOSS_COEF}"
                ),
            )),
        },
        Some(false) => {
            if let Some(ours) = ours.filter(|s| s.value.as_f64() != Some(0.0)) {
                return Err(FieldError::new(
                    USE_KL_LOSS,
                    format!("is false but {} turns the KL loss on", ours.written),
                ));
            }
            if coef.is_some() {
                ignored.push(IgnoredKey {
                    path: KL_LOSS_COEF.into(),
                    why: format!("no effect with {USE_KL_LOSS}=false, as in VeRL"),
                });
            }
            set(settings, "algorithm.kl_coef", USE_KL_LOSS, Value::from(0.0));
            Ok(())
        }
    }
}

/// VeRL's Dr.GRPO is `adv_estimator=grpo` with `norm_adv_by_std_in_grpo=false`: GRPO's
/// advantages without the division by the group's std, which is our `dr_grpo` estimator.
/// VeRL reads the flag only for `grpo`.
fn resolve_std_normalisation(
    settings: &mut BTreeMap<String, Setting>,
    ignored: &mut Vec<IgnoredKey>,
) -> Result<(), FieldError> {
    let Some(normalise) = take_bool(settings, NORM_ADV_BY_STD)? else {
        return Ok(());
    };
    let estimator = settings
        .get("algorithm.adv_estimator")
        .map_or(Some("grpo"), |s| s.value.as_str())
        .map(str::to_owned);
    match (estimator.as_deref(), normalise) {
        (Some("grpo"), false) => {
            set(
                settings,
                "algorithm.adv_estimator",
                NORM_ADV_BY_STD,
                Value::from("dr_grpo"),
            );
            Ok(())
        }
        (Some("grpo"), true) | (Some("dr_grpo"), false) => Ok(()),
        (Some("dr_grpo"), true) => Err(FieldError::new(
            NORM_ADV_BY_STD,
            "is true but algorithm.adv_estimator is dr_grpo, which is GRPO without the \
             std normalisation",
        )),
        _ => {
            ignored.push(IgnoredKey {
                path: NORM_ADV_BY_STD.into(),
                why: "no effect unless algorithm.adv_estimator is grpo, as in VeRL".into(),
            });
            Ok(())
        }
    }
}

/// VeRL derives the steps from `total_epochs` unless `total_training_steps` is given;
/// ARL counts steps only, so epochs alone are handed back to be turned into steps by
/// whoever can read the dataset (`arl run submit`). They never reach the spec.
fn resolve_epochs(
    settings: &mut BTreeMap<String, Setting>,
    ignored: &mut Vec<IgnoredKey>,
) -> Result<Option<u32>, FieldError> {
    let Some(epochs) = settings.remove(TOTAL_EPOCHS) else {
        return Ok(None);
    };
    if settings.contains_key("trainer.total_steps") {
        ignored.push(IgnoredKey {
            path: TOTAL_EPOCHS.into(),
            why: "trainer.total_training_steps decides, as in VeRL".into(),
        });
        return Ok(None);
    }
    match epochs.value.as_u64().map(u32::try_from) {
        Some(Ok(n)) if n >= 1 => Ok(Some(n)),
        _ => Err(FieldError::new(
            TOTAL_EPOCHS,
            format!(
                "must be a whole number of epochs, at least 1, got {}",
                epochs.value
            ),
        )),
    }
}

/// The optimizer steps of `epochs` passes over `train_tasks` in batches of `batch_size`,
/// as VeRL counts them and as the dataset service batches (a partial last batch is a
/// step: `services/dataset/src/split.rs::batch`). None when there is nothing to count
/// (no task, a zero batch) or the count does not fit.
pub fn steps_for_epochs(epochs: u32, train_tasks: usize, batch_size: u32) -> Option<u32> {
    if train_tasks == 0 || batch_size == 0 {
        return None;
    }
    let per_epoch = u32::try_from(train_tasks.div_ceil(batch_size as usize)).ok()?;
    epochs.checked_mul(per_epoch)
}

/// VeRL's `clip_ratio` is the fallback of `clip_ratio_low` and `clip_ratio_high`: each bound
/// that is not given takes it.
fn resolve_clip_ratio(settings: &mut BTreeMap<String, Setting>, ignored: &mut Vec<IgnoredKey>) {
    let Some(ratio) = settings.remove(CLIP_RATIO) else {
        return;
    };
    let mut used = false;
    for bound in ["algorithm.clip_ratio_low", "algorithm.clip_ratio_high"] {
        if !settings.contains_key(bound) {
            set(settings, bound, CLIP_RATIO, ratio.value.clone());
            used = true;
        }
    }
    if !used {
        ignored.push(IgnoredKey {
            path: CLIP_RATIO.into(),
            why: "no effect: both clip_ratio_low and clip_ratio_high are given, as in VeRL".into(),
        });
    }
}

/// VeRL's `data.train_files` / `val_files` are our `data.dataset` / `data.val_dataset`
/// read as VeRL's preprocessed rows (`data.source = "verl"`, which they set; another source
/// would read the same file as something else, so it is an error).
fn resolve_files(settings: &mut BTreeMap<String, Setting>) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (key, ours) in [
        (TRAIN_FILES, "data.dataset"),
        (VAL_FILES, "data.val_dataset"),
    ] {
        let Some(files) = settings.remove(key) else {
            continue;
        };
        if let Some(also) = settings.get(ours) {
            errors.push(FieldError::new(
                key,
                format!("is the same setting as {}, also given", also.written),
            ));
            continue;
        }
        let path = match one_path(&files.value) {
            Ok(path) => path,
            Err(why) => {
                errors.push(FieldError::new(key, why));
                continue;
            }
        };
        match settings.get("data.source").map(|s| (&s.value, &s.written)) {
            None => set(settings, "data.source", key, Value::from("verl")),
            Some((Value::String(source), _)) if source == "verl" => {}
            Some((source, written)) => errors.push(FieldError::new(
                key,
                format!(
                    "holds VeRL's preprocessed rows (data.source = \"verl\"), but {written} \
                     is {source}; leave data.source out or set it to \"verl\""
                ),
            )),
        }
        set(settings, ours, key, Value::from(path));
    }
    errors
}

/// The one path of a files key: VeRL takes a path or a list of paths; ARL reads one file
/// per split.
fn one_path(value: &Value) -> Result<String, String> {
    let path = match value {
        Value::String(path) => path,
        Value::Array(items) => match items.as_slice() {
            [Value::String(path)] => path,
            [] => return Err("is an empty list; give the parquet file".into()),
            [_] => return Err(format!("must be a path, got {value}")),
            more => {
                return Err(format!(
                    "lists {} files, but ARL reads one file per split: concatenate them \
                     (datasets' concatenate_datasets(...).to_parquet) and give that file",
                    more.len()
                ));
            }
        },
        other => return Err(format!("must be a path or a list of one path, got {other}")),
    };
    if path.trim().is_empty() {
        return Err("is empty; give the parquet file".into());
    }
    Ok(path.clone())
}

/// VeRL's `ppo_mini_batch_size` counts prompts per optimizer update; ours counts the
/// updates per pass (`trainer.ppo_mini_batches` = train_batch_size ÷ it).
fn resolve_mini_batch_size(settings: &mut BTreeMap<String, Setting>) -> Result<(), FieldError> {
    let Some(mini) = settings.remove(PPO_MINI_BATCH_SIZE) else {
        return Ok(());
    };
    let batch = match settings.get("data.train_batch_size") {
        Some(s) => s.value.as_u64(),
        None => Some(u64::from(crate::spec::DataSpec::default().train_batch_size)),
    };
    match (batch, mini.value.as_u64()) {
        (Some(batch), Some(mini)) if mini > 0 && batch % mini == 0 => {
            let updates = Value::from(batch / mini);
            set(
                settings,
                "trainer.ppo_mini_batches",
                PPO_MINI_BATCH_SIZE,
                updates,
            );
            Ok(())
        }
        (batch, _) => Err(FieldError::new(
            PPO_MINI_BATCH_SIZE,
            format!(
                "must be a positive count that divides data.train_batch_size ({}), got {}",
                batch.map_or("not a count".into(), |b| b.to_string()),
                mini.value
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As the dataset service batches: ceil(tasks ÷ batch) steps per epoch, the last
    /// batch partial.
    #[test]
    fn epochs_count_every_batch_of_the_split() {
        assert_eq!(steps_for_epochs(15, 5, 4), Some(30));
        assert_eq!(steps_for_epochs(15, 8, 4), Some(30));
        assert_eq!(steps_for_epochs(1, 7473, 1024), Some(8));
        assert_eq!(
            steps_for_epochs(3, 2, 4),
            Some(3),
            "a batch larger than the split"
        );
        assert_eq!(steps_for_epochs(3, 0, 4), None);
        assert_eq!(steps_for_epochs(3, 5, 0), None);
        assert_eq!(steps_for_epochs(u32::MAX, 5, 1), None, "does not fit");
    }
}
