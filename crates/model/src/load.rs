//! Opening a model from disk: a GGUF file or a Hugging Face folder.

use std::path::Path;

use crate::chat::{ChatError, ChatTemplate};
use crate::config::{ConfigError, ModelConfig};
use crate::gguf::{GgufError, GgufFile};
use crate::hub::{HubError, resolve_model_path};
use crate::model::Model;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::weights::{StoredDtype, Weights, WeightsError};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {reason}")]
    Path { path: String, reason: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error(transparent)]
    Hub(#[from] HubError),
}

/// The model alone, without its tokenizer (token ids in, log-probabilities out): a GGUF
/// file or a Hugging Face folder with config.json and safetensors.
pub fn open_model(path: &Path) -> Result<Model, LoadError> {
    let path = &resolve_model_path(path)?;
    if path.is_dir() {
        open_hf_model(path)
    } else if path.exists() {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let weights = Weights::from_gguf(&file, &config)?;
        let packed = crate::weights::packed_from_gguf(&file, &config);
        Ok(Model::new(config, weights).with_packed(packed))
    } else {
        Err(LoadError::Path {
            path: path.display().to_string(),
            reason: "no such file or directory".into(),
        })
    }
}

/// The tokenizer alone: a Hugging Face folder's tokenizer.json or a GGUF's vocabulary
/// (paths and Hub names as [`open_model`]).
pub fn open_tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
    let path = &resolve_model_path(path)?;
    if path.is_dir() {
        Ok(Tokenizer::from_file(&path.join("tokenizer.json"))?)
    } else {
        Ok(Tokenizer::from_gguf(&GgufFile::open(path)?)?)
    }
}

/// A Hugging Face folder's config.json and safetensors weights.
pub fn open_hf_model(dir: &Path) -> Result<Model, LoadError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| LoadError::Path {
        path: config_path.display().to_string(),
        reason: e.to_string(),
    })?;
    let config = ModelConfig::from_hf_json(&text)?;
    let weights = Weights::from_safetensors_dir(dir, &config)?;
    Ok(Model::new(config, weights))
}

/// Writes the model alone as a Hugging Face folder: config.json and model.safetensors.
pub fn save_hf_model(model: &Model, dir: &Path, dtype: StoredDtype) -> Result<(), LoadError> {
    let io = |e: std::io::Error| LoadError::Path {
        path: dir.display().to_string(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let config = serde_json::to_string_pretty(&model.config.to_hf_json()).unwrap_or_default();
    std::fs::write(dir.join("config.json"), config).map_err(io)?;
    model
        .weights
        .save_safetensors_as(&dir.join("model.safetensors"), dtype)?;
    Ok(())
}

/// A model with everything needed to talk to it.
#[derive(Clone, Debug)]
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Where it came from and in which format, for `arl model info`.
    pub source: String,
    pub format: &'static str,
    pub chat_template_source: Option<String>,
}

impl LoadedModel {
    /// A GGUF file or a Hugging Face folder: a path, or a Hub name (`Qwen/Qwen2.5-0.5B`)
    /// from the local Hugging Face cache ([`crate::hub`]).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let path = &resolve_model_path(path)?;
        if path.is_dir() {
            Self::open_hf(path)
        } else if path.exists() {
            Self::open_gguf(path)
        } else {
            Err(LoadError::Path {
                path: path.display().to_string(),
                reason: "no such file or directory".into(),
            })
        }
    }

    pub fn open_gguf(path: &Path) -> Result<Self, LoadError> {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let weights = Weights::from_gguf(&file, &config)?;
        let packed = crate::weights::packed_from_gguf(&file, &config);
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let template_source = file.string("tokenizer.chat_template").map(str::to_owned);
        let token = |key: &str| {
            file.u64(key)
                .and_then(|id| tokenizer.id_to_token(id as u32))
                .unwrap_or_default()
        };
        let chat_template = match &template_source {
            Some(source) => Some(ChatTemplate::new(
                source,
                &token("tokenizer.ggml.bos_token_id"),
                &token("tokenizer.ggml.eos_token_id"),
            )?),
            None => None,
        };
        Ok(Self {
            model: Model::new(config, weights).with_packed(packed),
            tokenizer,
            chat_template,
            source: path.display().to_string(),
            format: "gguf",
            chat_template_source: template_source,
        })
    }

    pub fn open_hf(dir: &Path) -> Result<Self, LoadError> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name)).map_err(|e| LoadError::Path {
                path: dir.join(name).display().to_string(),
                reason: e.to_string(),
            })
        };
        let model = open_hf_model(dir)?;
        let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
        let tokenizer_config: serde_json::Value = read("tokenizer_config.json")
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let template_source = crate::chat::hf_template_source(dir, &tokenizer_config)?;
        let special = |key: &str| match &tokenizer_config[key] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => o
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or_default()
                .to_owned(),
            _ => String::new(),
        };
        let chat_template = match &template_source {
            Some(source) => Some(ChatTemplate::new(
                source,
                &special("bos_token"),
                &special("eos_token"),
            )?),
            None => None,
        };
        Ok(Self {
            model,
            tokenizer,
            chat_template,
            source: dir.display().to_string(),
            format: "huggingface",
            chat_template_source: template_source,
        })
    }

    /// Writes a Hugging Face folder: config.json, model.safetensors, tokenizer.json,
    /// tokenizer_config.json (with the chat template), generation_config.json.
    pub fn save_hf(&self, dir: &Path) -> Result<(), LoadError> {
        self.save_hf_as(dir, StoredDtype::F32)
    }

    /// [`Self::save_hf`] with the weights stored as `dtype`.
    /// This model as a file of it written as `dtype` loads back (the weights rounded),
    /// named `source`.
    pub fn as_stored(&self, dtype: StoredDtype, source: String) -> LoadedModel {
        LoadedModel {
            model: Model::new(
                self.model.config.clone(),
                self.model.weights.as_stored(dtype),
            ),
            tokenizer: self.tokenizer.clone(),
            chat_template: self.chat_template.clone(),
            source,
            format: "huggingface",
            chat_template_source: self.chat_template_source.clone(),
        }
    }

    pub fn save_hf_as(&self, dir: &Path, dtype: StoredDtype) -> Result<(), LoadError> {
        let io = |e: std::io::Error| LoadError::Path {
            path: dir.display().to_string(),
            reason: e.to_string(),
        };
        save_hf_model(&self.model, dir, dtype)?;
        std::fs::write(dir.join("tokenizer.json"), self.tokenizer.to_json()?).map_err(io)?;
        let name = |id: Option<u32>| id.and_then(|i| self.tokenizer.id_to_token(i));
        let tokenizer_config = serde_json::json!({
            "chat_template": self.chat_template_source,
            "bos_token": name(self.tokenizer.bos_id()),
            "eos_token": name(self.tokenizer.eos_id()),
        });
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::to_string_pretty(&tokenizer_config).unwrap_or_default(),
        )
        .map_err(io)?;
        let generation = serde_json::json!({ "eos_token_id": self.tokenizer.stop_ids() });
        std::fs::write(dir.join("generation_config.json"), generation.to_string()).map_err(io)?;
        Ok(())
    }
}
