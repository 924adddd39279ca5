//! `arl-inference`: an OpenAI-compatible engine with token ids, logprobs and versioned weights.

fn main() -> std::process::ExitCode {
    arl_runtime::host::main::<arl_inference::hosted::Inference>()
}
