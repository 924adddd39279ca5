//! A run spec built in layers, as `arl run submit` builds it: the file's keys, then each
//! `--set KEY=VALUE` in order (a later layer wins), with VeRL's keys translated into ours on
//! the way ([`crate::verl`]). The layers are flattened to dotted leaf keys, so a key means
//! the same whether a file nests it in tables or an override spells it out. Decoding and
//! the range checks of [`RunSpec::check`] come after, on the result.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde_json::{Map, Value};

use crate::FieldError;
use crate::spec::RunSpec;
use crate::verl::{self, IgnoredKey, Rule, Setting};

/// One `--set KEY=VALUE`: a dotted key (ours or VeRL's) and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Override {
    pub path: String,
    pub value: Value,
}

impl FromStr for Override {
    type Err = FieldError;

    fn from_str(text: &str) -> Result<Self, FieldError> {
        let Some((path, raw)) = text.split_once('=') else {
            return Err(FieldError::new(
                text,
                "an override is KEY=VALUE, e.g. rollout.n=8",
            ));
        };
        let path = path.trim();
        if path.split('.').any(str::is_empty) {
            return Err(FieldError::new(
                path,
                "is not a dotted key such as rollout.n",
            ));
        }
        let value = override_value(raw.trim()).map_err(|why| FieldError::new(path, why))?;
        Ok(Self {
            path: path.into(),
            value,
        })
    }
}

/// A value as Hydra's overrides write it: a TOML value (number, bool, quoted string,
/// `[..]` list), Python's `True`/`False`, or else a bare word taken as a string
/// (`algorithm.adv_estimator=grpo`).
fn override_value(raw: &str) -> Result<Value, String> {
    match raw {
        "True" => return Ok(Value::Bool(true)),
        "False" => return Ok(Value::Bool(false)),
        _ => {}
    }
    match toml::from_str::<Map<String, Value>>(&format!("v = {raw}")) {
        Ok(mut table) => Ok(table.remove("v").unwrap_or(Value::Null)),
        // Something that tried to be a list, table or quoted string and failed is a
        // mistake, not a word.
        Err(err) if raw.starts_with(['[', '{', '"', '\'']) => Err(format!(
            "{raw} is not a valid TOML value: {}",
            err.message()
        )),
        Err(_) => Ok(Value::String(raw.into())),
    }
}

/// Reads a TOML spec file's text as a document for [`build`].
pub fn toml_document(text: &str) -> Result<Value, FieldError> {
    toml::from_str(text).map_err(|err| FieldError::new("", format!("not valid TOML: {err}")))
}

/// The spec the layers give, and the VeRL keys that were left out as meaningless here.
#[derive(Clone, Debug, PartialEq)]
pub struct Layered {
    pub spec: RunSpec,
    pub ignored: Vec<IgnoredKey>,
    /// VeRL's `trainer.total_epochs`, given without a step count. Then `spec.trainer.total_steps`
    /// is not settled (it holds the default): the caller must set it to
    /// [`verl::steps_for_epochs`] over the dataset's training split, or refuse the spec.
    pub total_epochs: Option<u32>,
}

/// Builds the spec from a file's document (an empty object when there is no file) and the
/// overrides, in order. Decoding errors name the key as the user wrote it.
pub fn build(document: Value, overrides: &[Override]) -> Result<Layered, Vec<FieldError>> {
    let Value::Object(_) = document else {
        return Err(vec![FieldError::new(
            "",
            "a run spec must be a table of keys",
        )]);
    };
    let mut layers = Layers::default();
    let mut errors = Vec::new();
    let mut file_leaves = Vec::new();
    leaves(String::new(), document, &mut file_leaves);
    for (path, value) in file_leaves {
        errors.extend(layers.place_from_file(path, value).err());
    }
    let ours = our_keys();
    for o in overrides {
        errors.extend(layers.place_override(&ours, o).err());
    }
    let total_epochs = verl::resolve_combined(&mut layers.settings, &mut layers.ignored)
        .unwrap_or_else(|combined| {
            errors.extend(combined);
            None
        });
    if !errors.is_empty() {
        return Err(errors);
    }
    let spec = RunSpec::from_json_value(nest(&layers.settings)).map_err(|errors| {
        errors
            .into_iter()
            .map(|e| as_written(e, &layers.settings))
            .collect::<Vec<_>>()
    })?;
    Ok(Layered {
        spec,
        ignored: layers.ignored,
        total_epochs,
    })
}

