//! VeRL's preprocessed GSM8K, written here as Parquet with VeRL's nested schema
//! (`arl_testkit::verl`), loads as math tasks: the chat prompt kept as written, the ground
//! truth as the answer, a row the rule cannot grade reported by file, row and field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use arl_dataset::{manifest, verl};
use arl_schemas::dataset::{ChatMessage, ChatRole, Grading};
use arl_schemas::events::TaskKind;
use arl_schemas::spec::{DataSource, DataSpec};
use arl_testkit::verl::{GSM8K_INSTRUCTION, GSM8K_TEST, GSM8K_TRAIN, VerlRow, write_verl_parquet};

/// A row of MATH as VeRL preprocesses it: its ground truth is LaTeX, which ARL's rule
/// (the final number) cannot grade.
fn math_row(index: i64) -> VerlRow {
    let mut row = VerlRow::gsm8k("train", index, "What is $\\frac{1}{2} + \\frac{1}{4}$?", "");
    row.data_source = "DigitalLearningGmbH/MATH-lighteval".into();
    row.ground_truth = "\\frac{3}{4}".into();
    row
}

fn verl_data(train: &Path, val: &Path) -> DataSpec {
    DataSpec {
        dataset: train.display().to_string(),
        source: DataSource::Verl,
        val_dataset: val.display().to_string(),
        val_size: 0,
        ..DataSpec::default()
    }
}

#[test]
fn verl_gsm8k_parquet_loads_as_math_tasks_and_the_bad_row_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train.parquet");
    let mut rows = VerlRow::gsm8k_split("train", GSM8K_TRAIN);
    rows.insert(2, math_row(99));
    write_verl_parquet(&train, &rows).unwrap();

    let loaded = verl::load(&train).unwrap();
    assert_eq!(loaded.rows.len(), GSM8K_TRAIN.len());
    let ids: Vec<&str> = loaded.rows.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "openai/gsm8k-train-0",
            "openai/gsm8k-train-1",
            "openai/gsm8k-train-2",
            "openai/gsm8k-train-3",
            "openai/gsm8k-train-4"
        ]
    );
    let answers: Vec<&str> = loaded.rows.iter().map(|t| t.answer.as_str()).collect();
    assert_eq!(answers, ["72", "10", "5", "42", "624"]);
    let natalia = &loaded.rows[0];
    assert_eq!(
        natalia.messages,
        [ChatMessage {
            role: ChatRole::User,
            content: format!("{} {GSM8K_INSTRUCTION}", GSM8K_TRAIN[0].0),
        }]
    );
    assert_eq!(natalia.question, natalia.messages[0].content);

    // The MATH row is the third: reported with its place and field, not dropped silently.
    assert_eq!(loaded.errors.len(), 1);
    let error = &loaded.errors[0];
    assert_eq!(
        (
            error.file.as_str(),
            error.row.as_str(),
            error.field.as_str()
        ),
        (train.to_str().unwrap(), "3", "reward_model.ground_truth")
    );
    assert!(error.reason.contains("not a number"), "{error}");
    let refused = loaded.accept(false).unwrap_err().to_string();
    assert!(refused.contains("1 invalid rows"), "{refused}");
}

#[test]
fn train_and_val_files_become_the_split() {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = (
        dir.path().join("train.parquet"),
        dir.path().join("test.parquet"),
    );
    write_verl_parquet(&train, &VerlRow::gsm8k_split("train", GSM8K_TRAIN)).unwrap();
    write_verl_parquet(&test, &VerlRow::gsm8k_split("test", GSM8K_TEST)).unwrap();

    let built = manifest::build(&verl_data(&train, &test), &train).unwrap();
    assert_eq!(
        built.train.len(),
        GSM8K_TRAIN.len(),
        "every train row trains"
    );
    let validation: Vec<&str> = built.validation.iter().map(|t| t.as_str()).collect();
    assert_eq!(validation, ["openai/gsm8k-test-0", "openai/gsm8k-test-1"]);
    let janet = built.task(&built.validation[0]).unwrap();
    assert_eq!(janet.kind, TaskKind::Math);
    assert_eq!(
        janet.grading,
        Grading::Math {
            answer: "18".into()
        }
    );
    assert!(janet.instruction.starts_with("Janet\u{2019}s ducks"));
    assert_eq!(
        janet.messages.as_deref().map(<[_]>::len),
        Some(1),
        "the prompt travels with the task"
    );

    // val_size picks fewer, by seed; the digest follows the content.
    let mut one = verl_data(&train, &test);
    one.val_size = 1;
    let fewer = manifest::build(&one, &train).unwrap();
    assert_eq!(fewer.validation.len(), 1);
    assert_ne!(fewer.digest, built.digest);
    let mut other_prompt = VerlRow::gsm8k_split("test", GSM8K_TEST);
    other_prompt[1].prompt.insert(
        0,
        ("system".into(), Some("You are a careful tutor.".into())),
    );
    write_verl_parquet(&test, &other_prompt).unwrap();
    let changed = manifest::build(&verl_data(&train, &test), &train).unwrap();
    assert_ne!(
        changed.digest, built.digest,
        "the digest covers the messages"
    );
    let robe = changed.task(&changed.validation[1]).unwrap();
    let roles: Vec<ChatRole> = robe
        .messages
        .as_ref()
        .unwrap()
        .iter()
        .map(|m| m.role)
        .collect();
    assert_eq!(roles, [ChatRole::System, ChatRole::User]);
    assert!(
        robe.instruction.starts_with("A robe takes"),
        "the last user message"
    );
}

#[test]
fn nulls_duplicates_and_jsonl_rows() {
    let dir = tempfile::tempdir().unwrap();
    // A null inside the prompt's list of structs, and a second row with the first's id.
    let mut rows = VerlRow::gsm8k_split("train", &GSM8K_TRAIN[..2]);
    rows[1].prompt[0].1 = None;
    rows.push(VerlRow::gsm8k(
        "train",
        0,
        GSM8K_TRAIN[2].0,
        GSM8K_TRAIN[2].1,
    ));
    let file = dir.path().join("train.parquet");
    write_verl_parquet(&file, &rows).unwrap();
    let loaded = verl::load(&file).unwrap();
    assert_eq!(loaded.rows.len(), 1);
    let fields: Vec<(&str, &str)> = loaded
        .errors
        .iter()
        .map(|e| (e.row.as_str(), e.field.as_str()))
        .collect();
    assert_eq!(fields, [("2", "prompt[0].content"), ("3", "extra_info")]);

    // The same rows as JSONL load the same tasks.
    let good = VerlRow::gsm8k_split("train", GSM8K_TRAIN);
    let parquet = dir.path().join("good.parquet");
    write_verl_parquet(&parquet, &good).unwrap();
    let jsonl = dir.path().join("good.jsonl");
    let lines: Vec<String> = good
        .iter()
        .map(|r| {
            serde_json::json!({
                "data_source": r.data_source,
                "prompt": r.prompt.iter().map(|(role, content)| serde_json::json!({"content": content, "role": role})).collect::<Vec<_>>(),
                "ability": r.ability,
                "reward_model": {"ground_truth": r.ground_truth, "style": r.style},
                "extra_info": {"answer": r.answer, "index": r.index, "question": r.question, "split": r.split, "need_tools_kwargs": true, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": r.ground_truth}}}},
            })
            .to_string()
        })
        .collect();
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let from_jsonl = verl::load(&jsonl).unwrap();
    assert!(from_jsonl.errors.is_empty(), "{:?}", from_jsonl.errors);
    assert_eq!(from_jsonl.rows, verl::load(&parquet).unwrap().rows);
}
