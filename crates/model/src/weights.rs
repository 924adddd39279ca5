//! Model parameters in Hugging Face layout (linear weights (out, in), row-major), loaded
//! from GGUF (dequantized to f32) or safetensors, saved as safetensors.

use std::collections::HashMap;
use std::path::Path;

use crate::config::{Architecture, ModelConfig};
use crate::gguf::{GgufError, GgufFile};
use crate::tensor::Tensor;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("safetensors {path}: {reason}")]
    Safetensors { path: String, reason: String },
    #[error("tensor {0} is missing")]
    Missing(String),
    #[error("tensor {name} has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("cannot write {path}: {reason}")]
    Write { path: String, reason: String },
}

/// One transformer block's parameters; `S` is the storage (host `Vec<f32>` by default,
/// or a backend's buffer).
#[derive(Clone, Debug)]
pub struct LayerWeights<S = Vec<f32>> {
    pub attn_norm: Tensor<S>,  // (C)
    pub wq: Tensor<S>,         // (Q, C), Q = nh·hd
    pub bq: Option<Tensor<S>>, // (Q)
    pub wk: Tensor<S>,         // (KV, C)
    pub bk: Option<Tensor<S>>, // (KV)
    pub wv: Tensor<S>,         // (KV, C)
    pub bv: Option<Tensor<S>>, // (KV)
    /// Qwen3's RMSNorm weights over each head's queries and keys, before RoPE.
    pub q_norm: Option<Tensor<S>>, // (hd)
    pub k_norm: Option<Tensor<S>>, // (hd)
    pub wo: Tensor<S>,         // (C, Q)
    pub ffn_norm: Tensor<S>,   // (C)
    pub w_gate: Tensor<S>,     // (I, C)
    pub w_up: Tensor<S>,       // (I, C)
    pub w_down: Tensor<S>,     // (C, I)
}

#[derive(Clone, Debug)]
pub struct Weights<S = Vec<f32>> {
    pub embed: Tensor<S>, // (V, C)
    pub layers: Vec<LayerWeights<S>>,
    pub final_norm: Tensor<S>, // (C)
    /// Absent when tied to `embed`.
    pub lm_head: Option<Tensor<S>>, // (V, C)
}

impl<S> LayerWeights<S> {
    /// (Hugging Face name suffix, tensor) of every parameter of the layer.
    pub fn named(&self) -> Vec<(&'static str, &Tensor<S>)> {
        let mut v = vec![
            ("input_layernorm.weight", &self.attn_norm),
            ("self_attn.q_proj.weight", &self.wq),
        ];
        v.extend(self.bq.as_ref().map(|t| ("self_attn.q_proj.bias", t)));
        v.push(("self_attn.k_proj.weight", &self.wk));
        v.extend(self.bk.as_ref().map(|t| ("self_attn.k_proj.bias", t)));
        v.push(("self_attn.v_proj.weight", &self.wv));
        v.extend(self.bv.as_ref().map(|t| ("self_attn.v_proj.bias", t)));
        v.extend(self.q_norm.as_ref().map(|t| ("self_attn.q_norm.weight", t)));
        v.extend(self.k_norm.as_ref().map(|t| ("self_attn.k_norm.weight", t)));
        v.extend([
            ("self_attn.o_proj.weight", &self.wo),
            ("post_attention_layernorm.weight", &self.ffn_norm),
            ("mlp.gate_proj.weight", &self.w_gate),
            ("mlp.up_proj.weight", &self.w_up),
            ("mlp.down_proj.weight", &self.w_down),
        ]);
        v
    }

