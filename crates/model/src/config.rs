//! Model configuration, read from Hugging Face `config.json` or from GGUF metadata.
//!
//! Rule: no field that changes the model's arithmetic is ever guessed. A missing
//! `rms_norm_eps` or `rope_theta`, an activation other than SiLU, biases, sliding-window
//! attention or a RoPE variant ARL does not implement is an error naming the field — a
//! model that loads computes what transformers (or llama.cpp, for GGUF) computes.
//! Defaults are kept only where the reference itself defines one and a wrong guess could
//! not go unnoticed (`num_key_value_heads`, `tie_word_embeddings`: weight shapes and
//! names are checked against them) or where the value is no part of the arithmetic
//! (`max_position_embeddings`, unless a RoPE type reads it).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::gguf::GgufFile;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("model_type {0:?} is not supported; ARL runs \"llama\", \"qwen2\" and \"qwen3\"")]
    Architecture(String),
    #[error("{0} is missing from the model's configuration")]
    Missing(String),
    #[error("config.json: {0}")]
    Json(String),
    #[error("inconsistent configuration: {0}")]
    Inconsistent(String),
    #[error(
        "rope_type {0:?} is not supported; ARL implements \"default\", \"linear\", \"llama3\" and \"yarn\""
    )]
    RopeType(String),
    /// A setting ARL reads but does not implement: loading would compute another model.
    #[error("{field} = {value} is not supported: {why}")]
    Unsupported {
        field: String,
        value: String,
        why: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Qwen2,
    /// Qwen3: an RMSNorm over each head's queries and keys before RoPE (`q_norm`,
    /// `k_norm`), no q/k/v biases, and a head size of its own: `head_dim` need not be
    /// hidden_size / num_attention_heads (Qwen3-0.6B: 1024 wide, 16 heads of 128).
    /// The head size lives here, not in a field of [`ModelConfig`], because only this
    /// family has one of its own.
    Qwen3 {
        head_dim: usize,
    },
}

impl Architecture {
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 { .. } => "qwen3",
        }
    }

    /// Transformers' class for `architectures` in config.json.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 { .. } => "Qwen3ForCausalLM",
        }
    }

    /// Qwen2 has biases on the q, k and v projections.
    pub fn qkv_bias(self) -> bool {
        self == Architecture::Qwen2
    }

    /// Qwen3 normalizes each head's queries and keys (weights of head_dim) before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 { .. })
    }

    /// Transformers' `max_position_embeddings` when config.json has none (it is the
    /// context limit only: no arithmetic reads it unless a RoPE type does).
    fn default_max_positions(self) -> usize {
        match self {
            Architecture::Llama => 2048,
            Architecture::Qwen2 | Architecture::Qwen3 { .. } => 32768,
        }
    }
}

/// Llama 3's frequency-dependent RoPE scaling (`rope_type = "llama3"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// YaRN (`rope_type = "yarn"`), as written in the config: the optional fields stay
/// optional so that a saved config says exactly what the loaded one said; the defaults
/// transformers applies are applied where they are used ([`RopeScaling::attention_factor`],
/// [`ModelConfig::rope_inv_freq`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct YarnRopeScaling {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub attention_factor: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub truncate: Option<bool>,
}

/// How RoPE's frequencies are rescaled for long contexts (none: transformers' "default").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        factor: f64,
    },
    Llama3(Llama3RopeScaling),
    Yarn(YarnRopeScaling),
}

impl RopeScaling {
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3(_) => "llama3",
            RopeScaling::Yarn(_) => "yarn",
        }
    }

    /// The factor transformers multiplies cos and sin by (`attention_scaling`): YaRN's
    /// mscale, 1 for every other type. It scales queries and keys alike, so attention
    /// logits grow by its square.
    pub fn attention_factor(&self) -> f64 {
        let RopeScaling::Yarn(y) = self else {
            return 1.0;
        };
        if let Some(a) = y.attention_factor {
            return a;
        }
        // transformers' `get_mscale`: 0.1·m·ln(s) + 1 for s > 1.
        let get_mscale = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        // Python truthiness: a 0 or absent mscale falls back to the factor-only formula.
        match (y.mscale, y.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                get_mscale(y.factor, m) / get_mscale(y.factor, all)
            }
            _ => get_mscale(y.factor, 1.0),
        }
    }
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
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

