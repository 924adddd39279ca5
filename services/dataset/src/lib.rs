//! Datasets: loading with a precise error per bad row (file, row, field, reason — a bad row
//! is reported, never silently dropped), a deterministic split, and per-step batches.
//!
//! - [`swebench`]: SWE-bench rows (JSONL / JSON, the official field names);
//! - [`harbor`]: Harbor task folders; [`math`]: GSM8K-style problems (`#### N` answers);
//! - [`verl`]: VeRL's preprocessed rows (chat prompts, rule-graded numeric ground truths);
//! - [`split`]: train / validation by seed, stable across machines, and step batches.

pub mod harbor;
pub mod hosted;
pub mod manifest;
pub mod math;
pub mod service;
pub mod split;
pub mod swebench;
mod tabular;
pub mod verl;

/// One problem with one row of a dataset.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{row}: {field}: {reason}")]
pub struct RowError {
    pub file: String,
    /// 1-based line (JSONL), index (JSON array) or task folder name.
    pub row: String,
    pub field: String,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {reason}")]
    Read { path: String, reason: String },
    #[error(
        "{count} invalid rows (set data.allow_invalid_rows to train on the rest); first: {first}"
    )]
    Invalid { count: usize, first: RowError },
}

/// Rows that loaded and the problems of the ones that did not.
#[derive(Debug)]
pub struct Loaded<T> {
    pub rows: Vec<T>,
    pub errors: Vec<RowError>,
    /// sha256 of the dataset's bytes (its identity in the run's events).
    pub digest: String,
}

impl<T> Loaded<T> {
    /// The rows, or an error naming the first bad row when there are any and they are
    /// not allowed.
    pub fn accept(self, allow_invalid: bool) -> Result<Self, LoadError> {
        match self.errors.first() {
            Some(first) if !allow_invalid => Err(LoadError::Invalid {
                count: self.errors.len(),
                first: first.clone(),
            }),
            _ => Ok(self),
        }
    }
}

pub(crate) use arl_runtime::digest::sha256_hex;

pub(crate) fn read(path: &std::path::Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|e| LoadError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// One row of a JSON dataset: its label and its object, or why it is not one.
pub(crate) type JsonRow = (
    String,
    Result<serde_json::Map<String, serde_json::Value>, String>,
);

/// JSON objects of a JSONL file (one per line) or a JSON array, with their row labels.
pub(crate) fn json_rows(path: &std::path::Path, bytes: &[u8]) -> Result<Vec<JsonRow>, LoadError> {
    let file = path.display().to_string();
    let object = |v: serde_json::Value| match v {
        serde_json::Value::Object(map) => Ok(map),
        _ => Err("a row must be a JSON object".to_owned()),
    };
    if path.extension().and_then(|e| e.to_str()) == Some("json") {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| LoadError::Read {
                path: file.clone(),
                reason: format!("not valid JSON: {e}"),
            })?;
        let serde_json::Value::Array(items) = value else {
            return Err(LoadError::Read {
                path: file,
                reason: "a JSON dataset must be an array of rows".into(),
            });
        };
        return Ok(items
            .into_iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), object(v)))
            .collect());
    }
    let text = std::str::from_utf8(bytes).map_err(|e| LoadError::Read {
        path: file,
        reason: format!("not UTF-8: {e}"),
    })?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let row = (i + 1).to_string();
            let parsed = serde_json::from_str::<serde_json::Value>(line)
                .map_err(|e| format!("not valid JSON: {e}"))
                .and_then(object);
            (row, parsed)
        })
        .collect())
}
