//! A run's dataset as the rest of the pipeline sees it: every valid task with what the
//! agent is told, its environment and how it is graded, plus the split — a
//! [`DatasetManifestV1`] whose digest names it in the object store.

use std::path::Path;

use arl_schemas::TaskId;
use arl_schemas::dataset::{DatasetManifestV1, Grading, HarborFile, InvalidRow, TaskRecord};
use arl_schemas::events::{EnvironmentRef, TaskKind};
use arl_schemas::spec::{DataSource, DataSpec};

use crate::swebench::Completeness;
use crate::{LoadError, RowError, harbor, math, sha256_hex, split, swebench, verl};

/// The environment math tasks share: a plain sandbox, nothing to build.
pub const MATH_ENVIRONMENT: &str = "math";

/// Loads, validates and splits the dataset at `path` as `data` describes it: validation
/// is held out of it, or, with `data.val_dataset`, is that file's tasks (all of them, or
/// `data.val_size` chosen by seed) while every task of `path` can train.
pub fn build(data: &DataSpec, path: &Path) -> Result<DatasetManifestV1, LoadError> {
    let (mut tasks, mut errors) = load_tasks(data, path)?;
    let val_path = Path::new(&data.val_dataset);
    let mut val_tasks = Vec::new();
    if !data.val_dataset.is_empty() {
        let (loaded, val_errors) = load_tasks(data, val_path)?;
        val_tasks = loaded;
        errors.extend(val_errors);
        check_disjoint(&tasks, &val_tasks, path, val_path)?;
    }
    if let Some(missing) = data.task_ids.iter().find(|id| {
        !tasks
            .iter()
            .chain(&val_tasks)
            .any(|t| t.task_id.as_str() == id.as_str())
    }) {
        return Err(LoadError::Read {
            path: path.display().to_string(),
            reason: format!("data.task_ids names {missing}, which the dataset does not have"),
        });
    }
    keep_only(&mut tasks, &data.task_ids, path)?;
    if !data.val_dataset.is_empty() {
        keep_only(&mut val_tasks, &data.task_ids, val_path)?;
    }
    let parts = split_tasks(data, &tasks, &val_tasks);
    tasks.extend(val_tasks);
    let to_ids = |names: Vec<String>| -> Result<Vec<TaskId>, LoadError> {
        names
            .into_iter()
            .map(|n| task_id(&n, path))
            .collect::<Result<_, _>>()
    };
    let mut manifest = DatasetManifestV1 {
        digest: String::new(),
        source: path.display().to_string(),
        tasks,
        train: to_ids(parts.train)?,
        validation: to_ids(parts.validation)?,
        invalid_rows: errors.into_iter().map(invalid_row).collect(),
    };
    manifest.digest = digest(&manifest);
    Ok(manifest)
}

/// The split: validation held out of `tasks` by seed, or, with a validation file, taken
/// from `val_tasks` (all, or `data.val_size` of them by seed) while all of `tasks` train.
fn split_tasks(data: &DataSpec, tasks: &[TaskRecord], val_tasks: &[TaskRecord]) -> split::Split {
    let names = |tasks: &[TaskRecord]| -> Vec<String> {
        tasks
            .iter()
            .map(|t| t.task_id.as_str().to_owned())
            .collect()
    };
    let (seed, train_size) = (data.seed, data.train_size as usize);
    if data.val_dataset.is_empty() {
        return split::split(&names(tasks), seed, data.val_size as usize, train_size);
    }
    let val_names = names(val_tasks);
    let val_size = if data.validates_on_all_of_val_dataset() {
        val_names.len()
    } else {
        data.val_size as usize
    };
    split::Split {
        train: split::split(&names(tasks), seed, 0, train_size).train,
        validation: split::split(&val_names, seed, val_size, 0).validation,
    }
}

/// A task is trained or validated on, never both: the split names tasks by id.
fn check_disjoint(
    tasks: &[TaskRecord],
    val_tasks: &[TaskRecord],
    path: &Path,
    val_path: &Path,
) -> Result<(), LoadError> {
    let trained: std::collections::HashSet<&TaskId> = tasks.iter().map(|t| &t.task_id).collect();
    match val_tasks.iter().find(|v| trained.contains(&v.task_id)) {
        Some(both) => Err(LoadError::Read {
            path: val_path.display().to_string(),
            reason: format!(
                "task {} is also in data.dataset ({}); a task is either trained or \
                 validated on",
                both.task_id,
                path.display()
            ),
        }),
        None => Ok(()),
    }
}

/// The valid tasks of one file as `data.source` reads it, and its invalid rows (an error
/// instead when there are some and `data.allow_invalid_rows` is off).
fn load_tasks(data: &DataSpec, path: &Path) -> Result<(Vec<TaskRecord>, Vec<RowError>), LoadError> {
    let allow_invalid = data.allow_invalid_rows;
    Ok(match data.source {
        DataSource::Swebench => {
            let loaded = swebench::load(path, Completeness::Full)?.accept(allow_invalid)?;
            let tasks = loaded
                .rows
                .into_iter()
                .map(|row| swebench_task(row, path))
                .collect::<Result<_, _>>()?;
            (tasks, loaded.errors)
        }
        DataSource::Harbor => {
            let loaded = harbor::load(path)?.accept(allow_invalid)?;
            let mut tasks = Vec::new();
            let mut errors = loaded.errors;
            for task in loaded.rows {
                match harbor_task(&task) {
                    Ok(record) => tasks.push(record),
                    Err(error) if allow_invalid => errors.push(error),
                    Err(first) => return Err(LoadError::Invalid { count: 1, first }),
                }
            }
            (tasks, errors)
        }
        DataSource::Gsm8k => {
            let loaded = math::load(path)?.accept(allow_invalid)?;
            let tasks = loaded
                .rows
                .into_iter()
                .map(math_task)
                .collect::<Result<_, _>>()?;
            (tasks, loaded.errors)
        }
        DataSource::Verl => {
            let loaded = verl::load(path)?.accept(allow_invalid)?;
            let tasks = loaded
                .rows
                .into_iter()
                .map(|task| verl_task(task, path))
                .collect::<Result<_, _>>()?;
            (tasks, loaded.errors)
        }
    })
}

