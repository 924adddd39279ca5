//! `arl-imagebuilder` as a hosted service: its flags and how it starts (the runtime's host does
//! the rest — connection, ops endpoints, signals, drain).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arl_runtime::host::{Context, Ops, Service, StartError};
use arl_runtime::http::Readiness;

use crate::buildkit::BuildKit;
use crate::local::{LocalBuilder, LocalConfig};
use crate::recipe::load_instances;
use crate::registry::{Credentials, Registry};
use crate::service::{Cluster, ImageBuilder as ImageBuilderService, Recipes};

/// `arl-imagebuilder`'s own flags (beside the common ones).
#[derive(Debug, clap::Args)]
pub struct Args {
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

/// The imagebuilder service, for `arl_runtime::host`.
pub struct ImageBuilder;

impl Service for ImageBuilder {
    const NAME: &'static str = "imagebuilder";
    const ABOUT: &'static str = "ARL image builder: task environments";
    type Args = Args;

    async fn start(args: Args, ctx: Context) -> Result<Ops, StartError> {
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
        let mut builder = ImageBuilderService::new(ctx.bus, local, recipes)
            .with_cache_limit((args.cache_limit_gb * 1e9) as u64);
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
        builder.start(&ctx.shutdown);
        Ok(Ops::Host(Readiness::always()))
    }
}
