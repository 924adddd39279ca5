//! What `arl dataset validate` checks: the spec's tasks exactly as the dataset service
//! would register them (the same loaders, the same `data.task_ids` selection), each with
//! its reference solution, and the rows that did not load.
//!
//! The reference solution never enters the manifest a run registers (the rollout's
//! agents must not find it anywhere a trial reaches): SWE-bench's gold patch is read here
//! from the dataset file, beside the manifest, and only ever becomes a grading's candidate.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use arl_dataset::swebench::{self, Completeness};
use arl_dataset::{LoadError, manifest};
use arl_schemas::dataset::{Grading, InvalidRow, TaskRecord};
use arl_schemas::events::TaskKind;
use arl_schemas::spec::{DataSource, DataSpec};

use crate::run::CliError;

/// The tasks to check and the rows that failed to load.
#[derive(Debug)]
pub struct Plan {
    /// The dataset file or folder (Harbor tasks are folders under it).
    pub dataset: PathBuf,
    /// The kind of every task of the dataset (its `data.source`).
    pub kind: TaskKind,
    pub tasks: Vec<TaskToCheck>,
    /// Rows that failed the loader's checks: each is a bad task of its own.
    pub invalid_rows: Vec<InvalidRow>,
}

#[derive(Debug)]
pub struct TaskToCheck {
    /// As the run's manifest would hold it (no reference solution in it).
    pub record: TaskRecord,
    pub reference: Reference,
}

/// What solves a task, by its kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Reference {
    /// SWE-bench's gold patch: the row's `patch`.
    Patch(String),
    /// A Harbor task's `solution/` folder, run as Harbor's oracle agent runs `solve.sh`;
    /// `None` when the task has no `solution/solve.sh`.
    Solution(Option<PathBuf>),
    /// A math task's reference answer, as a solution ends: `#### <answer>`.
    Answer(String),
}

impl Plan {
    /// Whether any task has an environment to build (and so needs a sandbox to grade in).
    pub fn needs_environments(&self) -> bool {
        self.tasks.iter().any(|t| t.record.kind != TaskKind::Math)
    }
}

/// Loads `data`'s tasks. Invalid rows are kept as findings whatever
/// `data.allow_invalid_rows` says: a validation reports every one of them. With
/// `data.task_ids`, only those tasks are checked (and rows that did not load are not
/// reported: they cannot be told apart from the ones left out).
pub fn load(data: &DataSpec) -> Result<Plan, CliError> {
    // Canonical, so reports name it without `..`; the loaders say if it is missing.
    let dataset =
        std::fs::canonicalize(&data.dataset).unwrap_or_else(|_| PathBuf::from(&data.dataset));
    let every_row = DataSpec {
        allow_invalid_rows: true,
        ..data.clone()
    };
    let registered = manifest::build(&every_row, &dataset).map_err(|e| load_error(&dataset, e))?;
    let mut gold = match data.source {
        DataSource::Swebench => gold_patches(&dataset)?,
        DataSource::Harbor | DataSource::Gsm8k | DataSource::Verl => HashMap::new(),
    };
    let tasks = registered
        .tasks
        .into_iter()
        .map(|record| {
            let reference = reference(&record, &dataset, &mut gold);
            TaskToCheck { record, reference }
        })
        .collect();
    let invalid_rows = if data.task_ids.is_empty() {
        registered.invalid_rows
    } else {
        Vec::new()
    };
    let kind = match data.source {
        DataSource::Swebench => TaskKind::Swebench,
        DataSource::Harbor => TaskKind::Harbor,
        DataSource::Gsm8k | DataSource::Verl => TaskKind::Math,
    };
    Ok(Plan {
        dataset,
        kind,
        tasks,
        invalid_rows,
    })
}

fn load_error(dataset: &Path, error: LoadError) -> CliError {
    match error {
        LoadError::Read { path, reason } => CliError::Unreadable { path, reason },
        invalid @ LoadError::Invalid { .. } => CliError::Unreadable {
            path: dataset.display().to_string(),
            reason: invalid.to_string(),
        },
    }
}

/// Every SWE-bench row's gold patch, by instance id.
fn gold_patches(dataset: &Path) -> Result<HashMap<String, String>, CliError> {
    let loaded = swebench::load(dataset, Completeness::Full).map_err(|e| load_error(dataset, e))?;
    Ok(loaded
        .rows
        .into_iter()
        .map(|row| (row.instance_id, row.patch))
        .collect())
}

fn reference(record: &TaskRecord, dataset: &Path, gold: &mut HashMap<String, String>) -> Reference {
    match &record.grading {
        // The loader refuses a full row without its patch, so every task has one.
        Grading::Swebench { .. } => {
            Reference::Patch(gold.remove(record.task_id.as_str()).unwrap_or_default())
        }
        Grading::Harbor { .. } => {
            let solution = dataset.join(record.task_id.as_str()).join("solution");
            Reference::Solution(solution.join("solve.sh").is_file().then_some(solution))
        }
        Grading::Math { answer } => Reference::Answer(format!("#### {answer}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn examples() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
    }

    #[test]
    fn harbor_tasks_bring_their_solution_folders() {
        let data = DataSpec {
            dataset: examples().join("tasks").display().to_string(),
            source: DataSource::Harbor,
            val_size: 0,
            ..DataSpec::default()
        };
        let plan = load(&data).unwrap();
        assert!(plan.needs_environments());
        assert_eq!(plan.tasks.len(), 3);
        for task in &plan.tasks {
            let Reference::Solution(Some(dir)) = &task.reference else {
                panic!("{:?}", task.reference);
            };
            assert!(dir.join("solve.sh").is_file());
        }
    }

    #[test]
    fn math_answers_are_their_own_reference_and_need_no_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gsm.jsonl");
        std::fs::write(
            &file,
            "{\"question\": \"2+2?\", \"answer\": \"2+2=4\\n#### 4\"}\n{\"question\": \"x\", \"answer\": \"no marker\"}\n",
        )
        .unwrap();
        let data = DataSpec {
            dataset: file.display().to_string(),
            source: DataSource::Gsm8k,
            val_size: 0,
            ..DataSpec::default()
        };
        let plan = load(&data).unwrap();
        assert!(!plan.needs_environments());
        assert_eq!(plan.tasks[0].reference, Reference::Answer("#### 4".into()));
        assert_eq!(
            plan.invalid_rows.len(),
            1,
            "reported, even though not allowed"
        );
        assert_eq!(plan.invalid_rows[0].field, "answer");
    }

    #[test]
    fn an_unreadable_dataset_is_named() {
        let data = DataSpec {
            dataset: "/nonexistent/rows.jsonl".into(),
            source: DataSource::Swebench,
            ..DataSpec::default()
        };
        let error = load(&data).unwrap_err();
        assert!(
            error.to_string().contains("/nonexistent/rows.jsonl"),
            "{error}"
        );
        assert!(matches!(error, CliError::Unreadable { .. }));
    }
}
