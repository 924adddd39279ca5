//! `arl-sandbox`: bubblewrap leases from warm pools.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_sandbox::hosted::Sandbox>()
}
