//! `arl-imagebuilder` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::buildkit::BuildKit;
use crate::jobs::{JobBuilds, JobConfig, Polling};
use crate::local::{LocalBuilder, LocalConfig};
use crate::registry::{Credentials, Registry};
use crate::service::{Builds, Cluster, ImageBuilder as ImageBuilderService, Recipes};

/// `arl-imagebuilder`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The sandbox service's environments folder (built environments go there).
    #[arg(long, env = "ARL_ENVIRONMENTS_DIR")]
    environments_dir: PathBuf,

    /// SWE-bench instances with recorded setup commands (`instances.json` form);
    /// repeatable. They override the recipes derived from SWE-bench's specs.
    #[arg(long = "swebench-recipes")]
    swebench_recipes: Vec<PathBuf>,

    /// Bare repositories (`<name>.git`, e.g. `django.git`) holding the base commits of
    /// SWE-bench instances (default: `repos/` beside the instances file); a repository
    /// missing there is cloned from GitHub by the build.
    #[arg(long = "swebench-repos", env = "ARL_SWEBENCH_REPOS")]
    swebench_repos: Option<PathBuf>,

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
    /// Where build contexts are written (a temporary folder when not given; with
    /// `--build-jobs`, the mount point of `--contexts-claim` in this pod).
    #[arg(long, env = "ARL_CONTEXTS_DIR")]
    contexts_dir: Option<PathBuf>,

    /// Build missing images as Kubernetes Jobs (`type=image-build`, rootless BuildKit)
    /// instead of with `buildctl` here. Needs the Kubernetes API (in-cluster service
    /// account, or a kubeconfig).
    #[arg(long, requires_all = ["registry", "contexts_dir", "contexts_claim"])]
    build_jobs: bool,
    /// The namespace build Jobs run in (default: the service account's).
    #[arg(long, env = "ARL_BUILD_NAMESPACE")]
    build_namespace: Option<String>,
    /// The rootless BuildKit image build Jobs run.
    #[arg(long, default_value = "moby/buildkit:v0.23.0-rootless")]
    buildkit_image: String,
    /// The PersistentVolumeClaim mounted at `--contexts-dir`; build Jobs mount their
    /// context from it read-only.
    #[arg(long, env = "ARL_CONTEXTS_CLAIM")]
    contexts_claim: Option<String>,
    /// A `kubernetes.io/dockerconfigjson` Secret with the registry's credentials, for the
    /// build Jobs' push.
    #[arg(long, env = "ARL_REGISTRY_SECRET")]
    registry_secret: Option<String>,
    /// A build Job running longer is stopped (`activeDeadlineSeconds`) and reported as a
    /// timeout.
    #[arg(long, default_value_t = 1800)]
    build_job_timeout_s: u64,
    /// A build Job whose pod has not started after this long (an image it cannot pull, no
    /// node that fits) is given up, with the pod's waiting reason.
    #[arg(long, default_value_t = 300)]
    build_pending_timeout_s: u64,
    /// Kubernetes removes a finished build Job after this long (`ttlSecondsAfterFinished`),
    /// should the builder not have deleted it.
    #[arg(long, default_value_t = 86400)]
    build_job_ttl_s: u64,
    /// Keep failed build Jobs (until their TTL) for `kubectl logs` / `describe`.
    #[arg(long)]
    keep_failed_build_jobs: bool,

    /// Local snapshots are garbage-collected (least recently used first) above this size.
    #[arg(long, default_value_t = 50.0)]
    cache_limit_gb: f64,
}

/// The imagebuilder service, for `arl_runtime::host`.
pub struct ImageBuilder;

impl Service for ImageBuilder {
    const NAME: &'static str = "imagebuilder";
    const ABOUT: &'static str = "ARL image builder: task environments";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
        // Cluster mode first: a missing Kubernetes API is a start error before anything runs.
        let cluster = match &args.registry {
            Some(url) => Some(cluster(&args, url).await?),
            None => None,
        };
        let local_config = LocalConfig::new(
            args.environments_dir,
            args.pyenv_root,
            args.pip_cache,
            Duration::from_secs(args.build_timeout_s),
        );
        let recipes = Recipes::load(
            &args.swebench_recipes,
            args.swebench_repos.clone(),
            local_config.pyenv_root.clone(),
        )?;
        let local = Arc::new(LocalBuilder::new(local_config));
        let mut builder = ImageBuilderService::new(ctx.bus, local, recipes)
            .with_cache_limit((args.cache_limit_gb * 1e9) as u64);
        if let Some(cluster) = cluster {
            builder = builder.with_cluster(cluster);
        }
        builder.start(&ctx.shutdown);
        Ok(Ops::Host(Readiness::always()))
    }
}

/// Cluster mode's registry and builds.
async fn cluster(args: &Args, url: &str) -> Result<Cluster, StartError> {
    let credentials = match (&args.registry_user, &args.registry_password) {
        (Some(username), Some(password)) => Some(Credentials {
            username: username.clone(),
            password: password.clone(),
        }),
        _ => None,
    };
    let builds = if args.build_jobs {
        Builds::Jobs(Arc::new(job_builds(args, url).await?))
    } else {
        Builds::Buildctl(BuildKit {
            addr: args.buildkit_addr.clone(),
            buildctl: args.buildctl.clone(),
        })
    };
    Ok(Cluster {
        registry: Registry::new(url, &args.registry_namespace, credentials),
        builds,
        contexts: args
            .contexts_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("arl-build-contexts")),
    })
}

/// Build Jobs over the Kubernetes API this process finds (in-cluster service account, or a
/// kubeconfig); none found is a start error that says so.
async fn job_builds(args: &Args, registry: &str) -> Result<JobBuilds, StartError> {
    let (Some(contexts_claim), Some(_)) = (&args.contexts_claim, &args.contexts_dir) else {
        return Err(
            "--build-jobs needs --contexts-dir and --contexts-claim (the volume build \
                    contexts are written to, and its claim, which the Jobs mount)"
                .into(),
        );
    };
    let client = kube::Client::try_default().await.map_err(|e| {
        format!(
            "--build-jobs needs the Kubernetes API, and none was found ({e}): run the image \
             builder in the cluster under a service account (or give it a KUBECONFIG), or drop \
             --build-jobs to build with buildctl"
        )
    })?;
    let namespace = args
        .build_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    tracing::info!(namespace, image = %args.buildkit_image, "image builds run as Kubernetes Jobs");
    Ok(JobBuilds::new(
        client,
        JobConfig {
            namespace,
            buildkit_image: args.buildkit_image.clone(),
            contexts_claim: contexts_claim.clone(),
            registry_secret: args.registry_secret.clone(),
            insecure_registry: registry.starts_with("http://"),
            timeout: Duration::from_secs(args.build_job_timeout_s),
            pending_timeout: Duration::from_secs(args.build_pending_timeout_s),
            ttl_after_finished: Duration::from_secs(args.build_job_ttl_s),
            keep_failed: args.keep_failed_build_jobs,
            polling: Polling::default(),
        },
    ))
}
