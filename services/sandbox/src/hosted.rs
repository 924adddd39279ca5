//! `arl-sandbox` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};

use crate::kube::{Kube, KubeSettings, OwnerPod};
use crate::{SandboxConfig, SandboxService};

/// Where sandboxes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// bubblewrap on this machine.
    Bwrap,
    /// Pods (or OpenKruise SandboxClaims) in a Kubernetes cluster.
    Kube,
}

/// Flags of the Kubernetes backend.
#[derive(Debug, clap::Args)]
pub struct KubeArgs {
    /// Namespace of sandbox Pods (default: this Pod's own namespace).
    #[arg(long, env = "ARL_SANDBOX_NAMESPACE")]
    kube_namespace: Option<String>,
    /// Environment images are `<registry>/<environment>:latest` (pinned by digest when a
    /// lease request names one).
    #[arg(long, env = "ARL_SANDBOX_REGISTRY")]
    kube_registry: Option<String>,
    /// An environment's image, overriding the registry's: `ENVIRONMENT=IMAGE`; repeatable.
    #[arg(long = "kube-image", value_parser = key_value)]
    kube_images: Vec<(String, String)>,
    /// An environment served from an OpenKruise SandboxSet: `ENVIRONMENT=SANDBOXSET`;
    /// repeatable.
    #[arg(long = "kube-sandboxset", value_parser = key_value)]
    kube_sandboxsets: Vec<(String, String)>,
    /// The token proxy's URL as sandbox Pods reach it (its Service).
    #[arg(long, env = "ARL_SANDBOX_PROXY_URL")]
    kube_proxy_url: Option<String>,
    /// The service account sandbox Pods run as (give it no API access).
    #[arg(long, env = "ARL_SANDBOX_SERVICE_ACCOUNT")]
    kube_service_account: Option<String>,
    /// A RuntimeClass for sandbox Pods (gVisor, Kata).
    #[arg(long)]
    kube_runtime_class: Option<String>,
    /// Image pull secrets of sandbox Pods; repeatable.
    #[arg(long = "kube-image-pull-secret")]
    kube_image_pull_secrets: Vec<String>,
    /// This service's own Pod (`metadata.name`, from the downward API): it owns every
    /// sandbox Pod, so Kubernetes deletes them when it goes.
    #[arg(long, env = "ARL_POD_NAME", requires = "kube_owner_uid")]
    kube_owner_pod: Option<String>,
    /// This service's own Pod's `metadata.uid`.
    #[arg(long, env = "ARL_POD_UID", requires = "kube_owner_pod")]
    kube_owner_uid: Option<String>,
    /// Seconds a sandbox Pod may take to run (image pull included).
    #[arg(long, default_value_t = 300)]
    kube_ready_timeout_s: u64,
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() && !value.is_empty() => {
            Ok((key.to_owned(), value.to_owned()))
        }
        _ => Err(format!("expected NAME=VALUE, got {text:?}")),
    }
}

/// The namespace a Pod runs in, from its service account's mount.
fn own_namespace() -> Option<String> {
    std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .ok()
        .map(|ns| ns.trim().to_owned())
        .filter(|ns| !ns.is_empty())
}

/// `arl-sandbox`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address of the exec and file API (port 0 picks one).
    #[arg(long, env = "ARL_SANDBOX_API_ADDR", default_value = "127.0.0.1:0")]
    api_addr: SocketAddr,
    /// Lease work trees live here; the sandbox user must be able to traverse it.
    #[arg(
        long,
        env = "ARL_SANDBOX_STATE_DIR",
        default_value = "/var/lib/arl/sandbox"
    )]
    state_dir: PathBuf,
    /// Environment snapshots: <dir>/<name>/tree.
    #[arg(
        long,
        env = "ARL_ENVIRONMENTS_DIR",
        default_value = "/var/lib/arl/environments"
    )]
    environments_dir: PathBuf,
    /// The token proxy's Unix socket, relayed into every sandbox.
    #[arg(long, env = "ARL_PROXY_SOCKET")]
    proxy_socket: Option<PathBuf>,
    /// Port of the proxy relay on each sandbox's loopback.
    #[arg(long, default_value_t = 8000)]
    proxy_port: u16,
    /// A Python venv of third-party agents (e.g. mini-swe-agent), mounted read-only at
    /// /opt/arl-agents in every sandbox.
    #[arg(long, env = "ARL_SANDBOX_AGENTS_DIR")]
    agents_dir: Option<PathBuf>,
    /// Leases at once.
    #[arg(long, default_value_t = 512)]
    max_leases: usize,
    /// Prepared trees kept per environment.
    #[arg(long, default_value_t = 2)]
    pool_min_idle: usize,
    /// Longest lease ttl, seconds.
    #[arg(long, default_value_t = 6 * 3600)]
    max_ttl_s: u64,
    /// Where sandboxes run.
    #[arg(long, env = "ARL_SANDBOX_BACKEND", value_enum, default_value_t = BackendKind::Bwrap)]
    backend: BackendKind,
    /// The exec API's URL as the rollout and reward services reach it (a cluster
    /// Service); default: the address it is bound to.
    #[arg(long, env = "ARL_SANDBOX_PUBLIC_URL")]
    public_url: Option<String>,
    #[command(flatten)]
    kube: KubeArgs,
}

