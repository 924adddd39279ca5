//! `arl-bench-images`: time to a ready environment for the SWE-bench instances in
//! `../shared/data/swebench` — cold (nothing built; pip's cache warm after the first) and
//! cached (the second request) — through the image builder's local snapshots.
//! Arguments: instance ids to limit the run to (default: all).

use std::path::PathBuf;
use std::time::Duration;

use arl_imagebuilder::local::{LocalBuilder, LocalConfig};
use arl_imagebuilder::recipe::{Recipe, load_instances};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let data = std::env::var_os("ARL_SWEBENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/swebench")
        });
    let pyenv = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or(home.join(".pyenv"));
    let only: Vec<String> = std::env::args().skip(1).collect();
    let root = tempfile::Builder::new()
        .prefix("arl-bench-images-")
        .tempdir()?;
    let builder = LocalBuilder::new(LocalConfig {
        root: root.path().to_path_buf(),
        pyenv_root: pyenv.clone(),
        pip_cache: std::env::var_os("PIP_CACHE_DIR")
            .map(PathBuf::from)
            .unwrap_or(home.join(".cache/arl/pip")),
        timeout: Duration::from_secs(1800),
    });
    println!("\nTime to a ready environment (local snapshot, built in bubblewrap), this machine");
    println!(
        "{:<28} {:>8} {:>10} {:>10} {:>8}",
        "instance", "python", "cold s", "cached s", "ratio"
    );
    for instance in load_instances(&data.join("instances.json"))? {
        if !only.is_empty() && !only.contains(&instance.instance_id) {
            continue;
        }
        let recipe = Recipe::from_swe(&instance, &data, &pyenv)?;
        let cold = builder.ensure(&recipe).await?;
        let cached = builder.ensure(&recipe).await?;
        anyhow::ensure!(!cold.cached && cached.cached);
        println!(
            "{:<28} {:>8} {:>10.1} {:>10.4} {:>7.0}x",
            instance.instance_id,
            instance.python,
            cold.seconds,
            cached.seconds,
            cold.seconds / cached.seconds.max(1e-6)
        );
    }
    Ok(())
}