/// The RoPE types ARL implements, for error messages.
const ROPE_TYPES: &str = "\"default\", \"linear\", \"llama3\" and \"yarn\"";

impl ModelConfig {
    /// The configuration (`config.json`) of Qwen2.5-0.5B or -1.5B by name
    /// (`qwen2.5-0.5b`, `qwen2.5-1.5b`; the -Instruct builds share it): benchmarks build
    /// random weights of these shapes, with nothing to download.
    pub fn qwen25(name: &str) -> Option<Self> {
        let (hidden, intermediate, layers, heads) = match name {
            "qwen2.5-0.5b" => (896, 4864, 24, 14),
            "qwen2.5-1.5b" => (1536, 8960, 28, 12),
            _ => return None,
        };
        Some(Self {
            architecture: Architecture::Qwen2,
            vocab_size: 151_936,
            hidden_size: hidden,
            intermediate_size: intermediate,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: 2,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 32_768,
            tie_word_embeddings: true,
        })
    }

    /// The size of one attention head.
    pub fn head_dim(&self) -> usize {
        match self.architecture {
            Architecture::Qwen3 { head_dim } => head_dim,
            _ => self.hidden_size / self.num_attention_heads.max(1),
        }
    }

    /// Width of the queries and of the attention output: nh·hd (the hidden size, except
    /// where `head_dim` is a family's own).
    pub fn q_dim(&self) -> usize {
        self.head_dim() * self.num_attention_heads
    }

    pub fn kv_dim(&self) -> usize {
        self.head_dim() * self.num_key_value_heads
    }

    /// RoPE's post-scaling of cos and sin (YaRN's mscale; 1 otherwise).
    pub fn rope_attention_factor(&self) -> f64 {
        self.rope_scaling
            .as_ref()
            .map_or(1.0, RopeScaling::attention_factor)
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
            ("head_dim", self.head_dim(), 1 << 12),
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
        if !self.architecture.qk_norm()
            && !self.hidden_size.is_multiple_of(self.num_attention_heads)
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
        if let Some(scaling) = &self.rope_scaling {
            let positive = |name: &str, v: f64| {
                if v.is_finite() && v > 0.0 {
                    Ok(())
                } else {
                    bad(format!(
                        "rope_parameters.{name} {v} must be a positive number"
                    ))
                }
            };
            match scaling {
                RopeScaling::Linear { factor } => positive("factor", *factor)?,
                RopeScaling::Llama3(s) => {
                    positive("factor", s.factor)?;
                    positive("low_freq_factor", s.low_freq_factor)?;
                    positive("high_freq_factor", s.high_freq_factor)?;
                    positive(
                        "original_max_position_embeddings",
                        s.original_max_position_embeddings,
                    )?;
                    if s.high_freq_factor == s.low_freq_factor {
                        return bad(
                            "rope_parameters.high_freq_factor equals low_freq_factor".into()
                        );
                    }
                }
                RopeScaling::Yarn(y) => {
                    positive("factor", y.factor)?;
                    positive(
                        "original_max_position_embeddings",
                        y.original_max_position_embeddings,
                    )?;
                    let a = scaling.attention_factor();
                    if !(a.is_finite() && a > 0.0) {
                        return bad(format!("yarn attention factor {a} must be positive"));
                    }
                }
            }
        }
        Ok(())
    }

