//! Model configuration, read from Hugging Face `config.json` or from GGUF metadata.

use serde::{Deserialize, Serialize};

use crate::gguf::GgufFile;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("model_type {0:?} is not supported; ARL runs \"llama\" and \"qwen2\"")]
    Architecture(String),
    #[error("{0} is missing from the model's configuration")]
    Missing(String),
    #[error("config.json: {0}")]
    Json(String),
    #[error("inconsistent configuration: {0}")]
    Inconsistent(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Qwen2,
}

impl Architecture {
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
        }
    }

    /// Qwen2 has biases on the q, k and v projections.
    pub fn qkv_bias(self) -> bool {
        self == Architecture::Qwen2
    }
}

/// Llama 3's frequency-dependent RoPE scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    pub fn kv_dim(&self) -> usize {
        self.head_dim() * self.num_key_value_heads
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Inconsistent(m));
        // Bounds far beyond any released model of these architectures: a crafted file's
        // sizes must not turn into overflowing products or giant allocations.
        for (name, value, max) in [
            ("vocab_size", self.vocab_size, 1 << 22),
            ("hidden_size", self.hidden_size, 1 << 16),
            ("intermediate_size", self.intermediate_size, 1 << 20),
            ("num_hidden_layers", self.num_hidden_layers, 1 << 10),
            ("num_attention_heads", self.num_attention_heads, 1 << 10),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1 << 24,
            ),
        ] {
            if value == 0 || value > max {
                return bad(format!("{name} {value} is outside 1..={max}"));
            }
        }
        for (name, value) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return bad(format!("{name} {value} must be a positive number"));
            }
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return bad(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim()
            ));
        }
        Ok(())
    }

    /// From Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ConfigError> {
        #[derive(Deserialize)]
        struct Hf {
            model_type: String,
            vocab_size: usize,
            hidden_size: usize,
            intermediate_size: usize,
            num_hidden_layers: usize,
            num_attention_heads: usize,
            num_key_value_heads: Option<usize>,
            rms_norm_eps: f64,
            #[serde(default = "default_theta")]
            rope_theta: f64,
            rope_scaling: Option<serde_json::Value>,
            #[serde(default = "default_max_positions")]
            max_position_embeddings: usize,
            #[serde(default)]
            tie_word_embeddings: bool,
        }
        fn default_theta() -> f64 {
            10_000.0
        }
        fn default_max_positions() -> usize {
            4096
        }
        let hf: Hf = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let architecture = match hf.model_type.as_str() {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            other => return Err(ConfigError::Architecture(other.to_owned())),
        };
        let rope_scaling = match hf.rope_scaling {
            Some(v)
                if v.get("rope_type")
                    .or(v.get("type"))
                    .and_then(|t| t.as_str())
                    == Some("llama3") =>
            {
                let f = |k: &str| {
                    v.get(k)
                        .and_then(serde_json::Value::as_f64)
                        .ok_or_else(|| ConfigError::Missing(format!("rope_scaling.{k}")))
                };
                Some(Llama3RopeScaling {
                    factor: f("factor")?,
                    low_freq_factor: f("low_freq_factor")?,
                    high_freq_factor: f("high_freq_factor")?,
                    original_max_position_embeddings: f("original_max_position_embeddings")?,
                })
            }
            _ => None,
        };
        let config = Self {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            rope_scaling,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
        };
        config.validate()?;
        Ok(config)
    }

    /// From GGUF metadata (`<arch>.*` keys).
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ConfigError> {
        let arch = file
            .string("general.architecture")
            .unwrap_or_default()
            .to_owned();
        let architecture = match arch.as_str() {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            other => return Err(ConfigError::Architecture(other.to_owned())),
        };
        let key = |k: &str| format!("{arch}.{k}");
        let int = |k: &str| {
            file.u64(&key(k))
                .map(|v| v as usize)
                .ok_or_else(|| ConfigError::Missing(key(k)))
        };
        let vocab_size = match file.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(tokens) => tokens.len(),
            None => int("vocab_size")?,
        };
        let heads = int("attention.head_count")?;
        let rope_scaling = match file.string(&key("rope.scaling.type")) {
            Some("llama3") => Some(Llama3RopeScaling {
                factor: file.f64(&key("rope.scaling.factor")).unwrap_or(8.0),
                low_freq_factor: file
                    .f64(&key("rope.scaling.low_freq_factor"))
                    .unwrap_or(1.0),
                high_freq_factor: file
                    .f64(&key("rope.scaling.high_freq_factor"))
                    .unwrap_or(4.0),
                original_max_position_embeddings: file
                    .f64(&key("rope.scaling.original_context_length"))
                    .unwrap_or(8192.0),
            }),
            _ => None,
        };
        let config = Self {
            architecture,
            vocab_size,
            hidden_size: int("embedding_length")?,
            intermediate_size: int("feed_forward_length")?,
            num_hidden_layers: int("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: file
                .u64(&key("attention.head_count_kv"))
                .map_or(heads, |v| v as usize),
            rms_norm_eps: file
                .f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
            rope_theta: file.f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: int("context_length")?,
            tie_word_embeddings: file.tensor("output.weight").is_none(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Hugging Face `config.json` for a checkpoint.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let mut json = serde_json::json!({
            "architectures": [match self.architecture { Architecture::Llama => "LlamaForCausalLM", Architecture::Qwen2 => "Qwen2ForCausalLM" }],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        });
        if let Some(s) = &self.rope_scaling {
            json["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        json
    }

    /// RoPE inverse frequencies, one per pair of a head's dimensions (Hugging Face's
    /// `rotate_half` layout: dimension i pairs with i + head_dim/2).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let dim = self.head_dim();
        let base: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / dim as f64))
            .collect();
        let Some(s) = &self.rope_scaling else {
            return base;
        };
        let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
        base.into_iter()
            .map(|freq| {
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / s.factor
                } else {
                    let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * freq / s.factor + smooth * freq
                }
            })
            .collect()
    }
}
