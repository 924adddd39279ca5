//! `arl-fuzz-seeds DIR`: writes every fuzz target's seeds to `DIR/<target>/seed-<n>`, the
//! corpus `make fuzz` starts cargo-fuzz from.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: arl-fuzz-seeds DIR");
        return ExitCode::from(2);
    };
    for target in arl_fuzz::TARGETS {
        let folder = dir.join(target.name);
        let written = std::fs::create_dir_all(&folder).and_then(|()| {
            for (n, seed) in (target.seeds)().iter().enumerate() {
                std::fs::write(folder.join(format!("seed-{n}")), seed)?;
            }
            Ok(())
        });
        if let Err(err) = written {
            eprintln!("arl-fuzz-seeds: {}: {err}", folder.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
