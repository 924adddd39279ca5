//! `arl run submit --dry-run` with VeRL's own command line: the keys of VeRL's GSM8K GRPO
//! example (examples/grpo_trainer/run_qwen2-7b_math.sh), given through `--set` unchanged,
//! become the spec a VeRL user expects; its placement and logging keys are listed as
//! meaningless here, and refused with `--strict`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Output};

/// VeRL's example, less its parquet files (ARL reads datasets itself) and with
/// total_training_steps (ARL counts steps, not epochs).
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
