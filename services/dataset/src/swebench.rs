//! SWE-bench rows with the official field names, from JSONL, JSON, Arrow IPC or Parquet. `FAIL_TO_PASS` and `PASS_TO_PASS` are
//! JSON-encoded lists of test names (strings holding JSON), as in the dataset.

use std::path::Path;

use crate::{LoadError, Loaded, RowError, json_rows, read, sha256_hex};

#[derive(Clone, Debug, PartialEq)]
pub struct SweRow {
    pub instance_id: String,
    pub repo: String,
    pub base_commit: String,
    pub problem_statement: String,
    pub version: String,
    /// The gold patch.
    pub patch: String,
    pub test_patch: String,
    pub fail_to_pass: Vec<String>,
    pub pass_to_pass: Vec<String>,
}

/// What a dataset file must hold: full rows (to train and grade), or ids and problems only
/// (some published subsets leave the tests out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completeness {
    Full,
    ProblemsOnly,
}

pub fn load(path: &Path, completeness: Completeness) -> Result<Loaded<SweRow>, LoadError> {
    let bytes = read(path)?;
    let digest = sha256_hex(&bytes);
    let file = path.display().to_string();
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let parsed_rows = match path.extension().and_then(|e| e.to_str()) {
        Some("arrow" | "parquet") => crate::tabular::rows(path, &bytes)?,
        _ => json_rows(path, &bytes)?,
    };
    for (row, parsed) in parsed_rows {
        let error = |field: &str, reason: String| RowError {
            file: file.clone(),
            row: row.clone(),
            field: field.to_owned(),
            reason,
        };
        let map = match parsed {
            Ok(map) => map,
            Err(reason) => {
                errors.push(error("", reason));
                continue;
            }
        };
        let text = |field: &str, required: bool| -> Result<String, RowError> {
            match map.get(field) {
                Some(serde_json::Value::String(s)) if !(required && s.trim().is_empty()) => {
                    Ok(s.clone())
                }
                Some(serde_json::Value::String(_)) => Err(error(field, "is empty".into())),
                None if !required => Ok(String::new()),
                None => Err(error(field, "is missing".into())),
                Some(other) => Err(error(field, format!("must be a string, got {other}"))),
            }
        };
        let tests = |field: &str| -> Result<Vec<String>, RowError> {
            if completeness == Completeness::ProblemsOnly && !map.contains_key(field) {
                return Ok(Vec::new());
            }
            let encoded = text(field, true)?;
            serde_json::from_str::<Vec<String>>(&encoded).map_err(|e| {
                error(
                    field,
                    format!("must be a JSON-encoded list of test names: {e}"),
                )
            })
        };
        let full = completeness == Completeness::Full;
        let parsed = (|| {
            let instance_id = text("instance_id", true)?;
            if !instance_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
            {
                return Err(error(
                    "instance_id",
                    format!("{instance_id:?} has characters outside [A-Za-z0-9._-]"),
                ));
            }
            let base_commit = text("base_commit", true)?;
            if base_commit.len() != 40 || !base_commit.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(error(
                    "base_commit",
                    format!("{base_commit:?} is not a 40-hex commit id"),
                ));
            }
            let row = SweRow {
                repo: text("repo", true)?,
                problem_statement: text("problem_statement", true)?,
                version: text("version", full)?,
                patch: text("patch", full)?,
                test_patch: text("test_patch", full)?,
                fail_to_pass: tests("FAIL_TO_PASS")?,
                pass_to_pass: tests("PASS_TO_PASS")?,
                instance_id,
                base_commit,
            };
            if full && row.fail_to_pass.is_empty() {
                return Err(error(
                    "FAIL_TO_PASS",
                    "is empty: nothing would tell a fix from no fix".into(),
                ));
            }
            Ok(row)
        })();
        match parsed {
            Ok(r) if !seen.insert(r.instance_id.clone()) => {
                errors.push(error(
                    "instance_id",
                    format!("{} appears twice", r.instance_id),
                ));
            }
            Ok(r) => rows.push(r),
            Err(e) => errors.push(e),
        }
    }
    Ok(Loaded {
        rows,
        errors,
        digest,
    })
}
