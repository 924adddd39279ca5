//! `arl image check`: asks a registry for an environment image the way the image builder
//! does (`arl_imagebuilder::registry`), so that an image built elsewhere (`make
//! image-check`, a CI pipeline) is found exactly as the service will find it.

use std::process::ExitCode;

use arl_imagebuilder::registry::{Credentials, Registry};

use crate::cli::ImageCommand;
use crate::run::CliError;

pub async fn execute(command: ImageCommand) -> Result<ExitCode, CliError> {
    let ImageCommand::Check {
        registry,
        namespace,
        user,
        password,
        name,
    } = command;
    let credentials = match (user, password) {
        (Some(username), Some(password)) => Some(Credentials { username, password }),
        _ => None,
    };
    let registry = Registry::new(&registry, &namespace, credentials);
    let reference = registry.reference(&name);
    match registry.manifest_digest(&name).await {
        Ok(Some(digest)) if !digest.is_empty() => {
            println!("{reference}@{digest}");
            Ok(ExitCode::SUCCESS)
        }
        Ok(Some(_)) => Err(CliError::Bus(format!(
            "{reference} exists but the registry sent no Docker-Content-Digest; it cannot be pinned"
        ))),
        Ok(None) => Err(CliError::Missing(format!(
            "no image {reference}: the registry has no such manifest"
        ))),
        Err(err) => Err(CliError::Bus(err.to_string())),
    }
}
