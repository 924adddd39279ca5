//! `make gen`: writes `schemas/json/*.json` from the Rust types, and the golden example of
//! any event version that has none yet. Golden files are never rewritten: they pin what a
//! published version looks like on the wire.

use std::path::Path;

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let json_dir = root.join("json");
    let golden_dir = root.join("golden");
    std::fs::create_dir_all(&json_dir)?;
    std::fs::create_dir_all(&golden_dir)?;

    for entry in arl_schemas::catalog::all_events() {
        let stem = entry.file_stem();
        std::fs::write(
            json_dir.join(format!("{stem}.json")),
            pretty(&(entry.schema)())?,
        )?;
        let golden = golden_dir.join(format!("{stem}.json"));
        if !golden.exists() {
            std::fs::write(&golden, pretty(&(entry.example)())?)?;
            println!("new golden file {}", golden.display());
        }
    }
    for (name, schema) in arl_schemas::catalog::other_schemas() {
        std::fs::write(json_dir.join(format!("{name}.json")), pretty(&schema)?)?;
    }
    println!("schemas written to {}", json_dir.display());
    Ok(())
}

fn pretty<T: serde::Serialize>(value: &T) -> std::io::Result<String> {
    let mut text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    text.push('\n');
    Ok(text)
}
