//! The transformer: token embedding, `num_hidden_layers` blocks of (RMSNorm → grouped-query
//! attention with RoPE → residual, RMSNorm → SwiGLU MLP → residual), final RMSNorm, head.
//! This file holds inference with a KV cache; `train.rs` the training forward/backward.

use crate::config::ModelConfig;
use crate::ops::{self, PackedMatrix};
use crate::weights::Weights;

#[derive(Clone, Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub(crate) weights: Weights,
    /// RoPE inverse frequencies: (hd/2)
    pub inv_freq: Vec<f32>,
    /// The GGUF's own block-format copies of the linear weights, for decode steps; dropped
    /// as soon as the weights can change.
    packed: Option<PackedWeights>,
}

/// Block-format copies of one model's linear weights (None where the format has no
/// packed kernel).
#[derive(Clone, Debug, Default)]
pub struct PackedWeights {
    pub layers: Vec<PackedLayer>,
    pub head: Option<PackedMatrix>,
}

#[derive(Clone, Debug, Default)]
pub struct PackedLayer {
    pub wq: Option<PackedMatrix>,
    pub wk: Option<PackedMatrix>,
    pub wv: Option<PackedMatrix>,
    pub wo: Option<PackedMatrix>,
    pub w_gate: Option<PackedMatrix>,
    pub w_up: Option<PackedMatrix>,
    pub w_down: Option<PackedMatrix>,
}

/// Up to this many tokens in a forward pass, linear layers read the packed weights.
const PACKED_MAX_TOKENS: usize = 16;

/// out (N, O) = x (N, I) · Wᵀ + b, from the packed copy when there is one and N is small.
#[allow(clippy::too_many_arguments)]
fn linear(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    packed: Option<&PackedMatrix>,
    bias: Option<&[f32]>,
    n: usize,
    i: usize,
    o: usize,
) {
    match packed {
        Some(p) if n <= PACKED_MAX_TOKENS => {
            p.matmul(out, x, n);
            if let Some(b) = bias {
                out[..n * o]
                    .chunks_mut(o)
                    .for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b));
            }
        }
        _ => ops::matmul_forward(out, x, w, bias, n, i, o),
    }
}

/// Keys and values of one sequence, per layer: (len, nkv, hd) each.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub len: usize,
}

impl KvCache {
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            k: vec![Vec::new(); config.num_hidden_layers],
            v: vec![Vec::new(); config.num_hidden_layers],
            len: 0,
        }
    }

    /// Forgets everything after the first `len` positions (for prefix reuse).
    pub fn truncate(&mut self, len: usize, kv_dim: usize) {
        self.len = self.len.min(len);
        for (k, v) in self.k.iter_mut().zip(&mut self.v) {
            k.truncate(self.len * kv_dim);
            v.truncate(self.len * kv_dim);
        }
    }
}

/// New tokens of one sequence for one forward pass.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

impl Model {
    pub fn new(config: ModelConfig, weights: Weights) -> Self {
        let inv_freq = config
            .rope_inv_freq()
            .into_iter()
            .map(|f| f as f32)
            .collect();
        Self {
            config,
            weights,
            inv_freq,
            packed: None,
        }
    }