    pub fn named_mut(&mut self) -> Vec<(&'static str, &mut Tensor<S>)> {
        let mut v: Vec<(&'static str, &mut Tensor<S>)> = vec![
            ("input_layernorm.weight", &mut self.attn_norm),
            ("self_attn.q_proj.weight", &mut self.wq),
        ];
        v.extend(self.bq.as_mut().map(|t| ("self_attn.q_proj.bias", t)));
        v.push(("self_attn.k_proj.weight", &mut self.wk));
        v.extend(self.bk.as_mut().map(|t| ("self_attn.k_proj.bias", t)));
        v.push(("self_attn.v_proj.weight", &mut self.wv));
        v.extend(self.bv.as_mut().map(|t| ("self_attn.v_proj.bias", t)));
        v.extend(self.q_norm.as_mut().map(|t| ("self_attn.q_norm.weight", t)));
        v.extend(self.k_norm.as_mut().map(|t| ("self_attn.k_norm.weight", t)));
        v.extend([
            ("self_attn.o_proj.weight", &mut self.wo),
            ("post_attention_layernorm.weight", &mut self.ffn_norm),
            ("mlp.gate_proj.weight", &mut self.w_gate),
            ("mlp.up_proj.weight", &mut self.w_up),
            ("mlp.down_proj.weight", &mut self.w_down),
        ]);
        v
    }
}

impl<S> Weights<S> {
    /// Every parameter with its Hugging Face name, in a fixed order.
    pub fn named(&self) -> Vec<(String, &Tensor<S>)> {
        let mut v = vec![("model.embed_tokens.weight".to_owned(), &self.embed)];
        for (i, layer) in self.layers.iter().enumerate() {
            v.extend(
                layer
                    .named()
                    .into_iter()
                    .map(|(n, t)| (format!("model.layers.{i}.{n}"), t)),
            );
        }
        v.push(("model.norm.weight".to_owned(), &self.final_norm));
        v.extend(
            self.lm_head
                .as_ref()
                .map(|t| ("lm_head.weight".to_owned(), t)),
        );
        v
    }

    pub fn named_mut(&mut self) -> Vec<(String, &mut Tensor<S>)> {
        let mut v = vec![("model.embed_tokens.weight".to_owned(), &mut self.embed)];
        for (i, layer) in self.layers.iter_mut().enumerate() {
            v.extend(
                layer
                    .named_mut()
                    .into_iter()
                    .map(|(n, t)| (format!("model.layers.{i}.{n}"), t)),
            );
        }
        v.push(("model.norm.weight".to_owned(), &mut self.final_norm));
        v.extend(
            self.lm_head
                .as_mut()
                .map(|t| ("lm_head.weight".to_owned(), t)),
        );
        v
    }

    pub fn parameter_count(&self) -> usize {
        self.named().iter().map(|(_, t)| t.numel()).sum()
    }

    /// The same parameters with every tensor's data converted by `f` (upload to a
    /// backend, download, zero-fill).
    pub fn map<T>(&self, mut f: impl FnMut(&Tensor<S>) -> T) -> Weights<T> {
        let mut t = |x: &Tensor<S>| x.map(&mut f);
        Weights {
            embed: t(&self.embed),
            layers: self
                .layers
                .iter()
                .map(|l| LayerWeights {
                    attn_norm: t(&l.attn_norm),
                    wq: t(&l.wq),
                    bq: l.bq.as_ref().map(&mut t),
                    wk: t(&l.wk),
                    bk: l.bk.as_ref().map(&mut t),
                    wv: t(&l.wv),
                    bv: l.bv.as_ref().map(&mut t),
                    q_norm: l.q_norm.as_ref().map(&mut t),
                    k_norm: l.k_norm.as_ref().map(&mut t),
                    wo: t(&l.wo),
                    ffn_norm: t(&l.ffn_norm),
                    w_gate: t(&l.w_gate),
                    w_up: t(&l.w_up),
                    w_down: t(&l.w_down),
                })
                .collect(),
            final_norm: t(&self.final_norm),
            lm_head: self.lm_head.as_ref().map(&mut t),
        }
    }

    /// The output projection: `lm_head`, or the embedding when they are tied.
    pub fn head(&self) -> &Tensor<S> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    pub fn head_mut(&mut self) -> &mut Tensor<S> {
        self.lm_head.as_mut().unwrap_or(&mut self.embed)
    }
}

