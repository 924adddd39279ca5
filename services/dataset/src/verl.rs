//! VeRL's preprocessed datasets, as its `examples/data_preprocess/*.py` write them (Parquet
//! through `datasets`; JSONL/JSON rows of the same shape too): per row a `data_source`, the
//! chat `prompt`, an `ability`, `reward_model` {`ground_truth`, `style`} and `extra_info`
//! {`split`, `index`, …; tool variants add `tools_kwargs`, `interaction_kwargs`}.
//!
//! Each row becomes a math task whose prompt is the chat messages exactly as written, graded
//! as every ARL math task is: the final number of the answer against the ground truth,
//! normalised by [`final_answer`]. So a row loads only when that rule can grade it — a
//! `rule` style and a numeric ground truth (MATH's LaTeX answers are not); any other row is
//! a [`RowError`] naming its field, never a silently wrong grade.

use std::collections::HashMap;
use std::path::Path;

use arl_schemas::TaskId;
use arl_schemas::dataset::{ChatMessage, ChatRole, final_answer};
use serde_json::{Map, Value};

use crate::{LoadError, Loaded, RowError, json_rows, read, sha256_hex};

/// One VeRL row that ARL can run and grade.
#[derive(Clone, Debug, PartialEq)]
pub struct VerlTask {
    /// `<data_source>-<extra_info.split>-<extra_info.index>`, or, without those,
    /// `<data_source>-<file stem>-<row>`.
    pub id: String,
    /// The prompt as written.
    pub messages: Vec<ChatMessage>,
    /// The last user message (what people and logs see).
    pub question: String,
    /// The ground truth, normalised as [`final_answer`] normalises (`1,234` → `1234`).
    pub answer: String,
}

/// A problem with one field of a row: the field's path and what is wrong.
type FieldProblem = (String, String);

fn problem(field: impl Into<String>, reason: impl Into<String>) -> FieldProblem {
    (field.into(), reason.into())
}

/// Rows of a `.parquet`, `.arrow`, `.jsonl` or `.json` file in VeRL's format.
pub fn load(path: &Path) -> Result<Loaded<VerlTask>, LoadError> {
    let bytes = read(path)?;
    let digest = sha256_hex(&bytes);
    let file = path.display().to_string();
    let stem = path
        .file_stem()
        .map_or_else(|| "rows".into(), |s| s.to_string_lossy().into_owned());
    let parsed_rows = match path.extension().and_then(|e| e.to_str()) {
        Some("arrow" | "parquet") => crate::tabular::rows(path, &bytes)?,
        _ => json_rows(path, &bytes)?,
    };
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    // Task id → the row that has it: a second row with one id is an error, since the split
    // and every event name a task by its id.
    let mut seen: HashMap<String, String> = HashMap::new();
    for (row, parsed) in parsed_rows {
        let loaded = parsed
            .map_err(|reason| problem("", reason))
            .and_then(|map| task(&map, &stem, &row))
            .and_then(|task| match seen.get(&task.id) {
                Some(first) => Err(problem(
                    "extra_info",
                    format!("gives task id {:?}, which row {first} has too", task.id),
                )),
                None => {
                    seen.insert(task.id.clone(), row.clone());
                    Ok(task)
                }
            });
        match loaded {
            Ok(task) => rows.push(task),
            Err((field, reason)) => errors.push(RowError {
                file: file.clone(),
                row,
                field,
                reason,
            }),
        }
    }
    Ok(Loaded {
        rows,
        errors,
        digest,
    })
}

