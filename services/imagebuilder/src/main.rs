//! `arl-imagebuilder`: every task's environment exists before its trials start.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arl_imagebuilder::buildkit::BuildKit;
use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::load_instances;
use arl_imagebuilder::registry::{Credentials, Registry};
use arl_imagebuilder::service::{Cluster, ImageBuilder, Recipes};
use arl_runtime::{Bus, CommonArgs, Metrics, Shutdown, telemetry};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arl-imagebuilder",
    version,
    about = "ARL image builder: task environments"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,

    /// The sandbox service's environments folder (built environments go there).
    #[arg(long, env = "ARL_ENVIRONMENTS_DIR")]
    environments_dir: PathBuf,

    /// SWE-bench instances with setup commands (`instances.json` form); repeatable.
    #[arg(long = "swebench-recipes")]
    swebench_recipes: Vec<PathBuf>,

    /// pyenv's root, where the interpreters instances name are found.
    #[arg(long, env = "PYENV_ROOT")]
    pyenv_root: Option<PathBuf>,

    /// pip's cache, shared by builds.
    #[arg(long, env = "PIP_CACHE_DIR")]
    pip_cache: Option<PathBuf>,

    /// A build running longer is stopped and reported as a timeout.
    #[arg(long, default_value_t = 1800)]
    build_timeout_s: u64,

    /// Cluster mode: environments are images `{registry}/{namespace}/{instance}:latest`
    /// (e.g. `http://registry:5000`), built with BuildKit when missing.
    #[arg(long, env = "ARL_REGISTRY")]
    registry: Option<String>,
    #[arg(long, default_value = "swebench")]
    registry_namespace: String,
    #[arg(long, env = "ARL_REGISTRY_USER")]
    registry_user: Option<String>,
    #[arg(long, env = "ARL_REGISTRY_PASSWORD")]
    registry_password: Option<String>,
    /// buildkitd's address for `buildctl --addr`.
    #[arg(long, env = "BUILDKIT_HOST", default_value = "tcp://buildkitd:1234")]
    buildkit_addr: String,
    #[arg(long, default_value = "buildctl")]
    buildctl: PathBuf,

    /// Local snapshots are garbage-collected (least recently used first) above this size.
    #[arg(long, default_value_t = 50.0)]
    cache_limit_gb: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let telemetry = telemetry::init("arl-imagebuilder", telemetry::otlp_endpoint_from_env())?;
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let pyenv_root = args.pyenv_root.unwrap_or(home.join(".pyenv"));
    let mut recipes = Recipes {
        pyenv_root: pyenv_root.clone(),
        ..Recipes::default()
    };
    for file in &args.swebench_recipes {
        for instance in load_instances(file)? {
            recipes
                .swebench
                .insert(instance.instance_id.clone(), instance);
        }
        if let Some(dir) = file.parent() {
            recipes.swebench_dir = dir.to_path_buf();
        }
    }
    let local = Arc::new(LocalBuilder::new(LocalConfig {
        root: args.environments_dir,
        pyenv_root,
        pip_cache: args.pip_cache.unwrap_or(home.join(".cache/arl/pip")),
        timeout: Duration::from_secs(args.build_timeout_s),
    }));
    let metrics = Metrics::new();
    let bus = Bus::connect(args.common.bus_config("arl-imagebuilder")?, metrics.clone()).await?;
    bus.provision().await.context("provisioning streams")?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let router = arl_runtime::http::ops_router(
        "imagebuilder",
        bus.clone(),
        metrics,
        arl_runtime::http::Readiness::always(),
    );
    arl_runtime::http::serve(args.common.http_addr, router, &shutdown).await?;
    let mut builder =
        ImageBuilder::new(bus, local, recipes).with_cache_limit((args.cache_limit_gb * 1e9) as u64);
    if let Some(url) = &args.registry {
        let credentials = match (args.registry_user, args.registry_password) {
            (Some(username), Some(password)) => Some(Credentials { username, password }),
            _ => None,
        };
        builder = builder.with_cluster(Cluster {
            registry: Registry::new(url, &args.registry_namespace, credentials),
            buildkit: BuildKit {
                addr: args.buildkit_addr,
                buildctl: args.buildctl,
            },
            contexts: std::env::temp_dir().join("arl-build-contexts"),
        });
    }
    builder.start(&shutdown);
    tracing::info!("image builder running");
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    Ok(())
}
