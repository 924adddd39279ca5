//! `arl-exporter`: the run's events to Kafka.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_exporter::hosted::Exporter>()
}
