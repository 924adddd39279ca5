//! VeRL's `trainer.total_epochs` as ARL's step count. VeRL trains epochs × batches per
//! epoch steps; ARL's spec counts steps (the trainer, evaluator, controller and
//! `run.accepted` all read `trainer.total_steps`), and batches per epoch depend on the
//! training split. So `arl run submit` loads the dataset as the dataset service will — the
//! same loader, validation and split (`arl_dataset::manifest::build`) — and writes the
//! steps into the spec; the epochs never reach it.

use std::path::Path;

use arl_schemas::FieldError;
use arl_schemas::spec::RunSpec;
use arl_schemas::verl::steps_for_epochs;

/// How the steps were derived, to show the user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepsFromEpochs {
    pub epochs: u32,
    pub train_tasks: usize,
    pub batch_size: u32,
    pub steps: u32,
}

impl std::fmt::Display for StepsFromEpochs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per_epoch = self.steps / self.epochs.max(1);
        write!(
            f,
            "trainer.total_steps = {} (trainer.total_epochs {} × ceil({} training tasks ÷ \
             data.train_batch_size {}) = {} × {per_epoch}; each epoch reshuffles, its last \
             batch may be partial)",
            self.steps, self.epochs, self.train_tasks, self.batch_size, self.epochs
        )
    }
}

const KEY: &str = "trainer.total_epochs";

/// The steps of `epochs` passes over `spec`'s training split, or why they cannot be known
/// here (then the user gives `trainer.total_training_steps`).
pub fn derive(spec: &RunSpec, epochs: u32) -> Result<StepsFromEpochs, FieldError> {
    let data = &spec.data;
    let manifest = arl_dataset::manifest::build(data, Path::new(&data.dataset)).map_err(|e| {
        FieldError::new(
            KEY,
            format!(
                "the steps are epochs × batches per epoch, which needs the training split, \
                 but the dataset does not load on this machine ({e}); fix that, or give \
                 trainer.total_training_steps instead"
            ),
        )
    })?;
    let train_tasks = manifest.train.len();
    let steps = steps_for_epochs(epochs, train_tasks, data.train_batch_size).ok_or_else(|| {
        FieldError::new(
            KEY,
            format!(
                "{epochs} epochs of {train_tasks} training tasks in batches of {} is no \
                 step count ARL can run; give trainer.total_training_steps instead",
                data.train_batch_size
            ),
        )
    })?;
    Ok(StepsFromEpochs {
        epochs,
        train_tasks,
        batch_size: data.train_batch_size,
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derivation_reads_as_arithmetic() {
        let derived = StepsFromEpochs {
            epochs: 15,
            train_tasks: 5,
            batch_size: 4,
            steps: 30,
        };
        let text = derived.to_string();
        assert!(
            text.starts_with("trainer.total_steps = 30 (trainer.total_epochs 15 × ceil(5 ")
                && text.contains("= 15 × 2;"),
            "{text}"
        );
    }

    #[test]
    fn an_unreadable_dataset_asks_for_the_steps() {
        let mut spec = RunSpec::default();
        spec.data.dataset = "/nonexistent/train.parquet".into();
        spec.data.source = arl_schemas::spec::DataSource::Verl;
        let error = derive(&spec, 3).unwrap_err();
        assert_eq!(error.path, KEY);
        assert!(
            error.reason.contains("trainer.total_training_steps"),
            "{error}"
        );
    }
}