fn task(map: &Map<String, Value>, stem: &str, row: &str) -> Result<VerlTask, FieldProblem> {
    let data_source = match map.get("data_source") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.as_str(),
        Some(Value::String(_)) => return Err(problem("data_source", "is empty")),
        Some(other) => {
            return Err(problem(
                "data_source",
                format!("must be a string, got {other}"),
            ));
        }
        None => return Err(problem("data_source", "is missing")),
    };
    match map.get("ability") {
        None | Some(Value::Null) => {}
        Some(Value::String(a)) if a == "math" => {}
        Some(other) => {
            return Err(problem(
                "ability",
                format!(
                    "is {other}; ARL grades VeRL rows as math (the final number against \
                     reward_model.ground_truth), so only ability \"math\" rows load"
                ),
            ));
        }
    }
    let messages = messages(map.get("prompt"))?;
    let question = messages
        .iter()
        .rev()
        .find(|m| m.role == ChatRole::User)
        .map(|m| m.content.clone())
        .ok_or_else(|| problem("prompt", "has no user message"))?;
    let answer = ground_truth(map.get("reward_model"))?;
    let id = task_id(map.get("extra_info"), data_source, stem, row)?;
    // Reported here, with its row, rather than failing the whole file later.
    TaskId::new(id.as_str())
        .map_err(|e| problem("data_source", format!("makes task id {id:?}: {e}")))?;
    Ok(VerlTask {
        id,
        messages,
        question,
        answer,
    })
}

/// The chat messages of `prompt`: a non-empty list of `{role, content}` with roles of
/// OpenAI's chat format. Nothing else is sent, so nothing else may be in them.
fn messages(prompt: Option<&Value>) -> Result<Vec<ChatMessage>, FieldProblem> {
    let items = match prompt {
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => return Err(problem("prompt", "is an empty list of messages")),
        Some(other) => {
            return Err(problem(
                "prompt",
                format!("must be a list of {{role, content}} messages, got {other}"),
            ));
        }
        None => return Err(problem("prompt", "is missing")),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| message(item).map_err(|(field, why)| (format!("prompt[{i}]{field}"), why)))
        .collect()
}

fn message(item: &Value) -> Result<ChatMessage, FieldProblem> {
    let Value::Object(fields) = item else {
        return Err(problem(
            "",
            format!("must be a {{role, content}} message, got {item}"),
        ));
    };
    if let Some(other) = fields
        .keys()
        .find(|k| !matches!(k.as_str(), "role" | "content"))
    {
        return Err(problem(
            format!(".{other}"),
            "is not part of a {role, content} message, which is all ARL sends",
        ));
    }
    let role = match fields.get("role") {
        Some(Value::String(name)) => ChatRole::parse(name).ok_or_else(|| {
            let known: Vec<_> = ChatRole::ALL.iter().map(|r| r.as_str()).collect();
            problem(".role", format!("is {name:?}, not one of {known:?}"))
        })?,
        other => {
            return Err(problem(
                ".role",
                format!("must be a string, got {}", shown(other)),
            ));
        }
    };
    let content = match fields.get("content") {
        Some(Value::String(text)) => text.clone(),
        other => {
            return Err(problem(
                ".content",
                format!("must be a string, got {}", shown(other)),
            ));
        }
    };
    Ok(ChatMessage { role, content })
}

fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "nothing".into(), Value::to_string)
}

/// The normalised ground truth of a rule-graded row.
fn ground_truth(reward_model: Option<&Value>) -> Result<String, FieldProblem> {
    let Some(Value::Object(reward)) = reward_model else {
        return Err(problem(
            "reward_model",
            format!(
                "must be {{ground_truth, style}}, got {}",
                shown(reward_model)
            ),
        ));
    };
    match reward.get("style") {
        Some(Value::String(style)) if style == "rule" => {}
        other => {
            return Err(problem(
                "reward_model.style",
                format!(
                    "is {}; ARL grades VeRL rows by rule (the final answer), so only \
                     style \"rule\" rows load",
                    shown(other)
                ),
            ));
        }
    }
    let truth = match reward.get("ground_truth") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Number(number)) => number.to_string(),
        other => {
            return Err(problem(
                "reward_model.ground_truth",
                format!("must be a string or a number, got {}", shown(other)),
            ));
        }
    };
    // Ours: the text after `####`, without separators or a `.0` — as a dataset's answers.
    final_answer(&format!("#### {truth}")).ok_or_else(|| {
        problem(
            "reward_model.ground_truth",
            format!(
                "is {truth:?}, not a number; ARL grades by exact match of the final number, \
                 which cannot grade it"
            ),
        )
    })
}

