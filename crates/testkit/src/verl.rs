//! VeRL-format dataset files for tests, written in Rust with the nested Arrow schema VeRL's
//! `examples/data_preprocess/gsm8k.py` produces through `datasets.Dataset.to_parquet`:
//!
//! ```text
//! data_source:  string                                   "openai/gsm8k"
//! prompt:       list<struct<content: string, role: string>>
//! ability:      string                                   "math"
//! reward_model: struct<ground_truth: string, style: string>
//! extra_info:   struct<answer: string, index: int64, question: string, split: string>
//! ```

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use arrow_array::builder::{Int64Builder, ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{Array, ArrayRef, RecordBatch, StringArray, StructArray};
use arrow_schema::{DataType, Field, Fields, Schema};

/// The instruction gsm8k.py appends to every question.
pub const GSM8K_INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";

/// GSM8K problems (question, the dataset's answer text), from its train and test splits.
pub const GSM8K_TRAIN: &[(&str, &str)] = &[
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?",
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    ),
    (
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?",
        "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5",
    ),
    (
        "Julie is reading a 120-page book. Yesterday, she was able to read 12 pages and today, she read twice as many pages as yesterday. If she wants to read half of the remaining pages tomorrow, how many pages should she read?",
        "Maila read 12 x 2 = <<12*2=24>>24 pages today.\nSo she was able to read a total of 12 + 24 = <<12+24=36>>36 pages since yesterday.\nThere are 120 - 36 = <<120-36=84>>84 pages left to be read.\nSince she wants to read half of the remaining pages tomorrow, then she should read 84/2 = <<84/2=42>>42 pages.\n#### 42",
    ),
    (
        "James writes a 3-page letter to 2 different friends twice a week.  How many pages does he write a year?",
        "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages every week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624",
    ),
];

pub const GSM8K_TEST: &[(&str, &str)] = &[
    (
        "Janet\u{2019}s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?",
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u{2019}s market.\n#### 18",
    ),
    (
        "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
        "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of fabric\n#### 3",
    ),
];

/// One row as VeRL writes it; a `None` content is a null inside the prompt's list.
#[derive(Clone, Debug, PartialEq)]
pub struct VerlRow {
    pub data_source: String,
    /// (role, content) of each message.
    pub prompt: Vec<(String, Option<String>)>,
    pub ability: String,
    pub ground_truth: String,
    pub style: String,
    pub answer: String,
    pub index: i64,
    pub question: String,
    pub split: String,
}

impl VerlRow {
    /// The row gsm8k.py makes of a GSM8K problem: the question plus its instruction as the
    /// one user message, the number after `####` (without commas) as the ground truth.
    pub fn gsm8k(split: &str, index: i64, question: &str, answer: &str) -> Self {
        let ground_truth = answer
            .rsplit_once("#### ")
            .map_or("", |(_, n)| n)
            .replace(',', "");
        Self {
            data_source: "openai/gsm8k".into(),
            prompt: vec![(
                "user".into(),
                Some(format!("{question} {GSM8K_INSTRUCTION}")),
            )],
            ability: "math".into(),
            ground_truth,
            style: "rule".into(),
            answer: answer.into(),
            index,
            question: question.into(),
            split: split.into(),
        }
    }

    /// The rows of `problems` as one split of GSM8K.
    pub fn gsm8k_split(split: &str, problems: &[(&str, &str)]) -> Vec<Self> {
        problems
            .iter()
            .zip(0..)
            .map(|((question, answer), index)| Self::gsm8k(split, index, question, answer))
            .collect()
    }
}

fn utf8(name: &str) -> Field {
    Field::new(name, DataType::Utf8, true)
}

fn message_fields() -> Fields {
    Fields::from(vec![utf8("content"), utf8("role")])
}

fn extra_info_fields() -> Fields {
    Fields::from(vec![
        utf8("answer"),
        Field::new("index", DataType::Int64, true),
        utf8("question"),
        utf8("split"),
    ])
}

/// The rows as one Arrow batch with VeRL's nested schema.
pub fn verl_batch(rows: &[VerlRow]) -> anyhow::Result<RecordBatch> {
    let strings = |f: fn(&VerlRow) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let mut prompt = ListBuilder::new(StructBuilder::from_fields(message_fields(), rows.len()))
        .with_field(Field::new("item", DataType::Struct(message_fields()), true));
    for row in rows {
        let messages = prompt.values();
        for (role, content) in &row.prompt {
            messages
                .field_builder::<StringBuilder>(0)
                .context("the content builder")?
                .append_option(content.as_deref());
            messages
                .field_builder::<StringBuilder>(1)
                .context("the role builder")?
                .append_value(role);
            messages.append(true);
        }
        prompt.append(true);
    }
    let reward_model = StructArray::from(vec![
        (Arc::new(utf8("ground_truth")), strings(|r| &r.ground_truth)),
        (Arc::new(utf8("style")), strings(|r| &r.style)),
    ]);
    let mut index = Int64Builder::new();
    rows.iter().for_each(|r| index.append_value(r.index));
    let extra_info = StructArray::try_new(
        extra_info_fields(),
        vec![
            strings(|r| &r.answer),
            Arc::new(index.finish()),
            strings(|r| &r.question),
            strings(|r| &r.split),
        ],
        None,
    )?;
    let prompt = prompt.finish();
    let schema = Schema::new(vec![
        utf8("data_source"),
        Field::new("prompt", prompt.data_type().clone(), true),
        utf8("ability"),
        Field::new("reward_model", reward_model.data_type().clone(), true),
        Field::new("extra_info", extra_info.data_type().clone(), true),
    ]);
    let columns: Vec<ArrayRef> = vec![
        strings(|r| &r.data_source),
        Arc::new(prompt),
        strings(|r| &r.ability),
        Arc::new(reward_model),
        Arc::new(extra_info),
    ];
    Ok(RecordBatch::try_new(Arc::new(schema), columns)?)
}

/// The rows as a Parquet file's bytes, as VeRL's preprocessing writes them.
pub fn verl_parquet(rows: &[VerlRow]) -> anyhow::Result<Vec<u8>> {
    let batch = verl_batch(rows)?;
    let mut bytes = Vec::new();
    let mut writer = parquet::arrow::ArrowWriter::try_new(&mut bytes, batch.schema(), None)?;
    writer.write(&batch)?;
    writer.close()?;
    Ok(bytes)
}

/// Writes the rows to a Parquet file as VeRL's preprocessing does.
pub fn write_verl_parquet(path: &Path, rows: &[VerlRow]) -> anyhow::Result<()> {
    std::fs::write(path, verl_parquet(rows)?).with_context(|| path.display().to_string())
}
