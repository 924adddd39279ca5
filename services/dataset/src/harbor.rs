//! Harbor task folders: `task.toml`, `instruction.md`, `environment/Dockerfile`,
//! `tests/test.sh` (and optionally `solution/solve.sh`).

use std::path::{Path, PathBuf};

use crate::{LoadError, Loaded, RowError, sha256_hex};

#[derive(Clone, Debug, PartialEq)]
pub struct HarborTask {
    pub name: String,
    pub dir: PathBuf,
    pub instruction: String,
}

const REQUIRED: [&str; 4] = [
    "task.toml",
    "instruction.md",
    "environment/Dockerfile",
    "tests/test.sh",
];

pub fn load(dir: &Path) -> Result<Loaded<HarborTask>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LoadError::Read {
        path: dir.display().to_string(),
        reason: e.to_string(),
    })?;
    let mut folders: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    folders.sort();
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    let mut fingerprint = String::new();
    for folder in folders {
        let name = folder
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let missing: Vec<&str> = REQUIRED
            .iter()
            .copied()
            .filter(|f| !folder.join(f).is_file())
            .collect();
        if let Some(first) = missing.first() {
            errors.push(RowError {
                file: dir.display().to_string(),
                row: name,
                field: (*first).to_owned(),
                reason: format!("is missing (a Harbor task needs {})", REQUIRED.join(", ")),
            });
            continue;
        }
        let instruction =
            std::fs::read_to_string(folder.join("instruction.md")).unwrap_or_default();
        for file in REQUIRED {
            fingerprint.push_str(&sha256_hex(
                &std::fs::read(folder.join(file)).unwrap_or_default(),
            ));
        }
        rows.push(HarborTask {
            name,
            dir: folder,
            instruction,
        });
    }
    Ok(Loaded {
        rows,
        errors,
        digest: sha256_hex(fingerprint.as_bytes()),
    })
}
