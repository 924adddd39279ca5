//! Admission's last layer of checks: can this machine read what the spec names? The model
//! (an installed model's name, a GGUF file or a Hugging Face folder) and the dataset (a
//! file of the source's format, or a folder of Harbor tasks) — resolved to paths, or
//! refused with the field and what to do. Filesystem facts, so they live here, not in the
//! wire contract.

use std::path::{Path, PathBuf};

use arl_schemas::FieldError;
use arl_schemas::spec::{DataSource, MODEL_NAMES, RunSpec};

/// The model and dataset a spec resolved to on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedResources {
    pub model_path: PathBuf,
    pub dataset_path: PathBuf,
}

/// Checks that the spec's model and dataset can be read here (installed models are
/// looked up in `model_dir`), and resolves them to paths.
pub fn check(spec: &RunSpec, model_dir: &Path) -> Result<ResolvedResources, Vec<FieldError>> {
    let model = resolve_model(&spec.model.path, model_dir)
        .map_err(|reason| FieldError::new("model.path", reason));
    let dataset = check_dataset(&spec.data.dataset, spec.data.source)
        .map_err(|reason| FieldError::new("data.dataset", reason));
    // The dataset service reads the validation file at the path the spec gives, with the
    // same source.
    let val_dataset = match spec.data.val_dataset.as_str() {
        "" => Ok(()),
        path => check_dataset(path, spec.data.source)
            .map(drop)
            .map_err(|reason| FieldError::new("data.val_dataset", reason)),
    };
    match (model, dataset, val_dataset) {
        (Ok(model_path), Ok(dataset_path), Ok(())) => Ok(ResolvedResources {
            model_path,
            dataset_path,
        }),
        (model, dataset, val_dataset) => Err([model.err(), dataset.err(), val_dataset.err()]
            .into_iter()
            .flatten()
            .collect()),
    }
}

fn resolve_model(spec_path: &str, model_dir: &Path) -> Result<PathBuf, String> {
    if let Some((_, file)) = MODEL_NAMES.iter().find(|(name, _)| *name == spec_path) {
        let path = model_dir.join(file);
        if !path.exists() {
            return Err(format!(
                "model {spec_path:?} is not installed ({} is missing); run `make models`",
                path.display()
            ));
        }
        return check_model_path(&path).map(|()| path);
    }
    let path = PathBuf::from(spec_path);
    // A Hugging Face Hub name (`Qwen/Qwen2.5-0.5B-Instruct`) is the snapshot the local HF
    // cache holds (offline): every service then reads the same folder.
    let path = match arl_model::hub::resolve_model_path(&path) {
        Ok(path) => path,
        Err(arl_model::hub::HubError::NotFound(_)) => {
            let names: Vec<_> = MODEL_NAMES.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "no such file or directory: {spec_path}; give a GGUF file, a Hugging Face \
                 folder, a Hugging Face Hub name in the local cache, or one of {names:?}"
            ));
        }
        Err(err) => return Err(err.to_string()),
    };
    check_model_path(&path).map(|()| path)
}