    /// From Hugging Face `config.json`, in the layout of transformers 4 (top-level
    /// `rope_theta`, `rope_scaling`) or 5 (`rope_parameters: {rope_type, rope_theta, …}`).
    pub fn from_hf_json(text: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let Some(hf) = value.as_object() else {
            return Err(ConfigError::Json("the top level is not an object".into()));
        };
        let fields = HfFields(hf);
        let model_type = fields.string("model_type")?;
        let num_attention_heads = fields.usize("num_attention_heads")?;
        let hidden_size = fields.usize("hidden_size")?;
        let architecture = match model_type.as_str() {
            "llama" | "qwen2" => {
                // Transformers reads an explicit head_dim for these too; ARL's kernels
                // for them assume hidden_size / num_attention_heads.
                if let Some(hd) = fields.opt_usize("head_dim")?
                    && (num_attention_heads == 0 || hd * num_attention_heads != hidden_size)
                {
                    return Err(ConfigError::Unsupported {
                        field: "head_dim".into(),
                        value: hd.to_string(),
                        why: format!(
                            "{model_type} models run with head_dim = hidden_size / \
                             num_attention_heads ({hidden_size} / {num_attention_heads})"
                        ),
                    });
                }
                if model_type == "llama" {
                    Architecture::Llama
                } else {
                    Architecture::Qwen2
                }
            }
            // transformers' Qwen3Config defaults head_dim to 128, whatever the width: not
            // a guess to make, and every released Qwen3 config writes it.
            "qwen3" => Architecture::Qwen3 {
                head_dim: fields.usize("head_dim")?,
            },
            other => return Err(ConfigError::Architecture(other.to_owned())),
        };
        fields.refuse_unsupported(architecture)?;
        let max_positions = fields.opt_usize("max_position_embeddings")?;
        let (rope_theta, rope_scaling) = hf_rope(hf, max_positions)?;
        let config = Self {
            architecture,
            vocab_size: fields.usize("vocab_size")?,
            hidden_size,
            intermediate_size: fields.usize("intermediate_size")?,
            num_hidden_layers: fields.usize("num_hidden_layers")?,
            num_attention_heads,
            // Transformers' own default (multi-head attention); a wrong one cannot load:
            // the k/v projections' shapes are checked against it.
            num_key_value_heads: fields
                .opt_usize("num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            rms_norm_eps: fields.f64("rms_norm_eps")?,
            rope_theta,
            rope_scaling,
            max_position_embeddings: max_positions
                .unwrap_or_else(|| architecture.default_max_positions()),
            // Transformers' default for all three families; a wrong one cannot load
            // either: an untied model without lm_head.weight is refused by name.
            tie_word_embeddings: fields.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        };
        config.validate()?;
        Ok(config)
    }

    /// From GGUF metadata (`<arch>.*` keys), following llama.cpp: a key llama.cpp reads
    /// as optional with a default gets that default here; a key it requires is required.
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
        let float = |k: &str| {
            file.f64(&key(k))
                .ok_or_else(|| ConfigError::Missing(key(k)))
        };
        let vocab_size = match file.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(tokens) => tokens.len(),
            None => int("vocab_size")?,
        };
        let heads = int("attention.head_count")?;
        if file.tensor("rope_freqs.weight").is_some() {
            // llama.cpp's form of Llama 3 RoPE scaling: per-frequency divisors computed
            // at conversion time. Reading them is not implemented; ignoring them would
            // run another model.
            return Err(ConfigError::Unsupported {
                field: "tensor rope_freqs.weight".into(),
                value: "present".into(),
                why: "per-frequency RoPE factors (llama.cpp's Llama 3 scaling) are not \
                      implemented for GGUF; use the model's Hugging Face folder"
                    .into(),
            });
        }
        let rope_scaling = match file.string(&key("rope.scaling.type")) {
            None | Some("none") => None,
            // llama.cpp reads rope.scaling.factor as optional, 0 (absent) meaning none.
            Some("linear") => match file.f64(&key("rope.scaling.factor")) {
                None => None,
                Some(f) if f == 0.0 || f == 1.0 => None,
                Some(factor) => Some(RopeScaling::Linear { factor }),
            },
            // Not a llama.cpp scaling type, but ARL's own checkpoints converted earlier
            // carried it: every parameter must be present.
            Some("llama3") => Some(RopeScaling::Llama3(Llama3RopeScaling {
                factor: float("rope.scaling.factor")?,
                low_freq_factor: float("rope.scaling.low_freq_factor")?,
                high_freq_factor: float("rope.scaling.high_freq_factor")?,
                original_max_position_embeddings: float("rope.scaling.original_context_length")?,
            })),
            Some(other) => {
                return Err(ConfigError::Unsupported {
                    field: key("rope.scaling.type"),
                    value: format!("{other:?}"),
                    why: "GGUF models run with no or linear RoPE scaling".into(),
                });
            }
        };
        let config = Self {
            architecture,
            vocab_size,
            hidden_size: int("embedding_length")?,
            intermediate_size: int("feed_forward_length")?,
            num_hidden_layers: int("block_count")?,
            num_attention_heads: heads,
            // llama.cpp: head_count_kv defaults to head_count.
            num_key_value_heads: file
                .u64(&key("attention.head_count_kv"))
                .map_or(heads, |v| v as usize),
            // llama.cpp requires it for llama and qwen2.
            rms_norm_eps: float("attention.layer_norm_rms_epsilon")?,
            // llama.cpp: rope_freq_base_train = 10000 unless rope.freq_base says otherwise.
            rope_theta: file.f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: int("context_length")?,
            tie_word_embeddings: file.tensor("output.weight").is_none(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Hugging Face `config.json` for a checkpoint, in transformers 5's layout
    /// (`rope_parameters`) with the top-level `rope_theta` (and `rope_scaling`) of
    /// transformers 4 beside it, saying the same thing: both read it back identically.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let mut rope = serde_json::json!({
            "rope_type": self.rope_scaling.as_ref().map_or("default", RopeScaling::rope_type),
            "rope_theta": self.rope_theta,
        });
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => rope["factor"] = (*factor).into(),
            Some(RopeScaling::Llama3(s)) => {
                rope["factor"] = s.factor.into();
                rope["low_freq_factor"] = s.low_freq_factor.into();
                rope["high_freq_factor"] = s.high_freq_factor.into();
                rope["original_max_position_embeddings"] =
                    integral(s.original_max_position_embeddings);
            }
            Some(RopeScaling::Yarn(y)) => {
                rope["factor"] = y.factor.into();
                rope["original_max_position_embeddings"] =
                    integral(y.original_max_position_embeddings);
                for (name, v) in [
                    ("attention_factor", y.attention_factor),
                    ("mscale", y.mscale),
                    ("mscale_all_dim", y.mscale_all_dim),
                    ("beta_fast", y.beta_fast),
                    ("beta_slow", y.beta_slow),
                ] {
                    if let Some(v) = v {
                        rope[name] = v.into();
                    }
                }
                if let Some(t) = y.truncate {
                    rope["truncate"] = t.into();
                }
            }
        }
        let mut json = serde_json::json!({
            "architectures": [self.architecture.class_name()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim(),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope.clone(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "torch_dtype": "float32",
        });
        if self.architecture == Architecture::Llama {
            json["mlp_bias"] = false.into();
        }
        if self.rope_scaling.is_some() {
            let mut scaling = rope;
            if let Some(o) = scaling.as_object_mut() {
                o.remove("rope_theta");
            }
            json["rope_scaling"] = scaling;
        }
        json
    }

    /// RoPE inverse frequencies, one per pair of a head's dimensions (Hugging Face's
    /// `rotate_half` layout: dimension i pairs with i + head_dim/2), as transformers 5's
    /// `modeling_rope_utils.py` computes them for each rope_type.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let dim = self.head_dim();
        let base: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / dim as f64))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3(s)) => llama3_inv_freq(&base, s),
            Some(RopeScaling::Yarn(y)) => yarn_inv_freq(&base, y, self.rope_theta, dim),
        }
    }
}