#[derive(Default)]
struct Layers {
    /// Keyed by our path (or the VeRL path of a key settled later).
    settings: BTreeMap<String, Setting>,
    ignored: Vec<IgnoredKey>,
}

impl Layers {
    /// A file gives each setting once: ours and its VeRL alias both in one file is a
    /// conflict (which would win is not written anywhere), not an override.
    fn place_from_file(&mut self, path: String, value: Value) -> Result<(), FieldError> {
        let Some((target, value)) = self.target(&path, value)? else {
            return Ok(());
        };
        if let Some(earlier) = self.settings.get(&target) {
            return Err(FieldError::new(
                path,
                format!(
                    "is the same setting as {}, also in the file",
                    earlier.written
                ),
            ));
        }
        self.settings.insert(
            target,
            Setting {
                written: path,
                value,
            },
        );
        Ok(())
    }

    fn place_override(&mut self, ours: &[String], o: &Override) -> Result<(), FieldError> {
        if verl::rule(&o.path).is_none() && !ours.contains(&o.path) {
            return Err(FieldError::new(
                &o.path,
                "no such key in the run spec (neither ARL's nor a VeRL key ARL knows); \
                 README's run-spec tables list them",
            ));
        }
        let Some((target, value)) = self.target(&o.path, o.value.clone())? else {
            return Ok(());
        };
        let written = o.path.clone();
        self.settings.insert(target, Setting { written, value });
        Ok(())
    }

    /// Where a key's value goes; None for a key that means nothing here (noted).
    fn target(&mut self, path: &str, value: Value) -> Result<Option<(String, Value)>, FieldError> {
        match verl::rule(path) {
            None | Some(Rule::Combined) => Ok(Some((path.into(), value))),
            Some(Rule::Alias { to, value: how }) => {
                let value =
                    verl::translate(how, value).map_err(|why| FieldError::new(path, why))?;
                Ok(Some((to.into(), value)))
            }
            Some(Rule::Refused { why }) => Err(FieldError::new(path, why)),
            Some(Rule::Ignored { why }) => {
                if !self.ignored.iter().any(|k| k.path == path) {
                    self.ignored.push(IgnoredKey {
                        path: path.into(),
                        why: why.into(),
                    });
                }
                Ok(None)
            }
        }
    }
}

/// Every leaf of a document as (dotted path, value); a list is a leaf.
fn leaves(prefix: String, value: Value, out: &mut Vec<(String, Value)>) {
    match value {
        Value::Object(table) => {
            for (key, value) in table {
                let path = if prefix.is_empty() {
                    key
                } else {
                    format!("{prefix}.{key}")
                };
                leaves(path, value, out);
            }
        }
        leaf => out.push((prefix, leaf)),
    }
}

/// Our leaf keys: every key of the spec has a default, so the default spec has them all.
fn our_keys() -> Vec<String> {
    let mut out = Vec::new();
    leaves(
        String::new(),
        serde_json::to_value(RunSpec::default()).unwrap_or_default(),
        &mut out,
    );
    out.into_iter().map(|(path, _)| path).collect()
}

/// The settings as nested tables, ready to decode. A later key under a path that held a
/// plain value replaces it (an override wins).
fn nest(settings: &BTreeMap<String, Setting>) -> Value {
    let mut root = Map::new();
    for (path, setting) in settings {
        let mut table = &mut root;
        let mut keys = path.split('.').peekable();
        while let Some(key) = keys.next() {
            if keys.peek().is_none() {
                table.insert(key.into(), setting.value.clone());
                break;
            }
            let entry = table
                .entry(key)
                .or_insert_with(|| Value::Object(Map::new()));
            if !entry.is_object() {
                *entry = Value::Object(Map::new());
            }
            let Value::Object(inner) = entry else { break };
            table = inner;
        }
    }
    Value::Object(root)
}

