//! One task's check: its environment built as the image builder builds it, then its
//! reference solution and an empty patch each graded by the reward service's grader in a
//! fresh sandbox. Math tasks have no environment: their reference answer and an empty one
//! go through the same exact-match rule the reward service applies.

use std::time::Instant;

use arl_imagebuilder::local::{BuildError, Built};
use arl_imagebuilder::recipe::{RecipeError, SweTask};
use arl_reward::grader::{Grade, GradeFailure, grade_answer};
use arl_schemas::dataset::{Grading, TaskRecord};

use super::harness::Harness;
use super::plan::{Reference, TaskToCheck};
use super::report::TaskOutcome;
use super::solution::{self, SolutionError};

/// Why a task could not be checked: each becomes the report's `error`.
#[derive(Debug, thiserror::Error)]
enum CheckError {
    #[error("no environment recipe: {0}")]
    NoRecipe(RecipeError),
    /// The row's commit is not its recorded recipe's.
    #[error("{0}")]
    CommitMismatch(RecipeError),
    #[error("environment build failed: {0}")]
    Build(BuildError),
    #[error("has no solution/solve.sh: nothing shows the task can be solved")]
    NoSolution,
    #[error("the solution could not be run: {0}")]
    Solution(SolutionError),
    #[error("{what} could not be graded: {failure}")]
    Grading {
        what: &'static str,
        failure: GradeFailure,
    },
    /// A plan that pairs a reference with the wrong kind of task, or no harness for a task
    /// that needs one: a bug here, not in the dataset.
    #[error("internal: {0}")]
    Internal(&'static str),
}

/// Checks one task. A task with an environment needs the harness (the plan starts one
/// whenever such a task exists).
pub async fn check(harness: Option<&Harness>, task: &TaskToCheck) -> TaskOutcome {
    let record = &task.record;
    let mut outcome = TaskOutcome::new(record.task_id.as_str(), record.kind);
    let checked = match (&task.reference, harness) {
        (Reference::Answer(reference), _) => check_answer(&mut outcome, record, reference),
        (_, None) => Err(CheckError::Internal("no sandbox to grade in")),
        (_, Some(harness)) => check_in_sandboxes(&mut outcome, harness, task).await,
    };
    if let Err(error) = checked {
        outcome.error = Some(error.to_string());
    }
    outcome
}

fn check_answer(
    outcome: &mut TaskOutcome,
    record: &TaskRecord,
    reference: &str,
) -> Result<(), CheckError> {
    let Grading::Math { answer } = &record.grading else {
        return Err(CheckError::Internal(
            "a math answer for another kind of task",
        ));
    };
    outcome.gold_resolved = Some(grade_answer(reference, answer).resolved);
    outcome.empty_resolved = Some(grade_answer("", answer).resolved);
    outcome.note = Some(format!(
        "nothing to build: the answer {answer:?} parses and matches"
    ));
    Ok(())
}

/// Fills in `outcome` as far as the check gets; the error that stopped it, if one did.
/// Gradings that fail are reported together (the other grading still counts).
async fn check_in_sandboxes(
    outcome: &mut TaskOutcome,
    harness: &Harness,
    task: &TaskToCheck,
) -> Result<(), CheckError> {
    let record = &task.record;
    let started = Instant::now();
    let built = build(harness, record).await;
    outcome.build_seconds = Some(started.elapsed().as_secs_f64());
    let (built, shared) = built?;
    outcome.disk_bytes = Some(arl_imagebuilder::local::size_of(&built.dir));
    outcome.shared_environment = shared;
    let gold = gold_patch(harness, record, &task.reference).await?;
    // One after the other: `--jobs` bounds what runs at once, and a task is one job.
    let gold_grade = grade(harness, record, &gold.patch, "the gold patch").await;
    let empty_grade = grade(harness, record, "", "the empty patch").await;
    let mut errors = Vec::new();
    match gold_grade {
        Ok(grade) => {
            outcome.gold_resolved = Some(grade.resolved);
            outcome.failing_tests = grade.failed_tests;
            // Why a solution that does not resolve may have failed.
            if !grade.resolved {
                outcome.note = gold.trouble;
            }
        }
        Err(error) => errors.push(error.to_string()),
    }
    match empty_grade {
        Ok(grade) => outcome.empty_resolved = Some(grade.resolved),
        Err(error) => errors.push(error.to_string()),
    }
    if !errors.is_empty() {
        outcome.error = Some(errors.join("\n"));
    }
    Ok(())
}

/// The environment, made ready by the image builder's own recipe and builder. A SWE-bench
/// row must name the commit its recipe builds: the patches would otherwise be graded on
/// another tree than the one the dataset describes.
/// The built environment, and the shared dependency environment it mounts, if any.
async fn build(
    harness: &Harness,
    record: &TaskRecord,
) -> Result<(Built, Option<String>), CheckError> {
    let recipe = harness
        .recipes
        .recipe(
            record.kind,
            &record.environment.name,
            Some(&harness.dataset),
            SweTask::of(record),
        )
        .map_err(|e| match e {
            RecipeError::CommitMismatch { .. } => CheckError::CommitMismatch(e),
            other => CheckError::NoRecipe(other),
        })?;
    let built = harness
        .builder
        .ensure(&recipe)
        .await
        .map_err(CheckError::Build)?;
    Ok((built, recipe.shared.map(|s| s.name)))
}

/// The gold patch to grade, and for a Harbor solution what its run said.
struct Gold {
    patch: String,
    trouble: Option<String>,
}

async fn gold_patch(
    harness: &Harness,
    record: &TaskRecord,
    reference: &Reference,
) -> Result<Gold, CheckError> {
    match reference {
        Reference::Patch(patch) => Ok(Gold {
            patch: patch.clone(),
            trouble: None,
        }),
        Reference::Solution(Some(dir)) => {
            let ran = solution::run(
                &harness.sandboxes,
                &harness.owner,
                record,
                dir,
                harness.test_timeout,
            )
            .await
            .map_err(CheckError::Solution)?;
            Ok(Gold {
                trouble: ran.trouble(),
                patch: ran.patch,
            })
        }
        Reference::Solution(None) => Err(CheckError::NoSolution),
        Reference::Answer(_) => Err(CheckError::Internal("a math answer has no patch")),
    }
}

async fn grade(
    harness: &Harness,
    record: &TaskRecord,
    candidate: &str,
    what: &'static str,
) -> Result<Grade, CheckError> {
    harness
        .grader
        .grade(&harness.owner, record, candidate)
        .await
        .map_err(|failure| CheckError::Grading { what, failure })
}