fn check_model_path(path: &Path) -> Result<(), String> {
    if path.is_dir() {
        if !path.join("config.json").is_file() {
            return Err(format!(
                "{} is a folder without config.json; a Hugging Face model folder needs config.json \
                 and *.safetensors",
                path.display()
            ));
        }
        return Ok(());
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .map_err(|err| format!("cannot read {}: {err}", path.display()))?;
    if &magic != b"GGUF" {
        return Err(format!(
            "{} is not a GGUF file (it starts with {magic:02x?}, not \"GGUF\")",
            path.display()
        ));
    }
    Ok(())
}

fn check_dataset(spec_path: &str, source: DataSource) -> Result<PathBuf, String> {
    let path = PathBuf::from(spec_path);
    if !path.exists() {
        return Err(format!("no such file or directory: {spec_path}"));
    }
    match source {
        DataSource::Harbor => {
            if !path.is_dir() {
                return Err(format!(
                    "{spec_path} is a file, but data.source = \"harbor\" needs a folder of task \
                     folders"
                ));
            }
            let has_task = std::fs::read_dir(&path)
                .map_err(|err| format!("cannot list {spec_path}: {err}"))?
                .filter_map(Result::ok)
                .any(|entry| entry.path().join("task.toml").is_file());
            if !has_task {
                return Err(format!(
                    "{spec_path} holds no Harbor task (no sub-folder with a task.toml)"
                ));
            }
        }
        DataSource::Gsm8k if path.is_dir() => {}
        DataSource::Swebench | DataSource::Gsm8k | DataSource::Verl => {
            let ext = path
                .extension()
                .and_then(|e| e.to_str())
                .unwrap_or_default();
            let allowed: &[&str] = match source {
                DataSource::Swebench | DataSource::Verl => &["jsonl", "json", "parquet", "arrow"],
                _ => &["jsonl", "json"],
            };
            if !path.is_file() || !allowed.contains(&ext) {
                return Err(format!(
                    "{spec_path} must be a file ending in one of {allowed:?}"
                ));
            }
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_resolve_names_and_check_files() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models");
        std::fs::create_dir_all(&models).unwrap();
        let tasks = dir.path().join("tasks");
        std::fs::create_dir_all(tasks.join("t1")).unwrap();
        std::fs::write(tasks.join("t1/task.toml"), "").unwrap();

        let mut spec = RunSpec::default();
        spec.data.dataset = tasks.to_string_lossy().into_owned();
        let errors = check(&spec, &models).unwrap_err();
        assert_eq!(errors[0].path, "model.path");
        assert!(errors[0].reason.contains("make models"), "{errors:?}");

        std::fs::write(
            models.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
            b"GGUF\x03\0\0\0",
        )
        .unwrap();
        let resolved = check(&spec, &models).unwrap();
        assert!(
            resolved
                .model_path
                .ends_with("SmolLM2-135M-Instruct.Q4_1.gguf")
        );

        let not_gguf = dir.path().join("x.gguf");
        std::fs::write(&not_gguf, b"PK\x03\x04").unwrap();
        spec.model.path = not_gguf.to_string_lossy().into_owned();
        spec.data.dataset = dir.path().join("none").to_string_lossy().into_owned();
        let errors = check(&spec, &models).unwrap_err();
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["model.path", "data.dataset"]);
        assert!(errors[0].reason.contains("not a GGUF file"));
    }

    /// VeRL's files: Parquet (or rows of the same shape), and the validation file is
    /// checked as the dataset is.
    #[test]
    fn verl_files_and_the_validation_file_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models");
        std::fs::create_dir_all(&models).unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"GGUF\x03\0\0\0").unwrap();
        let train = dir.path().join("train.parquet");
        std::fs::write(&train, b"PAR1").unwrap();
        let mut spec = RunSpec::default();
        spec.model.path = model.to_string_lossy().into_owned();
        spec.data.source = DataSource::Verl;
        spec.data.dataset = train.to_string_lossy().into_owned();
        spec.data.val_dataset = dir
            .path()
            .join("test.parquet")
            .to_string_lossy()
            .into_owned();
        let errors = check(&spec, &models).unwrap_err();
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["data.val_dataset"]);
        spec.data.val_dataset = train.to_string_lossy().into_owned();
        assert_eq!(check(&spec, &models).unwrap().dataset_path, train);
        spec.data.dataset = models.to_string_lossy().into_owned();
        assert_eq!(check(&spec, &models).unwrap_err()[0].path, "data.dataset");
    }

    /// A Hub name is looked up in the local Hugging Face cache; one that is not there is
    /// refused with where it was looked for, not as a missing file.
    #[test]
    fn a_hub_name_not_in_the_cache_is_refused_saying_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let err = resolve_model("arl-test-owner/not-downloaded-model", dir.path()).unwrap_err();
        assert!(
            err.contains("local Hugging Face cache")
                && err.contains("models--arl-test-owner--not-downloaded-model"),
            "{err}"
        );
    }
}
