//! `arl-proxy`: records every trial's LLM calls.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_proxy::hosted::Proxy>()
}
