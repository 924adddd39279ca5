//! `arl-imagebuilder`: task environments.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_imagebuilder::hosted::ImageBuilder>()
}
