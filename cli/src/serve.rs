//! `arl serve SERVICE [FLAGS…] [+ SERVICE [FLAGS…]]…`: any set of ARL services in this one
//! process — one executable for every service (the image a cluster runs), and colocated
//! services (`arl serve trainer + inference`) where that pays. Each service takes exactly
//! the flags of its own `arl-<service>` binary and gets its own NATS connection (client
//! name, credentials); they share one process, one shutdown and one telemetry exporter.

use std::process::ExitCode;

use arl_runtime::host::{self, Planned};

/// The services `arl serve` can host, by name.
pub const SERVICES: [&str; 11] = [
    "controller",
    "dataset",
    "evaluator",
    "exporter",
    "imagebuilder",
    "inference",
    "proxy",
    "reward",
    "rollout",
    "sandbox",
    "trainer",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ServeError {
    #[error("name a service to serve: one of {}", SERVICES.join(", "))]
    Nothing,
    #[error("no service {0:?}: serve one of {list}", list = SERVICES.join(", "))]
    Unknown(String),
    #[error(
        "{0} is named twice: a process hosts each service once (start another process for a second replica)"
    )]
    Twice(String),
}

/// Serves the services `words` name (everything after `arl serve`).
pub fn execute(words: &[String]) -> ExitCode {
    let plans = match plan(words) {
        Ok(plans) => plans,
        Err(Planning::Usage(err)) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
        // --help, --version, or a flag a service does not take: clap says which.
        Err(Planning::Flags(err)) => err.exit(),
    };
    host::run_to_exit(plans)
}

enum Planning {
    Usage(ServeError),
    Flags(clap::Error),
}

fn plan(words: &[String]) -> Result<Vec<Box<dyn Planned>>, Planning> {
    let segments = segments(words).map_err(Planning::Usage)?;
    segments
        .into_iter()
        .map(|segment| plan_one(segment).map_err(Planning::Flags))
        .collect()
}

/// Splits `a --x 1 + b --y` into `[a --x 1]` and `[b --y]`, checking the service names.
fn segments(words: &[String]) -> Result<Vec<&[String]>, ServeError> {
    let segments: Vec<&[String]> = words
        .split(|w| w == "+")
        .filter(|s| !s.is_empty())
        .collect();
    if segments.is_empty() {
        return Err(ServeError::Nothing);
    }
    let mut seen = Vec::new();
    for segment in &segments {
        let name = segment[0].as_str();
        if !SERVICES.contains(&name) {
            return Err(ServeError::Unknown(name.to_owned()));
        }
        if seen.contains(&name) {
            return Err(ServeError::Twice(name.to_owned()));
        }
        seen.push(name);
    }
    Ok(segments)
}

/// One service with its flags (the segment's first word names it).
fn plan_one(segment: &[String]) -> Result<Box<dyn Planned>, clap::Error> {
    let name = segment[0].as_str();
    let argv = std::iter::once(format!("arl-{name}")).chain(segment[1..].iter().cloned());
    match name {
        "controller" => host::plan::<arl_controller::hosted::Controller>(argv),
        "dataset" => host::plan::<arl_dataset::hosted::Dataset>(argv),
        "evaluator" => host::plan::<arl_evaluator::hosted::Evaluator>(argv),
        "exporter" => host::plan::<arl_exporter::hosted::Exporter>(argv),
        "imagebuilder" => host::plan::<arl_imagebuilder::hosted::ImageBuilder>(argv),
        "inference" => host::plan::<arl_inference::hosted::Inference>(argv),
        "proxy" => host::plan::<arl_proxy::hosted::Proxy>(argv),
        "reward" => host::plan::<arl_reward::hosted::Reward>(argv),
        "rollout" => host::plan::<arl_rollout::hosted::Rollout>(argv),
        "sandbox" => host::plan::<arl_sandbox::hosted::Sandbox>(argv),
        _ => host::plan::<arl_trainer::hosted::Trainer>(argv),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn services_and_their_flags_are_split_at_plus() {
        let line = words("trainer --gpu none + inference --model x --listen 127.0.0.1:0");
        let segments = segments(&line).unwrap();
        assert_eq!(segments.len(), 2);
        assert_eq!(segments[0], words("trainer --gpu none").as_slice());
        assert_eq!(segments[1][0], "inference");
        let names: Vec<&str> = plan(&line).ok().unwrap().iter().map(|p| p.name()).collect();
        assert_eq!(names, ["trainer", "inference"]);
    }

    #[test]
    fn unknown_missing_and_repeated_services_are_refused_with_the_list() {
        assert_eq!(segments(&[]), Err(ServeError::Nothing));
        assert_eq!(
            segments(&words("rolout")),
            Err(ServeError::Unknown("rolout".into()))
        );
        assert!(
            ServeError::Unknown("x".into())
                .to_string()
                .contains("rollout")
        );
        assert_eq!(
            segments(&words("reward + reward")),
            Err(ServeError::Twice("reward".into()))
        );
    }

    #[test]
    fn each_service_takes_its_own_flags_only() {
        assert!(plan(&words("rollout --concurrency 4")).is_ok());
        match plan(&words("rollout --model smollm2")) {
            Err(Planning::Flags(err)) => assert!(err.to_string().contains("--model"), "{err}"),
            _ => panic!("the rollout service takes no --model"),
        }
        assert!(plan(&words("proxy --backend http://127.0.0.1:1")).is_ok());
        assert!(matches!(plan(&words("proxy")), Err(Planning::Flags(_))));
    }
}
