//! One service shape. A service's library implements [`Service`] — its flags, and how it
//! starts on a connected bus — and the host does the rest the same way for every service:
//! flags (the common ones beside the service's own), telemetry, the NATS connection and
//! provisioning, the ops endpoints (`/health`, `/ready`, `/metrics`), signals, and a
//! graceful drain (handlers in flight finish, telemetry is flushed last).
//!
//! Each `arl-<service>` binary is [`main`] over its service; `arl serve` hosts any set of
//! services in one process ([`serve`]), each with its own connection (its own client name
//! and credentials) but one shutdown.

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser};

use crate::http::Readiness;
use crate::{Bus, CommonArgs, Metrics, Shutdown, telemetry};

/// Why a service could not start: its own error, boxed (each service's library has its
/// own error types; the host only reports them).
pub type StartError = Box<dyn std::error::Error + Send + Sync>;

/// What a service is given to start on.
pub struct Context {
    /// Connected as `arl-<name>`, streams and buckets provisioned.
    pub bus: Bus,
    pub metrics: Metrics,
    /// Every task the service starts watches it; the host waits for them on drain.
    pub shutdown: Shutdown,
    /// The common flags (the ops address, the namespace, credentials).
    pub common: CommonArgs,
}

/// How the ops endpoints of a started service are served.
pub enum Ops {
    /// By the host on `--http-addr`, answering `/ready` with this.
    Host(Readiness),
    /// By the service itself, merged into the API it serves (the engine, the proxy, the
    /// sandbox service answer `/health` beside their own routes).
    Own,
}

/// A service the host can run.
pub trait Service {
    /// "reward": its logs, its metrics and ops name; its binary and NATS client are
    /// `arl-reward`.
    const NAME: &'static str;
    /// One line for `--help`.
    const ABOUT: &'static str;
    /// Its own flags, beside [`CommonArgs`].
    type Args: clap::Args + Send + 'static;

    /// Starts the service's work (consumers, servers) on tasks tracked by
    /// `ctx.shutdown` and returns once it runs.
    fn start(
        args: Self::Args,
        ctx: Context,
    ) -> impl Future<Output = Result<Ops, StartError>> + Send;
}

/// A service's flags as its binary takes them: the common ones and its own.
#[derive(Debug, Parser)]
#[command(version)]
pub struct Flags<A: clap::Args> {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub service: A,
}

/// A service with its flags, ready to start: what [`serve`] runs.
pub trait Planned: Send {
    fn name(&self) -> &'static str;
    /// Connects, provisions, starts the service and its ops endpoints.
    fn start(
        self: Box<Self>,
        metrics: Metrics,
        shutdown: Shutdown,
    ) -> Pin<Box<dyn Future<Output = Result<(), StartError>> + Send>>;
}

struct Plan<S: Service> {
    flags: Flags<S::Args>,
}

impl<S: Service + 'static> Planned for Plan<S>
where
    S::Args: Send,
{
    fn name(&self) -> &'static str {
        S::NAME
    }

    fn start(
        self: Box<Self>,
        metrics: Metrics,
        shutdown: Shutdown,
    ) -> Pin<Box<dyn Future<Output = Result<(), StartError>> + Send>> {
        Box::pin(async move {
            let Flags { common, service } = self.flags;
            let client = format!("arl-{}", S::NAME);
            let bus = Bus::connect(common.bus_config(&client)?, metrics.clone()).await?;
            bus.provision()
                .await
                .map_err(|e| format!("provisioning streams: {e}"))?;
            let http_addr = common.http_addr;
            let ctx = Context {
                bus: bus.clone(),
                metrics: metrics.clone(),
                shutdown: shutdown.clone(),
                common,
            };
            match S::start(service, ctx).await? {
                Ops::Host(readiness) => {
                    let router = crate::http::ops_router(S::NAME, bus, metrics, readiness);
                    let addr = crate::http::serve(http_addr, router, &shutdown)
                        .await
                        .map_err(|e| format!("--http-addr {http_addr}: {e}"))?;
                    tracing::info!(service = S::NAME, ops = %addr, "running");
                }
                Ops::Own => tracing::info!(service = S::NAME, "running"),
            }
            Ok(())
        })
    }
}

/// Parses a service's flags from `args` (the first item is the program or service name).
pub fn plan<S: Service + 'static>(
    args: impl IntoIterator<Item = String>,
) -> Result<Box<dyn Planned>, clap::Error>
where
    S::Args: Send,
{
    let name: &'static str = Box::leak(format!("arl-{}", S::NAME).into_boxed_str());
    let matches = Flags::<S::Args>::command()
        .name(name)
        .bin_name(name)
        .about(S::ABOUT)
        .try_get_matches_from(args)?;
    let flags = Flags::<S::Args>::from_arg_matches(&matches)?;
    Ok(Box::new(Plan::<S> { flags }))
}

/// Runs planned services in this process until a signal, then drains them.
pub async fn serve(services: Vec<Box<dyn Planned>>) -> Result<(), StartError> {
    let names: Vec<&'static str> = services.iter().map(|s| s.name()).collect();
    let telemetry = telemetry::init(process_name(&names), telemetry::otlp_endpoint_from_env())?;
    let metrics = Metrics::new();
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let started = async {
        for service in services {
            let name = service.name();
            service
                .start(metrics.clone(), shutdown.clone())
                .await
                .map_err(|e| format!("{name}: {e}"))?;
        }
        Ok::<(), StartError>(())
    }
    .await;
    if started.is_err() {
        shutdown.trigger();
    }
    shutdown.triggered().await;
    shutdown.wait().await;
    telemetry.shutdown().await;
    started
}

/// Telemetry's service name for a process hosting `names` (`arl-reward`, or `arl` for
/// several).
fn process_name(names: &[&'static str]) -> &'static str {
    match names {
        [one] => Box::leak(format!("arl-{one}").into_boxed_str()),
        _ => "arl",
    }
}

/// The `main` of a service's own binary: its flags from the command line, then [`serve`].
pub fn main<S: Service + 'static>() -> ExitCode
where
    S::Args: Send,
{
    let planned = match plan::<S>(std::env::args()) {
        Ok(planned) => planned,
        Err(err) => err.exit(),
    };
    run_to_exit(vec![planned])
}

/// Runs planned services on a new tokio runtime; a start-up error is printed with what to
/// do, and the process exits non-zero.
pub fn run_to_exit(services: Vec<Box<dyn Planned>>) -> ExitCode {
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let served = runtime.block_on(serve(services));
    // Every service has drained; blocking work nobody waits for any more (a read, a lookup)
    // must not hold the exit for ever, as dropping the runtime would.
    runtime.shutdown_timeout(std::time::Duration::from_secs(10));
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The multi-threaded async runtime a process runs on; when it cannot be had, the reason
/// is printed and the exit code to end with is returned.
pub fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|err| {
            eprintln!("error: cannot start the async runtime: {err}");
            ExitCode::FAILURE
        })
}

/// This machine's name as `hostname` prints it (the kernel's UTS name: in a Pod, the
/// Pod's name), else `/etc/hostname`, else `localhost`.
pub fn host_name() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|file| {
            std::fs::read_to_string(file)
                .ok()
                .map(|name| name.trim().to_owned())
                .filter(|name| !name.is_empty())
        })
        .unwrap_or_else(|| "localhost".to_owned())
}