impl Weights {
    /// Zero-filled weights of the same shapes (for gradients and optimizer moments).
    pub fn zeros_like(&self) -> Self {
        self.map(|t| vec![0.0; t.len()])
    }

    /// Random weights (norms at 1, the rest uniform in ±scale): tiny test models.
    pub fn random(config: &ModelConfig, seed: u64, scale: f32) -> Self {
        let mut rng = crate::generate::Rng::new(seed);
        Self::from_source(config, |name, shape| {
            let len = shape.iter().product();
            let data = if name.ends_with("layernorm.weight") || name.ends_with("norm.weight") {
                (0..len)
                    .map(|_| 1.0 + 0.1 * (rng.next_f32() - 0.5))
                    .collect()
            } else {
                (0..len)
                    .map(|_| scale * (2.0 * rng.next_f32() - 1.0))
                    .collect()
            };
            Ok(Some(Tensor::new(shape.to_vec(), data)))
        })
        .unwrap_or_else(|_| unreachable_weights())
    }

    fn from_source(
        config: &ModelConfig,
        mut get: impl FnMut(&str, &[usize]) -> Result<Option<Tensor>, WeightsError>,
    ) -> Result<Self, WeightsError> {
        let (c, q, kv, hd, i, v) = (
            config.hidden_size,
            config.q_dim(),
            config.kv_dim(),
            config.head_dim(),
            config.intermediate_size,
            config.vocab_size,
        );
        let mut need = |name: &str, shape: &[usize]| {
            get(name, shape)?.ok_or_else(|| WeightsError::Missing(name.to_owned()))
        };
        let embed = need("model.embed_tokens.weight", &[v, c])?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        let bias = config.architecture.qkv_bias();
        let qk_norm = config.architecture.qk_norm();
        for l in 0..config.num_hidden_layers {
            let p = |n: &str| format!("model.layers.{l}.{n}");
            layers.push(LayerWeights {
                attn_norm: need(&p("input_layernorm.weight"), &[c])?,
                wq: need(&p("self_attn.q_proj.weight"), &[q, c])?,
                bq: if bias {
                    Some(need(&p("self_attn.q_proj.bias"), &[q])?)
                } else {
                    None
                },
                wk: need(&p("self_attn.k_proj.weight"), &[kv, c])?,
                bk: if bias {
                    Some(need(&p("self_attn.k_proj.bias"), &[kv])?)
                } else {
                    None
                },
                wv: need(&p("self_attn.v_proj.weight"), &[kv, c])?,
                bv: if bias {
                    Some(need(&p("self_attn.v_proj.bias"), &[kv])?)
                } else {
                    None
                },
                q_norm: if qk_norm {
                    Some(need(&p("self_attn.q_norm.weight"), &[hd])?)
                } else {
                    None
                },
                k_norm: if qk_norm {
                    Some(need(&p("self_attn.k_norm.weight"), &[hd])?)
                } else {
                    None
                },
                wo: need(&p("self_attn.o_proj.weight"), &[c, q])?,
                ffn_norm: need(&p("post_attention_layernorm.weight"), &[c])?,
                w_gate: need(&p("mlp.gate_proj.weight"), &[i, c])?,
                w_up: need(&p("mlp.up_proj.weight"), &[i, c])?,
                w_down: need(&p("mlp.down_proj.weight"), &[c, i])?,
            });
        }
        let final_norm = need("model.norm.weight", &[c])?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(need("lm_head.weight", &[v, c])?)
        };
        Ok(Self {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Dequantizes a GGUF model into Hugging Face layout (undoing llama.cpp's q/k row
    /// permutation for `llama`, whose GGUF rope is interleaved).
    pub fn from_gguf(file: &GgufFile, config: &ModelConfig) -> Result<Self, WeightsError> {
        Self::from_source(config, |hf_name, shape| {
            let Some(gguf_name) = gguf_name(hf_name) else {
                return Ok(None);
            };
            let Some(info) = file.tensor(&gguf_name) else {
                return Ok(None);
            };
            let found: Vec<usize> = info.dims.iter().rev().map(|d| *d as usize).collect();
            if found != shape {
                return Err(WeightsError::Shape {
                    name: gguf_name,
                    found,
                    expected: shape.to_vec(),
                });
            }
            let mut data = file.tensor_f32(&gguf_name)?;
            if config.architecture == Architecture::Llama {
                if hf_name.ends_with("q_proj.weight") {
                    data = unpermute_rows(&data, config.num_attention_heads, shape[1]);
                } else if hf_name.ends_with("k_proj.weight") {
                    data = unpermute_rows(&data, config.num_key_value_heads, shape[1]);
                }
            }
            Ok(Some(Tensor::new(shape.to_vec(), data)))
        })
    }

    /// Loads `model.safetensors` or the shards named by `model.safetensors.index.json`.
    pub fn from_safetensors_dir(dir: &Path, config: &ModelConfig) -> Result<Self, WeightsError> {
        let files = safetensors_files(dir)?;
        let mut buffers = Vec::new();
        for file in &files {
            let bytes = std::fs::read(file).map_err(|e| st_error(file, e))?;
            buffers.push((file.clone(), bytes));
        }
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut parsed = Vec::new();
        for (n, (file, bytes)) in buffers.iter().enumerate() {
            let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| st_error(file, e))?;
            for name in st.names() {
                index.insert(name.to_owned(), n);
            }
            parsed.push(st);
        }
        Self::from_source(config, |name, shape| {
            let Some(&n) = index.get(name) else {
                return Ok(None);
            };
            let view = parsed[n]
                .tensor(name)
                .map_err(|e| st_error(&buffers[n].0, e))?;
            if view.shape() != shape {
                return Err(WeightsError::Shape {
                    name: name.to_owned(),
                    found: view.shape().to_vec(),
                    expected: shape.to_vec(),
                });
            }
            let data =
                to_f32(view.dtype(), view.data()).ok_or_else(|| WeightsError::Safetensors {
                    path: buffers[n].0.display().to_string(),
                    reason: format!(
                        "{name} has dtype {:?}; F32, F16 and BF16 are supported",
                        view.dtype()
                    ),
                })?;
            Ok(Some(Tensor::new(shape.to_vec(), data)))
        })
    }

    /// The values a file of these weights written as `dtype` holds (bf16: each rounded to
    /// nearest even), as loading it back gives them.
    pub fn as_stored(&self, dtype: StoredDtype) -> Weights {
        match dtype {
            StoredDtype::F32 => self.clone(),
            StoredDtype::Bf16 => self.map(|t| {
                t.data
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect()
            }),
        }
    }

    /// Writes `model.safetensors` (f32) in Hugging Face naming.
    pub fn save_safetensors(&self, path: &Path) -> Result<(), WeightsError> {
        self.save_safetensors_as(path, StoredDtype::F32)
    }

    /// Writes `model.safetensors` in Hugging Face naming, as `dtype`.
    pub fn save_safetensors_as(&self, path: &Path, dtype: StoredDtype) -> Result<(), WeightsError> {
        let named = self.named();
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = named
            .iter()
            .map(|(n, t)| {
                let data = match dtype {
                    StoredDtype::F32 => t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    StoredDtype::Bf16 => t
                        .data
                        .iter()
                        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                        .collect(),
                };
                (n.clone(), data, t.shape.clone())
            })
            .collect();
        let st_dtype = match dtype {
            StoredDtype::F32 => safetensors::Dtype::F32,
            StoredDtype::Bf16 => safetensors::Dtype::BF16,
        };
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, b, s)| {
                safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| WeightsError::Write {
                        path: path.display().to_string(),
                        reason: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        safetensors::serialize_to_file(views, None, path).map_err(|e| WeightsError::Write {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    }
}

/// How parameters are written to safetensors: f32 (training state, the CPU trainer's
/// versions) or bf16 (what a GPU trainer publishes: the precision its products use, half
/// the bytes to move to engines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    Bf16,
}

/// `from_source` with a source that always answers cannot fail.
fn unreachable_weights() -> Weights {
    Weights {
        embed: Tensor::zeros(&[0]),
        layers: Vec::new(),
        final_norm: Tensor::zeros(&[0]),
        lm_head: None,
    }
}

fn st_error(path: &Path, e: impl std::fmt::Display) -> WeightsError {
    WeightsError::Safetensors {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>, WeightsError> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index_path = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index_path).map_err(|e| st_error(&index_path, e))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| st_error(&index_path, e))?;
    let mut files: Vec<String> = index["weight_map"]
        .as_object()
        .map(|m| {
            m.values()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files.dedup();
    if files.is_empty() {
        return Err(st_error(&index_path, "weight_map is empty"));
    }
    // Shards are files of this folder: a name with a path in it could read anything
    // (`/dev/zero`, another model's files).
    if let Some(bad) = files.iter().find(|f| {
        f.contains('/') || f.contains('\\') || f.starts_with('.') || !f.ends_with(".safetensors")
    }) {
        return Err(st_error(
            &index_path,
            format!(
                "weight_map names {bad:?}: shards must be *.safetensors files beside the index"
            ),
        ));
    }
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

fn to_f32(dtype: safetensors::Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        safetensors::Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        safetensors::Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// GGUF tensor name of a Hugging Face parameter (llama.cpp's naming).
pub fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, name) = rest.split_once('.')?;
    let gguf = match name {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}"))
}

/// Block-format copies of a GGUF's linear weights, rows in Hugging Face order.
pub fn packed_from_gguf(file: &GgufFile, config: &ModelConfig) -> crate::model::PackedWeights {
    use crate::model::{PackedLayer, PackedWeights};
    use crate::ops::PackedMatrix;
    let pack = |name: &str, permute_heads: Option<usize>| -> Option<PackedMatrix> {
        let info = file.tensor(name)?;
        let (cols, rows) = (*info.dims.first()? as usize, *info.dims.get(1)? as usize);
        let order = permute_heads.map(|heads| gguf_row_order(rows, heads));
        PackedMatrix::from_gguf(
            info.kind,
            file.tensor_bytes(info).ok()?,
            rows,
            cols,
            order.as_deref(),
        )
    };
    let llama = config.architecture == Architecture::Llama;
    let layers = (0..config.num_hidden_layers)
        .map(|l| {
            let n = |s: &str| format!("blk.{l}.{s}");
            PackedLayer {
                wq: pack(
                    &n("attn_q.weight"),
                    llama.then_some(config.num_attention_heads),
                ),
                wk: pack(
                    &n("attn_k.weight"),
                    llama.then_some(config.num_key_value_heads),
                ),
                wv: pack(&n("attn_v.weight"), None),
                wo: pack(&n("attn_output.weight"), None),
                w_gate: pack(&n("ffn_gate.weight"), None),
                w_up: pack(&n("ffn_up.weight"), None),
                w_down: pack(&n("ffn_down.weight"), None),
                ..PackedLayer::default()
            }
        })
        .collect();
    let head = if config.tie_word_embeddings {
        pack("token_embd.weight", None)
    } else {
        pack("output.weight", None)
    };
    PackedWeights { layers, head }
}

/// For each Hugging Face row, the GGUF row holding it (see [`unpermute_rows`]).
fn gguf_row_order(rows: usize, heads: usize) -> Vec<usize> {
    let hd = rows / heads;
    let mut order = vec![0; rows];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                order[h * hd + j * (hd / 2) + i] = h * hd + 2 * i + j;
            }
        }
    }
    order
}

/// llama.cpp stores llama q/k rows as (head, hd/2, 2) — interleaved rope pairs; Hugging
/// Face as (head, 2, hd/2). Row `h*hd + 2i + j` of GGUF is row `h*hd + j*hd/2 + i` here.
fn unpermute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols;
    let hd = rows / heads;
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let from = h * hd + 2 * i + j;
                let to = h * hd + j * (hd / 2) + i;
                out[to * cols..][..cols].copy_from_slice(&data[from * cols..][..cols]);
            }
        }
    }
    out
}
