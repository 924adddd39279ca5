//! `arl-trainer`: GRPO on CPU or an NVIDIA GPU.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_trainer::hosted::Trainer>()
}
