//! `arl-dataset`: datasets and task batches.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_dataset::hosted::Dataset>()
}
