//! `arl-controller`: owns each run's life.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_controller::hosted::Controller>()
}
