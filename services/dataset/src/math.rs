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

/// The final answer of a GSM8K solution (`… #### 1,234` → `1234`).
pub fn final_answer(solution: &str) -> Option<String> {
    let (_, tail) = solution.rsplit_once("####")?;
    let number = tail.trim().replace([',', '$'], "");
    let valid = !number.is_empty()
        && number
            .trim_start_matches('-')
            .chars()
            .all(|c| c.is_ascii_digit() || c == '.')
        && number.chars().filter(|c| *c == '.').count() <= 1;
    valid.then(|| {
        number
            .strip_suffix(".0")
            .map(str::to_owned)
            .unwrap_or(number)
    })
}

pub fn load(path: &Path) -> Result<Loaded<MathTask>, LoadError> {
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
