//! `arl-reward`: grades trials.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_reward::hosted::Reward>()
}