/// `_compute_llama3_parameters`: low frequencies divided by `factor`, high ones kept,
/// a smooth blend between.
fn llama3_inv_freq(base: &[f64], s: &Llama3RopeScaling) -> Vec<f64> {
    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    base.iter()
        .map(|&freq| {
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

/// `_compute_yarn_parameters`: per dimension pair, a ramp between extrapolation (the
/// base frequency) and interpolation (divided by `factor`) over the pairs whose number
/// of rotations in the original context lies between beta_slow and beta_fast.
fn yarn_inv_freq(base: &[f64], y: &YarnRopeScaling, theta: f64, dim: usize) -> Vec<f64> {
    // `get("beta_fast") or 32`: absent or 0 takes the paper's value.
    let beta_fast = y.beta_fast.filter(|b| *b != 0.0).unwrap_or(32.0);
    let beta_slow = y.beta_slow.filter(|b| *b != 0.0).unwrap_or(1.0);
    let dimf = dim as f64;
    let correction_dim = |rotations: f64| {
        dimf * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if y.truncate.unwrap_or(true) {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(dimf - 1.0));
    if low == high {
        high += 0.001; // transformers: prevents a division by zero
    }
    base.iter()
        .enumerate()
        .map(|(i, &freq)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            freq / y.factor * (1.0 - extrapolation) + freq * extrapolation
        })
        .collect()
}

/// A position count as JSON: an integer when it is one (transformers writes ints).
fn integral(v: f64) -> Value {
    if v.fract() == 0.0 && (0.0..9.0e15).contains(&v) {
        (v as u64).into()
    } else {
        v.into()
    }
}

/// Typed access to config.json's fields; every error names the field.
struct HfFields<'a>(&'a Map<String, Value>);

impl HfFields<'_> {
    /// The value of a present, non-null field.
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn wrong(name: &str, v: &Value, what: &str) -> ConfigError {
        ConfigError::Json(format!("{name} is {v}, expected {what}"))
    }

    fn string(&self, name: &str) -> Result<String, ConfigError> {
        let v = self
            .get(name)
            .ok_or_else(|| ConfigError::Missing(name.into()))?;
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| Self::wrong(name, v, "a string"))
    }

    fn opt_usize(&self, name: &str) -> Result<Option<usize>, ConfigError> {
        self.get(name)
            .map(|v| {
                v.as_u64()
                    .and_then(|u| usize::try_from(u).ok())
                    .ok_or_else(|| Self::wrong(name, v, "a non-negative integer"))
            })
            .transpose()
    }

    fn usize(&self, name: &str) -> Result<usize, ConfigError> {
        self.opt_usize(name)?
            .ok_or_else(|| ConfigError::Missing(name.into()))
    }

    fn opt_f64(&self, name: &str) -> Result<Option<f64>, ConfigError> {
        self.get(name)
            .map(|v| v.as_f64().ok_or_else(|| Self::wrong(name, v, "a number")))
            .transpose()
    }

    fn f64(&self, name: &str) -> Result<f64, ConfigError> {
        self.opt_f64(name)?
            .ok_or_else(|| ConfigError::Missing(name.into()))
    }

    fn opt_bool(&self, name: &str) -> Result<Option<bool>, ConfigError> {
        self.get(name)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| Self::wrong(name, v, "true or false"))
            })
            .transpose()
    }

    /// Settings of these families that change the arithmetic and that ARL does not
    /// implement. Fields not named here do not change what the model computes:
    /// `attention_dropout` (dropout is off outside transformers' training mode, and ARL
    /// trains without it), `torch_dtype`/`dtype` (the storage type: weights are read in
    /// whatever type the safetensors hold and computed in f32), token ids, `use_cache`,
    /// `initializer_range`, `max_window_layers` (read only with sliding windows on).
    fn refuse_unsupported(&self, architecture: Architecture) -> Result<(), ConfigError> {
        let unsupported = |field: &str, value: &Value, why: &str| ConfigError::Unsupported {
            field: field.into(),
            value: value.to_string(),
            why: why.into(),
        };
        // Every family's default is SiLU, but an activation is not a thing to assume.
        let act = self.string("hidden_act")?;
        if act != "silu" {
            return Err(unsupported(
                "hidden_act",
                &Value::String(act),
                "the MLP is SwiGLU with SiLU (\"silu\")",
            ));
        }
        // Qwen2 always has q/k/v biases (its config has no switch); Llama and Qwen3 have
        // them, and an o_proj bias, only with attention_bias.
        if architecture != Architecture::Qwen2 && self.opt_bool("attention_bias")? == Some(true) {
            return Err(unsupported(
                "attention_bias",
                &Value::Bool(true),
                "ARL's llama and qwen3 attention has no biases",
            ));
        }
        if self.opt_bool("mlp_bias")? == Some(true) {
            return Err(unsupported(
                "mlp_bias",
                &Value::Bool(true),
                "ARL's MLP has no biases",
            ));
        }
        if self.opt_bool("use_sliding_window")? == Some(true) {
            return Err(unsupported(
                "use_sliding_window",
                &Value::Bool(true),
                "ARL attends over the whole context in every layer",
            ));
        }
        if let Some(types) = self.get("layer_types") {
            let all_full = types
                .as_array()
                .is_some_and(|t| t.iter().all(|t| t.as_str() == Some("full_attention")));
            if !all_full {
                return Err(unsupported(
                    "layer_types",
                    types,
                    "every layer must be \"full_attention\"",
                ));
            }
        }
        if let Some(f) = self.opt_f64("partial_rotary_factor")?
            && f != 1.0
        {
            return Err(unsupported(
                "partial_rotary_factor",
                &f.into(),
                "RoPE rotates the whole head",
            ));
        }
        Ok(())
    }
}