/// `<data_source>-<split>-<index>` when `extra_info` has both (VeRL's preprocessing
/// writes them, unique per file and split), else `<data_source>-<file stem>-<row>`.
fn task_id(
    extra_info: Option<&Value>,
    data_source: &str,
    stem: &str,
    row: &str,
) -> Result<String, FieldProblem> {
    let info = match extra_info {
        None | Some(Value::Null) => None,
        Some(Value::Object(info)) => Some(info),
        Some(other) => {
            return Err(problem(
                "extra_info",
                format!("must be a struct, got {other}"),
            ));
        }
    };
    let split = match info.and_then(|i| i.get("split")) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(other) => {
            return Err(problem(
                "extra_info.split",
                format!("must be a non-empty string, got {other}"),
            ));
        }
    };
    let index = match info.and_then(|i| i.get("index")) {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => Some(n.to_string()),
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(other) => {
            return Err(problem(
                "extra_info.index",
                format!("must be a whole number or a string, got {other}"),
            ));
        }
    };
    Ok(match (split, index) {
        (Some(split), Some(index)) => format!("{data_source}-{split}-{index}"),
        _ => format!("{data_source}-{stem}-{row}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: Value) -> Map<String, Value> {
        let Value::Object(map) = value else {
            panic!("a row is an object")
        };
        map
    }

    fn gsm8k_row() -> Value {
        serde_json::json!({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many? Let's think step by step and output the final answer after \"####\"."}],
            "ability": "math",
            "reward_model": {"ground_truth": "7", "style": "rule"},
            "extra_info": {"split": "train", "index": 12, "answer": "3 + 4 = 7\n#### 7", "question": "Tom has 3 apples and buys 4. How many?"}
        })
    }

    fn field_of(value: Value) -> String {
        task(&row(value), "train", "1").unwrap_err().0
    }

    #[test]
    fn a_gsm8k_row_is_a_math_task_with_its_messages() {
        let task = task(&row(gsm8k_row()), "train", "1").unwrap();
        assert_eq!(task.id, "openai/gsm8k-train-12");
        assert_eq!(task.answer, "7");
        assert_eq!(task.messages.len(), 1);
        assert!(task.question.starts_with("Tom has 3 apples"));
    }

    #[test]
    fn ids_fall_back_to_the_file_and_row() {
        let mut value = gsm8k_row();
        value["extra_info"] = Value::Null;
        assert_eq!(
            task(&row(value), "test", "5").unwrap().id,
            "openai/gsm8k-test-5"
        );
    }

    #[test]
    fn rows_the_rule_cannot_grade_are_refused_by_field() {
        let cases: [(&str, Value, &str); 9] = [
            (
                "/reward_model/ground_truth",
                "\\frac{1}{2}".into(),
                "reward_model.ground_truth",
            ),
            ("/reward_model/style", "model".into(), "reward_model.style"),
            ("/ability", "code".into(), "ability"),
            ("/prompt", serde_json::json!([]), "prompt"),
            ("/prompt/0/role", "narrator".into(), "prompt[0].role"),
            ("/prompt/0/content", Value::Null, "prompt[0].content"),
            ("/data_source", 3.into(), "data_source"),
            ("/extra_info/index", 1.5.into(), "extra_info.index"),
            ("/prompt/0/role", "system".into(), "prompt"),
        ];
        for (pointer, bad, field) in cases {
            let mut value = gsm8k_row();
            *value.pointer_mut(pointer).unwrap() = bad;
            assert_eq!(field_of(value), field, "{pointer}");
        }
        let mut value = gsm8k_row();
        value["prompt"][0]["name"] = "tom".into();
        assert_eq!(field_of(value), "prompt[0].name");
    }

    #[test]
    fn ground_truths_are_normalised_as_ours() {
        for (truth, ours) in [
            (Value::from("1,234"), "1234"),
            (Value::from("-3.0"), "-3"),
            (Value::from(18), "18"),
            (Value::from("#### 72"), "72"),
        ] {
            let mut value = gsm8k_row();
            value["reward_model"]["ground_truth"] = truth;
            assert_eq!(task(&row(value), "t", "1").unwrap().answer, ours);
        }
    }
}
