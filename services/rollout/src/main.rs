//! `arl-rollout`: trials.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_rollout::hosted::Rollout>()
}
