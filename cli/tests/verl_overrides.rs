//! `arl run submit --dry-run` with VeRL's own command line: the keys of VeRL's GSM8K GRPO
//! example (examples/grpo_trainer/run_qwen2-7b_math.sh), given through `--set` unchanged,
//! become the spec a VeRL user expects — its parquet files read as VeRL's rows, its epochs
//! turned into steps over the training split; its placement and logging keys are listed as
//! meaningless here, and refused with `--strict`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Output};

use arl_testkit::verl::{GSM8K_TEST, GSM8K_TRAIN, VerlRow, write_verl_parquet};

/// VeRL's example with total_training_steps as well (which then decides, as in VeRL), and
/// without its parquet files (the next test has them).
const VERL_GSM8K_GRPO: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=[\"console\",\"wandb\"]",
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
    "trainer.total_training_steps=100",
];

fn dry_run(extra: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_arl"));
    command.args(["run", "submit", "--dry-run", "--skip-resource-check"]);
    for key in VERL_GSM8K_GRPO {
        command.args(["--set", key]);
    }
    command.args(extra).output().unwrap()
}

#[test]
fn verl_gsm8k_grpo_command_line_becomes_our_spec() {
    let output = dry_run(&[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let spec: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let expected = [
        ("/algorithm/adv_estimator", serde_json::json!("grpo")),
        ("/data/train_batch_size", 1024.into()),
        ("/rollout/max_response_tokens", 1024.into()),
        ("/model/path", "/models/Qwen2-7B-Instruct".into()),
        ("/optim/lr", 1e-6.into()),
        ("/trainer/ppo_mini_batches", 4.into()),
        ("/algorithm/kl_coef", 0.001.into()),
        ("/algorithm/kl_loss_type", "low_var_kl".into()),
        ("/algorithm/entropy_coeff", 0.0.into()),
        ("/rollout/n", 5.into()),
        ("/trainer/save_every", 20.into()),
        ("/trainer/eval_every", 5.into()),
        ("/trainer/total_steps", 100.into()),
        ("/trainer/activation_checkpointing", true.into()),
    ];
    for (pointer, value) in expected {
        assert_eq!(spec.pointer(pointer), Some(&value), "{pointer}");
    }
    for key in [
        "trainer.n_gpus_per_node",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "data.max_prompt_length",
        "trainer.total_epochs",
    ] {
        assert!(stderr.contains(key), "{key} not in the warning: {stderr}");
    }
}

#[test]
fn strict_refuses_keys_without_meaning_and_unknown_keys_are_named() {
    let strict = dry_run(&["--strict"]);
    assert_eq!(strict.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&strict.stderr);
    assert!(stderr.contains("trainer.n_gpus_per_node"), "{stderr}");

    let unknown = dry_run(&["--set", "actor_rollout_ref.actor.ppo_epochz=2"]);
    assert_eq!(unknown.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        stderr.contains("actor_rollout_ref.actor.ppo_epochz"),
        "{stderr}"
    );

    let reward_kl = dry_run(&["--set", "algorithm.kl_ctrl.kl_coef=0.001"]);
    assert_eq!(reward_kl.status.code(), Some(2));
}

/// The example as VeRL's README gives it, its files and model set to ours: the dataset
/// `keys` name, a model installed in `model_dir`. No step count: the epochs decide.
fn verl_example(train: &str, val: &str) -> Vec<String> {
    let keys = [
        "algorithm.adv_estimator=grpo",
        &format!("data.train_files={train}"),
        &format!("data.val_files={val}"),
        "data.train_batch_size=4",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        "actor_rollout_ref.model.path=smollm2-135m-instruct",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=[\"console\",\"wandb\"]",
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ];
    keys.iter()
        .flat_map(|k| ["--set".to_owned(), (*k).to_owned()])
        .collect()
}

/// VeRL's GSM8K files in `dir` (5 train rows, 2 test rows) and a model folder where
/// `smollm2-135m-instruct` is installed (a GGUF header: admission reads no more).
fn verl_files(dir: &Path) {
    write_verl_parquet(
        &dir.join("train.parquet"),
        &VerlRow::gsm8k_split("train", GSM8K_TRAIN),
    )
    .unwrap();
    write_verl_parquet(
        &dir.join("test.parquet"),
        &VerlRow::gsm8k_split("test", GSM8K_TEST),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("models")).unwrap();
    std::fs::write(
        dir.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        b"GGUF\x03\0\0\0",
    )
    .unwrap();
}

/// `arl run submit --dry-run` in `dir` (resource checks on, models from `dir/models`).
fn submit_in(dir: &Path, args: &[String], extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arl"))
        .current_dir(dir)
        .env("ARL_MODEL_DIR", dir.join("models"))
        .args(["run", "submit", "--dry-run"])
        .args(args)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn verl_gsm8k_example_with_its_parquet_files_and_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().canonicalize().unwrap();
    verl_files(&dir);
    // Relative, as in VeRL's scripts: resolved against the current folder.
    let output = submit_in(&dir, &verl_example("train.parquet", "test.parquet"), &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let spec: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let path = |name: &str| serde_json::Value::from(dir.join(name).to_str().unwrap());
    let expected = [
        ("/data/source", serde_json::json!("verl")),
        ("/data/dataset", path("train.parquet")),
        ("/data/val_dataset", path("test.parquet")),
        // All of the validation file, as VeRL validates.
        ("/data/val_size", 0.into()),
        ("/data/train_batch_size", 4.into()),
        ("/algorithm/adv_estimator", "grpo".into()),
        ("/algorithm/kl_coef", 0.001.into()),
        ("/algorithm/kl_loss_type", "low_var_kl".into()),
        ("/rollout/n", 5.into()),
        ("/rollout/max_response_tokens", 1024.into()),
        ("/model/path", "smollm2-135m-instruct".into()),
        ("/optim/lr", 1e-6.into()),
        ("/trainer/ppo_mini_batches", 2.into()),
        ("/trainer/eval_every", 5.into()),
        ("/trainer/save_every", 20.into()),
        // 15 epochs × ceil(5 training tasks ÷ 4 per batch).
        ("/trainer/total_steps", 30.into()),
    ];
    for (pointer, value) in expected {
        assert_eq!(spec.pointer(pointer), Some(&value), "{pointer}");
    }
    assert_eq!(spec.pointer("/trainer/total_epochs"), None);
    assert!(
        stderr.contains("trainer.total_steps = 30 (trainer.total_epochs 15 × ceil(5 training tasks ÷ data.train_batch_size 4) = 15 × 2"),
        "the derivation is shown: {stderr}"
    );
    for key in [
        "trainer.n_gpus_per_node",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
        "data.filter_overlong_prompts",
        "trainer.logger",
    ] {
        assert!(stderr.contains(key), "{key} not in the warning: {stderr}");
    }
    assert!(
        !stderr.contains("trainer.total_epochs ("),
        "epochs are used, not ignored: {stderr}"
    );

    let strict = submit_in(
        &dir,
        &verl_example("train.parquet", "test.parquet"),
        &["--strict"],
    );
    assert_eq!(strict.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&strict.stderr);
    assert!(stderr.contains("trainer.n_gpus_per_node"), "{stderr}");
}

#[test]
fn epochs_need_a_dataset_this_machine_can_read() {
    let dir = tempfile::tempdir().unwrap();
    verl_files(dir.path());
    let missing = submit_in(
        dir.path(),
        &verl_example("gone.parquet", "test.parquet"),
        &["--skip-resource-check"],
    );
    assert_eq!(missing.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("trainer.total_epochs") && stderr.contains("trainer.total_training_steps"),
        "{stderr}"
    );
    // With admission's check, a missing validation file is named as what it is.
    let no_val = submit_in(
        dir.path(),
        &verl_example("train.parquet", "gone.parquet"),
        &[],
    );
    assert_eq!(no_val.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&no_val.stderr);
    assert!(
        stderr.contains("data.val_dataset") && stderr.contains("gone.parquet"),
        "{stderr}"
    );
}