/// A decoding error against our key, reported under the key the user wrote.
fn as_written(error: FieldError, settings: &BTreeMap<String, Setting>) -> FieldError {
    match settings.get(&error.path) {
        Some(s) if s.written != error.path => FieldError::new(
            &s.written,
            format!("{} (ARL's {})", error.reason, error.path),
        ),
        _ => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{AdvEstimator, DataSource, KlLossType, LossAggMode};

    fn set(args: &[&str]) -> Vec<Override> {
        args.iter().map(|a| a.parse().unwrap()).collect()
    }

    fn build_set(args: &[&str]) -> Result<Layered, Vec<FieldError>> {
        build(Value::Object(Map::new()), &set(args))
    }

    fn error_paths(result: Result<Layered, Vec<FieldError>>) -> Vec<String> {
        result.unwrap_err().into_iter().map(|e| e.path).collect()
    }

    #[test]
    fn override_values_read_as_hydra_writes_them() {
        let cases = [
            ("a.b=5", Value::from(5)),
            ("a.b=1e-6", Value::from(1e-6)),
            ("a.b=True", Value::Bool(true)),
            ("a.b=false", Value::Bool(false)),
            ("a.b=grpo", Value::from("grpo")),
            ("a.b=seq-mean-token-sum", Value::from("seq-mean-token-sum")),
            (
                "a.b=Qwen/Qwen2-7B-Instruct",
                Value::from("Qwen/Qwen2-7B-Instruct"),
            ),
            ("a.b=\"5\"", Value::from("5")),
            ("a.b=[\"x\", \"y\"]", Value::from(vec!["x", "y"])),
            ("a.b=", Value::from("")),
        ];
        for (text, value) in cases {
            let o: Override = text.parse().unwrap();
            assert_eq!((o.path.as_str(), o.value), ("a.b", value), "{text}");
        }
        for bad in ["rollout.n", "=3", "a..b=1", "a.b=[1,", "a.b=\"open"] {
            assert!(bad.parse::<Override>().is_err(), "{bad}");
        }
    }

    #[test]
    fn verl_aliases_set_our_keys() {
        let layered = build_set(&[
            "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.kl_loss_type=mse",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.model.path=/models/qwen",
            "data.max_response_length=1024",
            "trainer.total_training_steps=10",
            "trainer.test_freq=5",
            "trainer.save_freq=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        ])
        .unwrap();
        let s = layered.spec;
        assert_eq!(s.rollout.n, 5);
        assert_eq!(
            (s.algorithm.clip_ratio_low, s.algorithm.clip_ratio_high),
            (0.2, 0.28)
        );
        assert_eq!(s.algorithm.kl_loss_type, KlLossType::K2);
        assert_eq!(s.algorithm.loss_agg_mode, LossAggMode::SeqMeanTokenMean);
        assert_eq!(s.optim.lr, 3e-6);
        assert_eq!(s.rollout.temperature, 0.7);
        assert_eq!(s.model.path, "/models/qwen");
        assert_eq!(s.rollout.max_response_tokens, 1024);
        assert_eq!(
            (
                s.trainer.total_steps,
                s.trainer.eval_every,
                s.trainer.save_every
            ),
            (10, 5, 2)
        );
        // 2 tasks per step (our default batch) in mini-batches of 1: 2 updates.
        assert_eq!(s.trainer.ppo_mini_batches, 2);
        assert!(layered.ignored.is_empty());
    }

    #[test]
    fn kl_loss_coef_is_our_kl_coef_and_the_reward_kl_is_refused() {
        let on = build_set(&[
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        ])
        .unwrap();
        assert_eq!(on.spec.algorithm.kl_coef, 0.001);
        assert_eq!(on.spec.algorithm.kl_loss_type, KlLossType::LowVarKl);

        let off = build_set(&[
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.kl_loss_coef=0.001",
        ])
        .unwrap();
        assert_eq!(off.spec.algorithm.kl_coef, 0.0);
        assert_eq!(off.ignored[0].path, "actor_rollout_ref.actor.kl_loss_coef");

        // VeRL's reward-side KL is not ours, whatever its value.
        let errors = build_set(&["algorithm.kl_ctrl.kl_coef=0.001"]).unwrap_err();
        assert_eq!(errors[0].path, "algorithm.kl_ctrl.kl_coef");
        assert!(errors[0].reason.contains("kl_loss_coef"), "{errors:?}");
        assert_eq!(
            error_paths(build_set(&["algorithm.use_kl_in_reward=True"])),
            ["algorithm.use_kl_in_reward"]
        );
        let no_reward_kl = build_set(&["algorithm.use_kl_in_reward=False"]).unwrap();
        assert_eq!(no_reward_kl.spec, RunSpec::default());

        // Defaults differ (VeRL 0.001, ours 0) and VeRL ignores a coefficient without
        // use_kl_loss: neither is guessed.
        for args in [
            &["actor_rollout_ref.actor.use_kl_loss=true"][..],
            &["actor_rollout_ref.actor.kl_loss_coef=0.01"],
        ] {
            assert_eq!(error_paths(build_set(args)).len(), 1, "{args:?}");
        }
        assert_eq!(
            error_paths(build_set(&["actor_rollout_ref.actor.kl_loss_type=abs"])),
            ["actor_rollout_ref.actor.kl_loss_type"]
        );
    }

    #[test]
    fn dr_grpo_is_grpo_without_std_normalisation() {
        let dr = build_set(&[
            "algorithm.adv_estimator=grpo",
            "algorithm.norm_adv_by_std_in_grpo=False",
        ])
        .unwrap();
        assert_eq!(dr.spec.algorithm.adv_estimator, AdvEstimator::DrGrpo);
        // grpo is the default estimator, here as in the flag's VeRL meaning.
        let dr = build_set(&["algorithm.norm_adv_by_std_in_grpo=false"]).unwrap();
        assert_eq!(dr.spec.algorithm.adv_estimator, AdvEstimator::DrGrpo);
        let grpo = build_set(&["algorithm.norm_adv_by_std_in_grpo=true"]).unwrap();
        assert_eq!(grpo.spec.algorithm.adv_estimator, AdvEstimator::Grpo);
        let rloo = build_set(&[
            "algorithm.adv_estimator=rloo",
            "algorithm.norm_adv_by_std_in_grpo=false",
        ])
        .unwrap();
        assert_eq!(rloo.spec.algorithm.adv_estimator, AdvEstimator::Rloo);
        assert_eq!(rloo.ignored.len(), 1);
        // VeRL's Dr.GRPO recipe also asks for seq-mean-token-sum-norm, which is not ours.
        assert_eq!(
            error_paths(build_set(&[
                "algorithm.norm_adv_by_std_in_grpo=false",
                "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            ])),
            ["actor_rollout_ref.actor.loss_agg_mode"]
        );
        assert_eq!(
            error_paths(build_set(&[
                "algorithm.adv_estimator=dr_grpo",
                "algorithm.norm_adv_by_std_in_grpo=true",
            ])),
            ["algorithm.norm_adv_by_std_in_grpo"]
        );
    }

    #[test]
    fn keys_without_meaning_here_are_listed_and_left_out() {
        let layered = build_set(&[
            "trainer.n_gpus_per_node=8",
            "trainer.logger=[\"console\",\"wandb\"]",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "trainer.n_gpus_per_node=4",
        ])
        .unwrap();
        let paths: Vec<_> = layered.ignored.iter().map(|k| k.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "trainer.n_gpus_per_node",
                "trainer.logger",
                "actor_rollout_ref.actor.fsdp_config.param_offload"
            ]
        );
        assert_eq!(layered.spec, RunSpec::default());
    }

    #[test]
    fn overrides_follow_the_file_and_unknown_keys_are_errors() {
        let file = toml_document("[rollout]\nn = 4\n[actor_rollout_ref.actor.optim]\nlr = 2e-6\n")
            .unwrap();
        let layered = build(
            file.clone(),
            &set(&["actor_rollout_ref.rollout.n=8", "optim.lr=5e-7"]),
        )
        .unwrap();
        assert_eq!((layered.spec.rollout.n, layered.spec.optim.lr), (8, 5e-7));

        assert_eq!(
            error_paths(build(file.clone(), &set(&["rollout.nn=3"]))),
            ["rollout.nn"]
        );
        // In a file an unknown key is the decoding error it always was.
        let file = toml_document("[rollout]\nnn = 3\n").unwrap();
        assert_eq!(error_paths(build(file, &[])), ["rollout.nn"]);
        // One setting twice in one file, by both names.
        let file = toml_document("[rollout]\nn = 4\n[actor_rollout_ref.rollout]\nn = 5\n").unwrap();
        assert_eq!(error_paths(build(file, &[])).len(), 1);
    }

    #[test]
    fn decoding_errors_name_the_key_as_written() {
        let errors = build_set(&["actor_rollout_ref.rollout.n=many"]).unwrap_err();
        assert_eq!(errors[0].path, "actor_rollout_ref.rollout.n");
        assert!(errors[0].reason.contains("rollout.n"), "{errors:?}");
    }

    #[test]
    fn epochs_alone_are_handed_back_and_steps_decide_when_given() {
        let layered = build_set(&["trainer.total_epochs=15"]).unwrap();
        assert_eq!(layered.total_epochs, Some(15));
        let layered =
            build_set(&["trainer.total_epochs=15", "trainer.total_training_steps=3"]).unwrap();
        assert_eq!(layered.spec.trainer.total_steps, 3);
        assert_eq!(layered.total_epochs, None);
        assert_eq!(layered.ignored[0].path, "trainer.total_epochs");
        for bad in ["trainer.total_epochs=0", "trainer.total_epochs=1.5"] {
            assert_eq!(
                error_paths(build_set(&[bad])),
                ["trainer.total_epochs"],
                "{bad}"
            );
        }
        // A client writing the spec itself has no such key: steps only.
        let errors = RunSpec::from_json_value(serde_json::json!({"trainer": {"total_epochs": 15}}))
            .unwrap_err();
        assert_eq!(errors[0].path, "trainer.total_epochs");
    }

    #[test]
    fn train_and_val_files_are_our_datasets_read_as_verl_rows() {
        let layered = build_set(&[
            "data.train_files=data/gsm8k/train.parquet",
            "data.val_files=[\"data/gsm8k/test.parquet\"]",
        ])
        .unwrap();
        let data = &layered.spec.data;
        assert_eq!(data.source, DataSource::Verl);
        assert_eq!(data.dataset, "data/gsm8k/train.parquet");
        assert_eq!(data.val_dataset, "data/gsm8k/test.parquet");
        // VeRL validates on the whole val file: no default caps it.
        assert_eq!(data.val_size, 0);
        assert!(data.validates_on_all_of_val_dataset());
        let fewer = build_set(&["data.val_files=test.parquet", "data.val_size=100"]).unwrap();
        assert_eq!(fewer.spec.data.val_size, 100);
        let explicit = build_set(&["data.train_files=t.parquet", "data.source=verl"]).unwrap();
        assert_eq!(explicit.spec.data.source, DataSource::Verl);

        for args in [
            &["data.train_files=t.parquet", "data.source=gsm8k"][..],
            &["data.train_files=t.parquet", "data.dataset=u.parquet"],
            &["data.val_files=v.parquet", "data.val_dataset=w.parquet"],
            &["data.train_files=[\"a.parquet\", \"b.parquet\"]"],
            &["data.train_files=[]"],
            &["data.train_files=\"\""],
            &["data.train_files=3"],
        ] {
            let paths = error_paths(build_set(args));
            assert_eq!(paths.len(), 1, "{args:?}: {paths:?}");
            assert!(
                paths[0].starts_with("data.") && paths[0].ends_with("_files"),
                "{paths:?}"
            );
        }
    }

    #[test]
    fn clip_ratio_is_the_fallback_of_both_bounds() {
        let both = build_set(&["actor_rollout_ref.actor.clip_ratio=0.25"]).unwrap();
        let a = &both.spec.algorithm;
        assert_eq!((a.clip_ratio_low, a.clip_ratio_high), (0.25, 0.25));
        let high_given = build_set(&[
            "actor_rollout_ref.actor.clip_ratio=0.25",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
        ])
        .unwrap();
        let a = &high_given.spec.algorithm;
        assert_eq!((a.clip_ratio_low, a.clip_ratio_high), (0.25, 0.28));
        let ours_given = build_set(&[
            "actor_rollout_ref.actor.clip_ratio=0.25",
            "algorithm.clip_ratio_low=0.1",
            "algorithm.clip_ratio_high=0.3",
        ])
        .unwrap();
        let a = &ours_given.spec.algorithm;
        assert_eq!((a.clip_ratio_low, a.clip_ratio_high), (0.1, 0.3));
        assert_eq!(
            ours_given.ignored[0].path,
            "actor_rollout_ref.actor.clip_ratio"
        );
        // A bad value is reported under the key the user wrote.
        let errors = build_set(&["actor_rollout_ref.actor.clip_ratio=wide"]).unwrap_err();
        assert_eq!(errors[0].path, "actor_rollout_ref.actor.clip_ratio");
    }
}
