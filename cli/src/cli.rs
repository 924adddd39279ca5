//! The command-line grammar of `arl` (clap definitions only).

use std::path::PathBuf;

use arl_schemas::spec_layers::Override;
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "arl",
    version,
    about = "Train LLM agents with RL on real, sandboxed tasks"
)]
pub struct Cli {
    #[command(flatten)]
    pub bus: BusArgs,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct BusArgs {
    /// NATS server of the ARL deployment.
    #[arg(
        long,
        global = true,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,

    /// Namespace prefix of the deployment (empty for none).
    #[arg(long, global = true, env = "ARL_PREFIX", default_value = "")]
    pub prefix: String,

    #[command(flatten)]
    pub nats: arl_runtime::auth::NatsAuth,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Submit, inspect and follow training runs.
    #[command(subcommand)]
    Run(RunCommand),
    /// Inspect a model and run it on CPU: what you reach for when debugging token truth.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Check a dataset before you train on it.
    #[command(subcommand)]
    Dataset(DatasetCommand),
    /// Start every ARL service on this machine (and a private nats-server when NATS_URL
    /// is not set); runs until Ctrl-C.
    Up(UpArgs),
    /// Environment images in a registry, as the image builder sees them.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Run services in this process: `arl serve SERVICE [FLAGS…] [+ SERVICE [FLAGS…]]…`,
    /// each with the flags of its `arl-<service>` binary (`arl serve rollout --help`).
    Serve(ServeArgs),
}

#[derive(Debug, Subcommand)]
pub enum DatasetCommand {
    /// What SWE-bench's harness does with the gold predictions, for a run spec's tasks:
    /// build every task's environment, grade its reference solution (SWE-bench's gold
    /// patch, a Harbor task's solution/solve.sh) — which must resolve it — and an empty
    /// patch — which must not. Prints a table (or JSON lines) and exits 1 naming every bad
    /// task. Math tasks have nothing to build: their answers are checked to parse and to
    /// match.
    Validate(ValidateArgs),
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The run spec (TOML or JSON) whose data to check — data.dataset, data.source,
    /// data.task_ids — read as `arl run submit` reads it.
    pub spec: PathBuf,
    /// Set one key after the file, as `arl run submit --set` does (e.g.
    /// `--set 'data.task_ids=["django__django-11880"]'`). Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_override)]
    pub overrides: Vec<Override>,
    /// One JSON object per task per line, then a summary object.
    #[arg(long)]
    pub json: bool,
    /// Tasks checked at once (default: this machine's cores).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// SWE-bench instances with recorded setup and test commands (`instances.json`);
    /// repeatable. They override what SWE-bench's specs give the other instances.
    #[arg(long = "swebench-recipes", env = "ARL_SWEBENCH_RECIPES")]
    pub swebench_recipes: Vec<PathBuf>,
    /// Bare repositories (`<name>.git`, e.g. `django.git`) holding the instances' base
    /// commits (default: `repos/` beside the instances file); a repository missing there
    /// is cloned from GitHub by the build.
    #[arg(long = "swebench-repos", env = "ARL_SWEBENCH_REPOS")]
    pub swebench_repos: Option<PathBuf>,
    /// Where environments are built and kept for the next validation (default:
    /// `arl-environments` in the temporary folder). The sandbox user must be able to reach it.
    #[arg(long, env = "ARL_ENVIRONMENTS_DIR")]
    pub environments_dir: Option<PathBuf>,
    /// pyenv's root, where the interpreters SWE-bench instances name are found.
    #[arg(long, env = "PYENV_ROOT")]
    pub pyenv_root: Option<PathBuf>,
    /// pip's cache, shared by builds.
    #[arg(long, env = "PIP_CACHE_DIR")]
    pub pip_cache: Option<PathBuf>,
    /// An environment build running longer is stopped and reported.
    #[arg(long, default_value_t = 1800)]
    pub build_timeout_s: u64,
    /// A test run (or a Harbor solution) running longer is stopped and reported.
    #[arg(long, default_value_t = 1800)]
    pub test_timeout_s: u64,
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Whether `<registry>/<namespace>/<name>:latest` exists (the image builder's own
    /// check): prints the reference pinned by digest; exit 4 when it is not there.
    Check {
        /// The registry's base URL, e.g. http://registry:5000.
        #[arg(long, env = "ARL_REGISTRY")]
        registry: String,
        #[arg(long, default_value = "swebench")]
        namespace: String,
        #[arg(long, env = "ARL_REGISTRY_USER", requires = "password")]
        user: Option<String>,
        #[arg(
            long,
            env = "ARL_REGISTRY_PASSWORD",
            hide_env_values = true,
            requires = "user"
        )]
        password: Option<String>,
        /// The image's name under the namespace (a task's instance id).
        name: String,
    },
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// controller, dataset, evaluator, imagebuilder, inference, proxy, reward, rollout,
    /// sandbox or trainer, each followed by its own flags; `+` between services.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "SERVICE [FLAGS]… [+ SERVICE [FLAGS]…]"
    )]
    pub services: Vec<String>,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Where the JetStream store, environments, sandboxes, checkpoints and logs live.
    #[arg(long, default_value = "arl-state")]
    pub state_dir: PathBuf,
    /// The model the embedded engine serves (a path or an installed model's name).
    #[arg(long, env = "ARL_MODEL", default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// SWE-bench instances with setup and test commands (`instances.json`); repeatable.
    #[arg(long = "swebench-recipes")]
    pub swebench_recipes: Vec<PathBuf>,
    /// A venv of third-party agents (mini-swe-agent), mounted into every sandbox.
    #[arg(long)]
    pub agents_dir: Option<PathBuf>,
    /// Trials run at once. Trials mostly wait on the engine, which decodes them as one
    /// batch (up to its 16 sequences), so this matches the engine's batch.
    #[arg(long, default_value_t = 16)]
    pub rollout_concurrency: usize,
    /// Seconds to wait for every service to be ready before giving up.
    #[arg(long, default_value_t = 600)]
    pub ready_timeout_s: u64,
    /// Run the private nats-server on least privilege: one NKey user per service (and one
    /// for the CLI, `<state>/nats/cli.nk`) that may publish and read only its own subjects.
    #[arg(long)]
    pub least_privilege: bool,
    /// Start a trace UI (Arize Phoenix, from PyPI `arize-phoenix`: `make observability`
    /// installs it) and send every service's spans to it over OTLP/HTTP; its address is
    /// printed. The `phoenix` program is ARL_PHOENIX, else `phoenix` on PATH.
    #[arg(long)]
    pub traces: bool,
    /// Restart a service, or the private nats-server, that exits — however it exits,
    /// SIGKILL included — with the same arguments, after a backoff (1 s, doubling to 10 s;
    /// back to 1 s once it stayed up 60 s); each restart is printed with the exit status.
    /// The nats-server keeps its port and store and syncs every JetStream write before
    /// acknowledging it (`sync_interval: always`). Without it, a service that exits stops
    /// everything. Either way `<state>/pids/<name>` holds each running child's pid.
    #[arg(long)]
    pub supervise: bool,
}

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Architecture, sizes, tokenizer and chat template of a GGUF file or HF folder.
    Info {
        /// A GGUF file, a Hugging Face folder, or an installed model's name.
        path: String,
    },
    /// Generate a continuation (greedy unless --temperature is given).
    Generate {
        path: String,
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt as a user message in the model's chat template.
        #[arg(long)]
        chat: bool,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Per-token log-probabilities of a JSON array of token ids, each given its prefix.
    Logprobs {
        path: String,
        /// A file holding a JSON array of token ids (`-` for standard input).
        #[arg(long)]
        tokens: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum RunCommand {
    /// Validate a run spec (TOML or JSON) and submit it; prints the run id. Keys may be
    /// ARL's or VeRL's (README lists the aliases).
    Submit {
        /// The run spec file; without it the spec starts from every key's default.
        spec: Option<PathBuf>,
        /// Set one key after the file, like a Hydra override: a dotted key (ARL's or
        /// VeRL's) and a TOML value (bare words are strings). Repeatable; a later one wins.
        #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_override)]
        overrides: Vec<Override>,
        /// Refuse VeRL keys that mean nothing in ARL instead of warning about them.
        #[arg(long)]
        strict: bool,
        /// Print the spec that would be submitted (JSON) and submit nothing.
        #[arg(long)]
        dry_run: bool,
        /// Skip the checks that the model and dataset exist on this machine (when the
        /// controller runs elsewhere and sees other files).
        #[arg(long)]
        skip_resource_check: bool,
        /// Wait until the controller has accepted or rejected the run.
        #[arg(long)]
        wait: bool,
    },
    /// Stop a run: no new trials start, trials in flight stop and give their sandboxes
    /// back, and the run ends `cancelled`.
    Cancel {
        run_id: String,
        /// Why, for the run's record.
        #[arg(long, default_value = "")]
        reason: String,
        /// Wait until the controller has ended the run.
        #[arg(long)]
        wait: bool,
    },
    /// Start a new run from a checkpoint of RUN: its weights and optimizer state after
    /// step N, its spec (changed by any `--set`), and steps N+1 onwards with the batches
    /// and learning rates RUN would have had. Prints the new run's id.
    Resume {
        run_id: String,
        /// The checkpoint: `step-N` (a step RUN saved with optimizer state: every
        /// trainer.save_every steps).
        #[arg(long = "from", value_name = "step-N", value_parser = parse_step)]
        from: u32,
        /// Change a key of RUN's spec, as `arl run submit --set` (e.g.
        /// `trainer.total_steps=12` to train longer, `optim.lr=1e-5`).
        #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_override)]
        overrides: Vec<Override>,
        /// Wait until the controller has accepted or rejected the new run.
        #[arg(long)]
        wait: bool,
    },
    /// Show a run's state.
    Status {
        run_id: String,
        /// Print the state as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Follow a run with a live progress bar until it ends.
    Watch {
        run_id: String,
        /// Give up after this many seconds (0 = never).
        #[arg(long, default_value_t = 0)]
        timeout_s: u64,
    },
    /// Write the run's reward curve (mean reward per step, resolution rate per
    /// evaluation) as an SVG image.
    Plot {
        run_id: String,
        #[arg(long, default_value = "reward-curve.svg")]
        out: PathBuf,
    },
    /// List every run of the deployment.
    List {
        #[arg(long)]
        json: bool,
    },
}

/// Reads `step-N` (or a bare `N`).
fn parse_step(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix("step-").unwrap_or(text);
    digits
        .parse::<u32>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            format!("expected step-N with N ≥ 1 (as `arl run status` lists steps), got {text:?}")
        })
}

/// Reads one `--set KEY=VALUE`.
fn parse_override(text: &str) -> Result<Override, String> {
    text.parse()
        .map_err(|e: arl_schemas::FieldError| e.to_string())
}
