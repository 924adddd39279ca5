//! `arl-evaluator`: validation resolution rate.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_evaluator::hosted::Evaluator>()
}