/// Keeps the tasks `task_ids` names (all when it is empty); a file left with no task is an
/// error.
fn keep_only(
    tasks: &mut Vec<TaskRecord>,
    task_ids: &[String],
    path: &Path,
) -> Result<(), LoadError> {
    if !task_ids.is_empty() {
        tasks.retain(|t| task_ids.iter().any(|id| id == t.task_id.as_str()));
    }
    if tasks.is_empty() {
        return Err(LoadError::Read {
            path: path.display().to_string(),
            reason: if task_ids.is_empty() {
                "holds no valid task".into()
            } else {
                "holds none of the tasks data.task_ids names".into()
            },
        });
    }
    Ok(())
}

/// `sha256:<hex>` of the manifest's content (everything but the digest itself), so the
/// same tasks and split always register under the same name.
pub fn digest(manifest: &DatasetManifestV1) -> String {
    let mut unnamed = manifest.clone();
    unnamed.digest.clear();
    let bytes = serde_json::to_vec(&unnamed).unwrap_or_default();
    format!("sha256:{}", sha256_hex(&bytes))
}

fn task_id(name: &str, path: &Path) -> Result<TaskId, LoadError> {
    TaskId::new(name).map_err(|e| LoadError::Read {
        path: path.display().to_string(),
        reason: format!("task id {name:?}: {e}"),
    })
}

fn invalid_row(error: RowError) -> InvalidRow {
    InvalidRow {
        file: error.file,
        row: error.row,
        field: error.field,
        reason: error.reason,
    }
}

fn swebench_task(row: swebench::SweRow, path: &Path) -> Result<TaskRecord, LoadError> {
    Ok(TaskRecord {
        task_id: task_id(&row.instance_id, path)?,
        kind: TaskKind::Swebench,
        environment: EnvironmentRef {
            name: format!("swebench/{}", row.instance_id),
            digest: None,
        },
        instruction: row.problem_statement,
        grading: Grading::Swebench {
            repo: row.repo,
            base_commit: row.base_commit,
            test_patch: row.test_patch,
            fail_to_pass: row.fail_to_pass,
            pass_to_pass: row.pass_to_pass,
            version: (!row.version.is_empty()).then_some(row.version),
        },
        messages: None,
    })
}

fn harbor_task(task: &harbor::HarborTask) -> Result<TaskRecord, RowError> {
    let tests_dir = task.dir.join("tests");
    let mut tests = Vec::new();
    read_tree(&tests_dir, &tests_dir, &mut tests).map_err(|reason| RowError {
        file: task.dir.display().to_string(),
        row: task.name.clone(),
        field: "tests".into(),
        reason,
    })?;
    tests.sort_by(|a, b| a.path.cmp(&b.path));
    let task_id = TaskId::new(task.name.clone()).map_err(|e| RowError {
        file: task.dir.display().to_string(),
        row: task.name.clone(),
        field: "".into(),
        reason: e.to_string(),
    })?;
    Ok(TaskRecord {
        task_id,
        kind: TaskKind::Harbor,
        environment: EnvironmentRef {
            name: format!("harbor/{}", task.name),
            digest: None,
        },
        instruction: task.instruction.clone(),
        grading: Grading::Harbor { tests },
        messages: None,
    })
}

fn read_tree(root: &Path, dir: &Path, out: &mut Vec<HarborFile>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        if path.is_dir() {
            read_tree(root, &path, out)?;
            continue;
        }
        let content = std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: {e} (test files must be UTF-8 text)", path.display()))?;
        let relative = path.strip_prefix(root).unwrap_or(&path);
        out.push(HarborFile {
            path: relative.to_string_lossy().into_owned(),
            content,
        });
    }
    Ok(())
}

fn math_task(task: math::MathTask) -> Result<TaskRecord, LoadError> {
    let task_id = TaskId::new(task.id.clone()).map_err(|e| LoadError::Read {
        path: task.id.clone(),
        reason: e.to_string(),
    })?;
    Ok(TaskRecord {
        task_id,
        kind: TaskKind::Math,
        environment: EnvironmentRef {
            name: MATH_ENVIRONMENT.into(),
            digest: None,
        },
        instruction: task.question,
        grading: Grading::Math {
            answer: task.answer,
        },
        messages: None,
    })
}

/// A VeRL row: a math task whose agent sends the row's messages as they are.
fn verl_task(task: verl::VerlTask, path: &Path) -> Result<TaskRecord, LoadError> {
    Ok(TaskRecord {
        task_id: task_id(&task.id, path)?,
        kind: TaskKind::Math,
        environment: EnvironmentRef {
            name: MATH_ENVIRONMENT.into(),
            digest: None,
        },
        instruction: task.question,
        grading: Grading::Math {
            answer: task.answer,
        },
        messages: Some(task.messages),
    })
}