/// (rope_theta, scaling) from either layout, with transformers 5's precedence
/// (`convert_rope_params_to_dict`, `standardize_rope_params`): the `rope_scaling` dict if
/// there is one, else `rope_parameters`; `rope_theta` from that dict, else top level;
/// `original_max_position_embeddings` from the dict, else top level, else
/// `max_position_embeddings`.
fn hf_rope(
    hf: &Map<String, Value>,
    max_positions: Option<usize>,
) -> Result<(f64, Option<RopeScaling>), ConfigError> {
    let empty = Map::new();
    let (dict_name, dict) = match (
        hf.get("rope_scaling").filter(|v| !v.is_null()),
        hf.get("rope_parameters").filter(|v| !v.is_null()),
    ) {
        (Some(v), _) => ("rope_scaling", v),
        (None, Some(v)) => ("rope_parameters", v),
        (None, None) => ("rope_parameters", &Value::Null),
    };
    let dict = match dict {
        Value::Null => &empty,
        Value::Object(o) => o,
        other => {
            return Err(ConfigError::Json(format!(
                "{dict_name} is {other}, expected an object"
            )));
        }
    };
    if dict.values().any(Value::is_object) {
        return Err(ConfigError::Unsupported {
            field: dict_name.into(),
            value: "one set per layer type".into(),
            why: "ARL's families use one RoPE for every layer".into(),
        });
    }
    let field = |k: &str| format!("{dict_name}.{k}");
    let number = |k: &str| -> Result<Option<f64>, ConfigError> {
        match dict.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                ConfigError::Json(format!("{} is {v}, expected a number", field(k)))
            }),
        }
    };
    let required = |k: &str| number(k)?.ok_or_else(|| ConfigError::Missing(field(k)));
    let top = HfFields(hf);
    let rope_theta = match number("rope_theta")? {
        Some(t) => t,
        None => top.opt_f64("rope_theta")?.ok_or_else(|| {
            ConfigError::Missing(
                "rope_theta (neither rope_parameters.rope_theta nor a top-level rope_theta)".into(),
            )
        })?,
    };
    if let Some(f) = number("partial_rotary_factor")?
        && f != 1.0
    {
        return Err(ConfigError::Unsupported {
            field: field("partial_rotary_factor"),
            value: f.to_string(),
            why: "RoPE rotates the whole head".into(),
        });
    }
    let rope_type = match dict.get("rope_type").or(dict.get("type")) {
        None | Some(Value::Null) => "default".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(ConfigError::Json(format!(
                "{} is {other}, expected a string",
                field("rope_type")
            )));
        }
    };
    let original_max = || -> Result<f64, ConfigError> {
        if let Some(v) = number("original_max_position_embeddings")? {
            return Ok(v);
        }
        if let Some(v) = top.opt_f64("original_max_position_embeddings")? {
            return Ok(v);
        }
        max_positions.map(|m| m as f64).ok_or_else(|| {
            ConfigError::Missing(format!(
                "{} (or max_position_embeddings, which rope_type {rope_type:?} reads in its place)",
                field("original_max_position_embeddings")
            ))
        })
    };
    let scaling = match rope_type.as_str() {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: required("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3(Llama3RopeScaling {
            factor: required("factor")?,
            low_freq_factor: required("low_freq_factor")?,
            high_freq_factor: required("high_freq_factor")?,
            original_max_position_embeddings: original_max()?,
        })),
        "yarn" => Some(RopeScaling::Yarn(YarnRopeScaling {
            factor: required("factor")?,
            original_max_position_embeddings: original_max()?,
            attention_factor: number("attention_factor")?,
            mscale: number("mscale")?,
            mscale_all_dim: number("mscale_all_dim")?,
            beta_fast: number("beta_fast")?,
            beta_slow: number("beta_slow")?,
            truncate: match dict.get("truncate") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_bool().ok_or_else(|| {
                    ConfigError::Json(format!(
                        "{} is {v}, expected true or false",
                        field("truncate")
                    ))
                })?),
            },
        })),
        "dynamic" => {
            return Err(ConfigError::Unsupported {
                field: field("rope_type"),
                value: "\"dynamic\"".into(),
                why: format!(
                    "dynamic NTK scaling recomputes the frequencies from the longest position \
                     of each forward call (and transformers keeps the longest seen so far), so \
                     one token's log-probability would depend on what else is in the batch and \
                     on earlier calls; ARL needs the sampler's and the trainer's log-probabilities \
                     to agree. Supported: {ROPE_TYPES}"
                ),
            });
        }
        other => return Err(ConfigError::RopeType(other.to_owned())),
    };
    Ok((rope_theta, scaling))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    /// A Llama config.json with `extra` merged in (null removes a field).
    fn llama(extra: Value) -> String {
        let mut json = serde_json::json!({
            "model_type": "llama",
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "max_position_embeddings": 128,
        });
        for (k, v) in extra.as_object().unwrap() {
            if v.is_null() {
                json.as_object_mut().unwrap().remove(k);
            } else {
                json[k] = v.clone();
            }
        }
        json.to_string()
    }

    fn error(text: &str) -> String {
        ModelConfig::from_hf_json(text).unwrap_err().to_string()
    }

    #[test]
    fn nested_and_top_level_rope_layouts_give_the_same_config() {
        let pairs = [
            (
                serde_json::json!({"rope_theta": 500000.0}),
                serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
            ),
            (
                serde_json::json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
                serde_json::json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
            ),
            (
                serde_json::json!({"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
                serde_json::json!({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
            ),
            (
                serde_json::json!({"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
                serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}}),
            ),
        ];
        for (top, nested) in pairs {
            let (a, b) = (
                ModelConfig::from_hf_json(&llama(top.clone())).unwrap(),
                ModelConfig::from_hf_json(&llama(nested)).unwrap(),
            );
            assert_eq!(a, b, "{top}");
            // And ARL's own config.json reads back the same.
            let saved = a.to_hf_json().to_string();
            assert_eq!(ModelConfig::from_hf_json(&saved).unwrap(), a, "{saved}");
        }
    }

    #[test]
    fn original_max_position_embeddings_falls_back_as_in_transformers() {
        let c = ModelConfig::from_hf_json(&llama(serde_json::json!({
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
        })))
        .unwrap();
        let Some(RopeScaling::Yarn(y)) = &c.rope_scaling else {
            panic!("{c:?}")
        };
        assert_eq!(y.original_max_position_embeddings, 128.0);
        let e = error(&llama(serde_json::json!({
            "max_position_embeddings": null,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
        })));
        assert!(e.contains("original_max_position_embeddings"), "{e}");
    }

    #[test]
    fn an_unknown_rope_type_is_refused_by_name_with_the_supported_ones() {
        let e = error(&llama(serde_json::json!({
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}
        })));
        assert!(
            e.contains("\"longrope\"") && e.contains("\"llama3\"") && e.contains("\"yarn\""),
            "{e}"
        );
        let e = error(&llama(serde_json::json!({
            "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}
        })));
        assert!(e.contains("dynamic") && e.contains("batch"), "{e}");
    }

    #[test]
    fn math_changing_fields_are_never_defaulted() {
        let e = error(&llama(serde_json::json!({})));
        assert!(e.contains("rope_theta") && e.contains("missing"), "{e}");
        let e = error(&llama(
            serde_json::json!({"rope_parameters": {"rope_type": "default"}}),
        ));
        assert!(e.contains("rope_theta"), "{e}");
        for field in ["rms_norm_eps", "hidden_act"] {
            let e = error(&llama(serde_json::json!({"rope_theta": 1e4, field: null})));
            assert!(e.contains(field) && e.contains("missing"), "{field}: {e}");
        }
        let e = error(&llama(serde_json::json!({
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "high_freq_factor": 4.0}
        })));
        assert!(e.contains("low_freq_factor"), "{e}");
        let qwen3 = llama(serde_json::json!({"model_type": "qwen3", "rope_theta": 1e4}));
        assert!(error(&qwen3).contains("head_dim"));
    }

    #[test]
    fn settings_arl_does_not_implement_are_refused() {
        for (extra, field) in [
            (serde_json::json!({"hidden_act": "gelu"}), "hidden_act"),
            (
                serde_json::json!({"attention_bias": true}),
                "attention_bias",
            ),
            (serde_json::json!({"mlp_bias": true}), "mlp_bias"),
            (
                serde_json::json!({"use_sliding_window": true}),
                "use_sliding_window",
            ),
            (
                serde_json::json!({"layer_types": ["full_attention", "sliding_attention"]}),
                "layer_types",
            ),
            (
                serde_json::json!({"partial_rotary_factor": 0.5}),
                "partial_rotary_factor",
            ),
            (serde_json::json!({"head_dim": 16}), "head_dim"),
        ] {
            let mut extra = extra;
            extra["rope_theta"] = 1e4.into();
            let e = error(&llama(extra));
            assert!(
                e.contains(field) && e.contains("not supported"),
                "{field}: {e}"
            );
        }
        // Settings that change nothing are read as transformers reads them.
        ModelConfig::from_hf_json(&llama(serde_json::json!({
            "rope_theta": 1e4, "attention_dropout": 0.1, "torch_dtype": "bfloat16",
            "head_dim": 8, "attention_bias": false, "use_sliding_window": false,
            "sliding_window": 4096, "layer_types": ["full_attention", "full_attention"]
        })))
        .unwrap();
    }

    #[test]
    fn yarn_attention_factor_follows_transformers() {
        let yarn = |extra: Value| {
            let mut rope = serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32});
            for (k, v) in extra.as_object().unwrap() {
                rope[k] = v.clone();
            }
            ModelConfig::from_hf_json(&llama(serde_json::json!({"rope_parameters": rope})))
                .unwrap()
                .rope_attention_factor()
        };
        assert!((yarn(serde_json::json!({})) - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(yarn(serde_json::json!({"attention_factor": 0.7})), 0.7);
        let (m, all) = (0.707, 0.707);
        let want = (0.1 * m * 4f64.ln() + 1.0) / (0.1 * all * 4f64.ln() + 1.0);
        assert!(
            (yarn(serde_json::json!({"mscale": m, "mscale_all_dim": all})) - want).abs() < 1e-12
        );
    }
}