    /// With block-format copies of the weights for fast decoding (from the same GGUF).
    pub fn with_packed(mut self, packed: PackedWeights) -> Self {
        self.packed = Some(packed);
        self
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Mutable weights (training, loading a new version). The packed copies no longer
    /// match, so they are dropped.
    pub fn weights_mut(&mut self) -> &mut Weights {
        self.packed = None;
        &mut self.weights
    }

    pub fn has_packed_weights(&self) -> bool {
        self.packed.is_some()
    }

    fn lm_head(&self) -> &[f32] {
        &self
            .weights
            .lm_head
            .as_ref()
            .unwrap_or(&self.weights.embed)
            .data
    }

    /// Runs the new tokens of every sequence through the model, extending their caches;
    /// returns the logits (V) after each sequence's last new token. Prefill (many tokens of
    /// one sequence) and batched decode (one token of many) are the same call.
    pub fn forward(&self, inputs: &mut [SeqInput<'_>]) -> Vec<Vec<f32>> {
        // A decode step makes hundreds of small parallel calls; issued from a pool thread
        // they are work-stolen, from outside each would be a cross-thread hand-off.
        if rayon::current_thread_index().is_none() {
            return rayon::join(|| self.forward_in_pool(inputs), || ()).0;
        }
        self.forward_in_pool(inputs)
    }

    fn forward_in_pool(&self, inputs: &mut [SeqInput<'_>]) -> Vec<Vec<f32>> {
        let cfg = &self.config;
        let (c, kv, hd, i_dim) = (
            cfg.hidden_size,
            cfg.kv_dim(),
            cfg.head_dim(),
            cfg.intermediate_size,
        );
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let n: usize = inputs.iter().map(|s| s.tokens.len()).sum();
        if n == 0 {
            return vec![Vec::new(); inputs.len()];
        }
        let positions: Vec<usize> = inputs
            .iter()
            .flat_map(|s| (0..s.tokens.len()).map(move |i| s.cache.len + i))
            .collect();

        let tokens: Vec<u32> = inputs
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut x = vec![0f32; n * c]; // (N, C)
        ops::embedding_forward(&mut x, &self.weights.embed.data, &tokens);
        let mut h = vec![0f32; n * c];
        let mut rstd = vec![0f32; n];
        let (mut q, mut k, mut v) = (vec![0f32; n * c], vec![0f32; n * kv], vec![0f32; n * kv]);
        let mut att_out = vec![0f32; n * c];
        let mut proj = vec![0f32; n * c];
        let (mut gate, mut up, mut act) = (
            vec![0f32; n * i_dim],
            vec![0f32; n * i_dim],
            vec![0f32; n * i_dim],
        );
        let eps = cfg.rms_norm_eps as f32;

        let no_packed = PackedLayer::default();
        for (l, w) in self.weights.layers.iter().enumerate() {
            let p = self
                .packed
                .as_ref()
                .and_then(|p| p.layers.get(l))
                .unwrap_or(&no_packed);
            ops::rmsnorm_forward(&mut h, &mut rstd, &x, &w.attn_norm.data, eps);
            let (bq, bk, bv) = (bias(&w.bq), bias(&w.bk), bias(&w.bv));
            linear(&mut q, &h, &w.wq.data, p.wq.as_ref(), bq, n, c, c);
            linear(&mut k, &h, &w.wk.data, p.wk.as_ref(), bk, n, c, kv);
            linear(&mut v, &h, &w.wv.data, p.wv.as_ref(), bv, n, c, kv);
            ops::rope_apply(&mut q, heads, &positions, &self.inv_freq, 1.0);
            ops::rope_apply(&mut k, kv_heads, &positions, &self.inv_freq, 1.0);

            // Append to each sequence's cache, then attend over it.
            let mut offset = 0;
            for seq in inputs.iter_mut() {
                let t = seq.tokens.len();
                seq.cache.k[l].extend_from_slice(&k[offset * kv..(offset + t) * kv]);
                seq.cache.v[l].extend_from_slice(&v[offset * kv..(offset + t) * kv]);
                offset += t;
            }
            let mut offset = 0;
            for seq in inputs.iter() {
                let t = seq.tokens.len();
                let start = seq.cache.len;
                ops::attention_cached(
                    &mut att_out[offset * c..(offset + t) * c],
                    &q[offset * c..(offset + t) * c],
                    &seq.cache.k[l],
                    &seq.cache.v[l],
                    start,
                    heads,
                    kv_heads,
                    hd,
                );
                offset += t;
            }
            linear(
                &mut proj,
                &att_out,
                &w.wo.data,
                p.wo.as_ref(),
                None,
                n,
                c,
                c,
            );
            x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);

            ops::rmsnorm_forward(&mut h, &mut rstd, &x, &w.ffn_norm.data, eps);
            linear(
                &mut gate,
                &h,
                &w.w_gate.data,
                p.w_gate.as_ref(),
                None,
                n,
                c,
                i_dim,
            );
            linear(
                &mut up,
                &h,
                &w.w_up.data,
                p.w_up.as_ref(),
                None,
                n,
                c,
                i_dim,
            );
            ops::swiglu_forward(&mut act, &gate, &up);
            linear(
                &mut proj,
                &act,
                &w.w_down.data,
                p.w_down.as_ref(),
                None,
                n,
                i_dim,
                c,
            );
            x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);
        }
        for seq in inputs.iter_mut() {
            seq.cache.len += seq.tokens.len();
        }

        // Logits only at each sequence's last token.
        let mut last_rows = Vec::with_capacity(inputs.len());
        let mut end = 0;
        for seq in inputs.iter() {
            end += seq.tokens.len();
            last_rows.push(end - 1);
        }
        let m = last_rows.len();
        let mut last = vec![0f32; m * c];
        for (dst, &row) in last.chunks_mut(c).zip(&last_rows) {
            dst.copy_from_slice(&x[row * c..][..c]);
        }
        let mut normed = vec![0f32; m * c];
        let mut r = vec![0f32; m];
        ops::rmsnorm_forward(
            &mut normed,
            &mut r,
            &last,
            &self.weights.final_norm.data,
            eps,
        );
        let vocab = cfg.vocab_size;
        let mut logits = vec![0f32; m * vocab];
        let packed_head = self.packed.as_ref().and_then(|p| p.head.as_ref());
        linear(
            &mut logits,
            &normed,
            self.lm_head(),
            packed_head,
            None,
            m,
            c,
            vocab,
        );
        logits.chunks(vocab).map(<[f32]>::to_vec).collect()
    }
}

fn bias(b: &Option<crate::tensor::Tensor>) -> Option<&[f32]> {
    b.as_ref().map(|b| &b.data[..])
}
