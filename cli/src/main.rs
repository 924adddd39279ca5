//! `arl`: the command line of ARL.
//!
//! Exit codes: 0 success; 1 the run was rejected or failed (or a dataset has bad tasks);
//! 2 bad usage, an invalid spec or an unreadable dataset; 3 the bus (or another part this
//! machine must start) could not be reached or refused; 4 no such run; 5 timed out waiting.

mod cli;
mod epochs;
mod image;
mod model;
mod natsconf;
mod run;
mod serve;
mod up;
mod validate;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // `arl up` starts a private nats-server unless NATS_URL says where one is.
    let nats_url_given = std::env::var_os("NATS_URL").is_some()
        || std::env::args().any(|a| a.starts_with("--nats-url"));
    let cli = cli::Cli::parse();
    // `arl serve` runs services on the runtime's host (its own async runtime).
    if let cli::Command::Serve(args) = &cli.command {
        return serve::execute(&args.services);
    }
    let runtime = match arl_runtime::host::runtime() {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            cli::Command::Run(command) => run::execute(&cli.bus, command).await,
            cli::Command::Model(command) => model::execute(command),
            cli::Command::Dataset(cli::DatasetCommand::Validate(args)) => {
                validate::execute(args).await
            }
            cli::Command::Image(command) => image::execute(command).await,
            cli::Command::Up(args) => up::execute(&cli.bus, args, nats_url_given).await,
            cli::Command::Serve(_) => Ok(ExitCode::SUCCESS),
        }
    });
    match outcome {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err}");
            err.exit_code()
        }
    }
}
