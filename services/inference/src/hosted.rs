//! `arl-inference` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::net::SocketAddr;

use arl_model::load::LoadedModel;
use arl_runtime::args::model_path_or_name;
use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_schemas::RunId;

use crate::api::{self, AppState, InferenceMetrics};
use crate::device::{Device, DeviceKind, GpuMemory};
use crate::engine::{EngineConfig, EngineHandle, ServedModel, SwapPolicy};

/// `arl-inference`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Initial weights (GGUF file, Hugging Face folder, or an installed model name), served
    /// as policy version 0. Without it the server answers 503 until a version is published.
    #[arg(long, env = "ARL_MODEL")]
    model: Option<String>,

    /// The name `/v1/models` reports first and responses carry; requests may also name
    /// the model by its `--model`.
    #[arg(long, default_value = "policy")]
    served_model_name: String,

    /// Address of the OpenAI API (and of /health and /metrics).
    #[arg(long, env = "ARL_INFERENCE_ADDR", default_value = "127.0.0.1:8100")]
    listen: SocketAddr,

    /// Follow only this run's `weights.published` (default: every run's).
    #[arg(long)]
    run: Option<String>,

    /// The only folder policy versions are loaded from: the trainer's --runs-dir for
    /// versions published as folders (a `weights.published` naming a folder elsewhere is
    /// refused), and where versions published through the object store are fetched to
    /// (`<dir>/<run_id>/version-<N>/`). Default: $ARL_RUNS_DIR, else ~/.cache/arl/runs.
    #[arg(long)]
    weights_dir: Option<std::path::PathBuf>,

    /// Durable consumer name for weight events (one per engine instance).
    #[arg(long, default_value = "inference")]
    instance: String,

    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    #[arg(long, default_value_t = 64)]
    queue_limit: usize,
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    #[arg(long, default_value_t = 8192)]
    max_model_len: usize,
    /// In-flight requests when weights change: finish on their version, or abort.
    #[arg(long, value_enum, default_value_t = SwapPolicy::Finish)]
    swap_policy: SwapPolicy,
    /// Sessions (`user` or `x-session-id`) whose KV cache is kept between turns.
    #[arg(long, default_value_t = 32)]
    session_cache: usize,
    /// Prompt tokens whose KV caches are kept so that later requests sharing a prefix with
    /// them (a GRPO group's trials, a common system prompt) skip its prefill; 0 turns it
    /// off. SmolLM2-135M holds 46 KiB per token.
    #[arg(long, default_value_t = 16_384)]
    prefix_cache_tokens: usize,
    /// Threads of the CPU kernels; default: the cores this process may use (its CPU
    /// affinity and cgroup quota).
    #[arg(long, env = "ARL_THREADS")]
    threads: Option<usize>,
    /// What runs the model: the CPU, or a GPU (weights and KV caches in its memory;
    /// sampling stays on the CPU).
    #[arg(long, value_enum, env = "ARL_INFERENCE_DEVICE", default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// The GPU to use with --device cuda (CUDA ordinal).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// With --device cuda: the fraction of the GPU's memory this engine may use in all
    /// (weights, room for one more version, a step's workspace, and the KV cache, which
    /// takes the rest), as vLLM's flag; other processes' memory counts against it.
    #[arg(long, default_value_t = 0.9, value_parser = fraction)]
    gpu_memory_utilization: f64,
    /// With --device cuda: the KV cache's size in GiB, instead of what
    /// --gpu-memory-utilization leaves. Requests wait for room in it.
    #[arg(long)]
    kv_cache_memory: Option<f64>,
}

/// A fraction in (0, 1].
fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!(
            "expected a fraction above 0 and at most 1, got {text:?}"
        )),
    }
}

/// The inference service, for `arl_runtime::host`.
pub struct Inference;

impl Service for Inference {
    const NAME: &'static str = "inference";
    const ABOUT: &'static str =
        "ARL inference: an OpenAI-compatible engine with token ids, logprobs and versioned weights";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        // Each step frees and re-allocates gigabytes of activations: keep them in the
        // process; and size the kernels' threads.
        let threads =
            arl_model::ops::prepare_process(args.threads).map_err(|e| format!("--threads: {e}"))?;
        tracing::info!(threads, "CPU kernels sized");
        let run = args
            .run
            .as_deref()
            .map(RunId::new)
            .transpose()
            .map_err(|e| format!("--run: {e}"))?;
        let memory = GpuMemory {
            utilization: args.gpu_memory_utilization,
            kv_cache_bytes: args
                .kv_cache_memory
                .map(|gib| {
                    if gib > 0.0 && gib.is_finite() {
                        Ok((gib * (1u64 << 30) as f64) as usize)
                    } else {
                        Err(format!(
                            "--kv-cache-memory: expected GiB above 0, got {gib}"
                        ))
                    }
                })
                .transpose()?,
            max_batch: args.max_batch.max(1),
            prefill_chunk: args.prefill_chunk.max(1),
        };
        let device = Device::open(args.device, args.gpu, memory)
            .map_err(|e| format!("--device {:?}: {e}", args.device))?;
        tracing::info!(device = %device.name(), "model device opened");
        let base = args.model.as_deref().map(model_path_or_name);
        let initial = match &args.model {
            Some(name) => {
                let (path, on) = (model_path_or_name(name), device.clone());
                let served = tokio::task::spawn_blocking(move || {
                    let loaded = LoadedModel::open(&path).map_err(|e| e.to_string())?;
                    ServedModel::new(None, 0, loaded, &on).map_err(|e| e.to_string())
                })
                .await?
                .map_err(|e| format!("loading {name}: {e}"))?;
                Some(served)
            }
            None => None,
        };
        let config = EngineConfig {
            max_batch: args.max_batch.max(1),
            queue_limit: args.queue_limit,
            prefill_chunk: args.prefill_chunk.max(1),
            max_model_len: args.max_model_len,
            swap_policy: args.swap_policy,
            session_cache: args.session_cache,
            prefix_cache_tokens: args.prefix_cache_tokens,
            device,
        };
        let engine = EngineHandle::start(config, initial)
            .map_err(|e| format!("starting the engine thread: {e}"))?;
        crate::weights::follow(
            &ctx.bus,
            engine.clone(),
            &args.instance,
            run.as_ref(),
            args.weights_dir
                .unwrap_or_else(arl_runtime::args::default_runs_dir),
            base,
            &ctx.shutdown,
        );
        let metrics = InferenceMetrics::register(&ctx.metrics, &args.served_model_name, &engine);
        let aliases = args
            .model
            .iter()
            .filter(|model| **model != args.served_model_name)
            .cloned()
            .collect();
        let state = AppState {
            engine,
            model_name: args.served_model_name,
            aliases,
            metrics,
        };
        let router = api::router(state).merge(arl_runtime::http::ops_router(
            "inference",
            ctx.bus,
            ctx.metrics,
            arl_runtime::http::Readiness::always(),
        ));
        let addr = arl_runtime::http::serve(args.listen, router, &ctx.shutdown)
            .await
            .map_err(|e| format!("--listen {}: {e}", args.listen))?;
        tracing::info!(%addr, "inference serving");
        println!("listening on http://{addr}");
        Ok(Ops::Own)
    }
}