/// The sandbox service, for `arl_runtime::host`.
pub struct Sandbox;

impl Service for Sandbox {
    const NAME: &'static str = "sandbox";
    const ABOUT: &'static str =
        "ARL sandbox service: leases from warm pools (bubblewrap, or Pods on Kubernetes)";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        // The sandbox's first process ships beside whichever executable hosts the service.
        let init = std::env::current_exe()?.with_file_name("arl-sandbox-init");
        let mut config = SandboxConfig::local(args.state_dir, args.environments_dir, init);
        config.proxy_socket = args.proxy_socket;
        config.proxy_port = args.proxy_port;
        config.agents_dir = args.agents_dir;
        config.max_leases = args.max_leases;
        config.pool_min_idle = args.pool_min_idle;
        config.max_ttl = Duration::from_secs(args.max_ttl_s);
        config.public_url = args.public_url.unwrap_or_default();
        let (url, instance) = match args.backend {
            BackendKind::Bwrap => {
                let service =
                    SandboxService::start_local(ctx.bus, config, args.api_addr, &ctx.shutdown)
                        .await?;
                (
                    service.public_url().to_owned(),
                    service.instance().to_owned(),
                )
            }
            BackendKind::Kube => {
                config.proxy_service_url = args.kube.kube_proxy_url.clone();
                let backend = kube_backend(args.kube, &config).await?;
                let service = SandboxService::start_with(
                    ctx.bus,
                    config,
                    Arc::new(backend),
                    args.api_addr,
                    &ctx.shutdown,
                )
                .await?;
                (
                    service.public_url().to_owned(),
                    service.instance().to_owned(),
                )
            }
        };
        tracing::info!(api = url, instance, "sandbox running");
        Ok(Ops::Own)
    }
}

/// The Kubernetes backend: the in-cluster (or kubeconfig) client and the Pods' settings.
async fn kube_backend(args: KubeArgs, config: &SandboxConfig) -> Result<Kube, StartError> {
    let namespace = args.kube_namespace.or_else(own_namespace).ok_or_else(|| {
        StartError::from(
            "--backend kube needs --kube-namespace outside a Pod (no service-account namespace)",
        )
    })?;
    let client = ::kube::Client::try_default().await.map_err(|err| {
        StartError::from(format!(
            "--backend kube: no Kubernetes client configuration (in-cluster or kubeconfig): {err}"
        ))
    })?;
    let owner = match (args.kube_owner_pod, args.kube_owner_uid) {
        (Some(name), Some(uid)) => Some(OwnerPod { name, uid }),
        _ => None,
    };
    Ok(Kube::new(
        client,
        KubeSettings {
            namespace,
            registry: args.kube_registry,
            images: args.kube_images.into_iter().collect(),
            sandboxsets: args.kube_sandboxsets.into_iter().collect(),
            instance: config.instance.clone(),
            owner,
            service_account: args.kube_service_account,
            runtime_class: args.kube_runtime_class,
            proxy_url: config.proxy_url(),
            default_limits: config.default_limits.clone(),
            ready_timeout: Duration::from_secs(args.kube_ready_timeout_s),
            image_pull_secrets: args.kube_image_pull_secrets,
        },
    ))
}
