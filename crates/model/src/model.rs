//! The transformer: token embedding, `num_hidden_layers` blocks of (RMSNorm → grouped-query
//! attention with RoPE → residual, RMSNorm → SwiGLU MLP → residual), final RMSNorm, head.
//! This file holds inference with a KV cache; `train.rs` the training forward/backward.

use crate::backend::{Backend, CacheWrite, KvRows, PackedProduct};
use crate::config::ModelConfig;
use crate::ops::{Cpu, PackedMatrix};
use crate::tensor::Tensor;
use crate::weights::Weights;

/// A model on backend `B` (the CPU by default): its parameters live in `B`'s buffers.
#[derive(Clone, Debug)]
pub struct Model<B: Backend = Cpu> {
    pub config: ModelConfig,
    pub backend: B,
    pub(crate) weights: Weights<B::Buf>,
    /// RoPE inverse frequencies: (hd/2)
    pub inv_freq: Vec<f32>,
    /// The GGUF's own block-format copies of the linear weights, for decode steps; dropped
    /// as soon as the weights can change.
    packed: Option<PackedWeights<B::Packed>>,
}

/// Block-format copies of one model's linear weights (None where the format has no
/// packed kernel). `P` is the host [`PackedMatrix`] or a backend's form of it.
#[derive(Clone, Debug)]
pub struct PackedWeights<P = PackedMatrix> {
    pub layers: Vec<PackedLayer<P>>,
    pub head: Option<P>,
}

#[derive(Clone, Debug)]
pub struct PackedLayer<P = PackedMatrix> {
    pub wq: Option<P>,
    pub wk: Option<P>,
    pub wv: Option<P>,
    pub wo: Option<P>,
    pub w_gate: Option<P>,
    pub w_up: Option<P>,
    pub w_down: Option<P>,
    /// q, k and v stacked into one frozen matrix ([`Backend::freeze_stacked`]); when set,
    /// `wq`, `wk` and `wv` are not kept.
    pub wqkv: Option<P>,
    /// gate and up stacked likewise; when set, `w_gate` and `w_up` are not kept.
    pub w_gate_up: Option<P>,
}

impl<P> Default for PackedLayer<P> {
    fn default() -> Self {
        Self {
            wq: None,
            wk: None,
            wv: None,
            wo: None,
            w_gate: None,
            w_up: None,
            w_down: None,
            wqkv: None,
            w_gate_up: None,
        }
    }
}

impl<P> PackedLayer<P> {
    fn is_empty(&self) -> bool {
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
            &self.wqkv,
            &self.w_gate_up,
        ]
        .iter()
        .all(|m| m.is_none())
    }
}

impl PackedWeights {
    /// This backend's form of every block-format matrix it has a kernel for.
    fn to_backend<B: Backend>(&self, backend: &B) -> PackedWeights<B::Packed> {
        let p = |m: &Option<PackedMatrix>| m.as_ref().and_then(|m| backend.pack(m));
        PackedWeights {
            layers: self
                .layers
                .iter()
                .map(|l| PackedLayer {
                    wq: p(&l.wq),
                    wk: p(&l.wk),
                    wv: p(&l.wv),
                    wo: p(&l.wo),
                    w_gate: p(&l.w_gate),
                    w_up: p(&l.w_up),
                    w_down: p(&l.w_down),
                    wqkv: p(&l.wqkv),
                    w_gate_up: p(&l.w_gate_up),
                })
                .collect(),
            head: p(&self.head),
        }
    }
}

/// A linear layer to stack in `Model::freeze`: its packed copy (if it has one) and weights.
type StackedPart<'a, B> = (
    &'a Option<<B as Backend>::Packed>,
    &'a Tensor<<B as Backend>::Buf>,
);

/// Keys and values of one sequence, every layer, as its backend keeps them. A clone is a
/// fork (a GRPO group's choices from one prompt): on a GPU the two share the prompt's
/// blocks until one of them writes.
#[derive(Clone, Debug)]
pub struct KvCache<B: Backend = Cpu> {
    pub kv: B::Kv,
    pub len: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn new(model: &Model<B>) -> Self {
        let kv = model
            .backend
            .kv_new(model.config.num_hidden_layers, model.config.kv_dim());
        Self { kv, len: 0 }
    }

    /// Forgets everything after the first `len` positions (for prefix reuse).
    pub fn truncate(&mut self, model: &Model<B>, len: usize) {
        self.len = self.len.min(len);
        model.backend.kv_truncate(&mut self.kv, self.len);
    }
}

/// New tokens of one sequence for one forward pass.
pub struct SeqInput<'a, B: Backend = Cpu> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache<B>,
}

impl Model {
    /// A CPU model from host weights.
    pub fn new(config: ModelConfig, weights: Weights) -> Self {
        Self {
            inv_freq: inv_freq(&config),
            config,
            backend: Cpu,
            weights,
            packed: None,
        }
    }

    /// With block-format copies of the weights for fast decoding (from the same GGUF).
    pub fn with_packed(mut self, packed: PackedWeights) -> Self {
        self.packed = Some(packed);
        self
    }

    /// The same model on another backend: weights uploaded, block-format copies converted
    /// where the backend has kernels for them.
    pub fn to_backend<B: Backend>(&self, backend: B) -> Model<B> {
        Model {
            config: self.config.clone(),
            weights: self.weights.map(|t| backend.upload(&t.data)),
            inv_freq: self.inv_freq.clone(),
            packed: self.packed.as_ref().map(|p| p.to_backend(&backend)),
            backend,
        }
    }
}

fn inv_freq(config: &ModelConfig) -> Vec<f32> {
    config
        .rope_inv_freq()
        .into_iter()
        .map(|f| f as f32)
        .collect()
}

impl<B: Backend> Model<B> {
    /// A model from weights already on `backend` (a version handed over in device memory:
    /// [`crate::handoff`]).
    pub fn on_backend(config: ModelConfig, weights: Weights<B::Buf>, backend: B) -> Self {
        Self {
            inv_freq: inv_freq(&config),
            config,
            backend,
            weights,
            packed: None,
        }
    }

    pub fn weights(&self) -> &Weights<B::Buf> {
        &self.weights
    }

    /// Mutable weights (training, loading a new version). The packed copies no longer
    /// match, so they are dropped.
    pub fn weights_mut(&mut self) -> &mut Weights<B::Buf> {
        self.packed = None;
        &mut self.weights
    }

    /// The weights in host memory (checkpoints).
    pub fn host_weights(&self) -> Weights {
        self.weights.map(|t| self.backend.download(&t.data))
    }

    /// Zero-filled buffers shaped like the weights (gradients, optimizer moments).
    pub fn zeros_like_weights(&self) -> Weights<B::Buf> {
        self.weights.map(|t| self.backend.zeros(t.numel()))
    }

    pub fn has_packed_weights(&self) -> bool {
        self.packed.is_some()
    }

    /// Readies weights that will not change (a version being served) for fast products:
    /// every linear layer and the head without a packed copy gets the backend's frozen
    /// form where it has one (the CUDA backend's bf16 copies, which its products would
    /// otherwise convert from f32 at every call); q, k and v — and gate and up — are
    /// stacked into one matrix each where the backend can (one product instead of three,
    /// or two). Numbers do not change. Changing the weights afterwards drops these copies,
    /// as it drops the GGUF's.
    pub fn freeze(&mut self) {
        let be = &self.backend;
        let freeze = |slot: &mut Option<B::Packed>, t: &Tensor<B::Buf>| {
            if slot.is_none() {
                *slot = be.freeze(&t.data, t.shape[0], t.shape[1]);
            }
        };
        // Stacked only where none of the parts has a block-format copy of its own (those
        // read fewer bytes) and, for q and k, where nothing comes between the product and
        // RoPE (Qwen3's per-head norms).
        let stack = |parts: &[StackedPart<'_, B>]| {
            if parts.iter().any(|(p, _)| p.is_some()) {
                return None;
            }
            let pieces: Vec<(&B::Buf, usize)> =
                parts.iter().map(|(_, t)| (&t.data, t.shape[0])).collect();
            be.freeze_stacked(&pieces, parts.first()?.1.shape[1])
        };
        let packed = self.packed.get_or_insert_with(|| PackedWeights {
            layers: Vec::new(),
            head: None,
        });
        packed
            .layers
            .resize_with(self.weights.layers.len(), PackedLayer::default);
        for (p, w) in packed.layers.iter_mut().zip(&self.weights.layers) {
            if p.wqkv.is_none() && w.q_norm.is_none() && w.k_norm.is_none() {
                p.wqkv = stack(&[(&p.wq, &w.wq), (&p.wk, &w.wk), (&p.wv, &w.wv)]);
            }
            if p.wqkv.is_none() {
                freeze(&mut p.wq, &w.wq);
                freeze(&mut p.wk, &w.wk);
                freeze(&mut p.wv, &w.wv);
            }
            if p.w_gate_up.is_none() {
                p.w_gate_up = stack(&[(&p.w_gate, &w.w_gate), (&p.w_up, &w.w_up)]);
            }
            if p.w_gate_up.is_none() {
                freeze(&mut p.w_gate, &w.w_gate);
                freeze(&mut p.w_up, &w.w_up);
            }
            freeze(&mut p.wo, &w.wo);
            freeze(&mut p.w_down, &w.w_down);
        }
        freeze(&mut packed.head, self.weights.head());
        if packed.head.is_none() && packed.layers.iter().all(PackedLayer::is_empty) {
            // A backend with no frozen form (the CPU): nothing packed, as before.
            self.packed = None;
        }
    }

    /// out (N, O) = x (N, I) · Wᵀ + b, from the packed copy when there is one, with each
    /// token's row computed the same way whatever N is: a sequence's logits do not depend on
    /// what else shares its step (decodes, another prompt's chunk).
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        out: &mut B::Buf,
        x: &B::Buf,
        w: &Tensor<B::Buf>,
        packed: Option<&B::Packed>,
        bias: Option<&Tensor<B::Buf>>,
        n: usize,
    ) {
        let (o, i) = (w.shape[0], w.shape[1]);
        let bias = bias.map(|b| &b.data);
        match packed {
            Some(p) => self.backend.matmul_packed(out, x, p, bias, n),
            None => self.backend.matmul_rows(out, x, &w.data, bias, n, i, o),
        }
    }

    /// Several products of one input x (N, I): from packed copies together when every one
    /// has one (a backend may then convert x once), else one `linear` each.
    #[allow(clippy::type_complexity)]
    fn linears(
        &self,
        x: &B::Buf,
        n: usize,
        products: &mut [(
            &mut B::Buf,
            &Tensor<B::Buf>,
            Option<&B::Packed>,
            Option<&Tensor<B::Buf>>,
        )],
    ) {
        if products.iter().all(|(_, _, packed, _)| packed.is_some()) {
            let mut packed: Vec<PackedProduct<'_, B::Buf, B::Packed>> = products
                .iter_mut()
                .filter_map(|(out, _, p, bias)| {
                    Some(PackedProduct {
                        out: &mut **out,
                        w: (*p)?,
                        bias: bias.map(|b| &b.data),
                    })
                })
                .collect();
            self.backend.matmul_packed_shared(x, n, &mut packed);
        } else {
            for (out, w, p, bias) in products.iter_mut() {
                self.linear(out, x, w, *p, *bias, n);
            }
        }
    }

    /// Runs the new tokens of every sequence through the model, extending their caches;
    /// returns the logits (V) after each sequence's last new token. Prefill (many tokens of
    /// one sequence) and batched decode (one token of many) are the same call.
    pub fn forward(&self, inputs: &mut [SeqInput<'_, B>]) -> Vec<Vec<f32>> {
        let logits = self.backend.download(&self.forward_logits(inputs));
        if logits.is_empty() {
            return vec![Vec::new(); inputs.len()];
        }
        logits
            .chunks(self.config.vocab_size)
            .map(<[f32]>::to_vec)
            .collect()
    }

    /// [`Model::forward`] with the logits left where the backend computed them: (M, V), a
    /// row per sequence (on a GPU, for sampling there; nothing when no token is fed).
    pub fn forward_logits(&self, inputs: &mut [SeqInput<'_, B>]) -> B::Buf {
        let decoding = !inputs.is_empty() && inputs.iter().all(|s| s.tokens.len() == 1);
        if !decoding {
            return self.backend.scope(|| self.forward_in_scope(inputs));
        }
        // A decode step repeats: the backend may replay it (a CUDA graph per model and
        // batch size). Each run starts from the caches' lengths before the step.
        let starts: Vec<usize> = inputs.iter().map(|s| s.cache.len).collect();
        let key = (std::ptr::from_ref(self) as u64).rotate_left(16) ^ inputs.len() as u64;
        self.backend.graphed(key, &mut || {
            for (seq, &start) in inputs.iter_mut().zip(&starts) {
                seq.cache.len = start;
            }
            self.backend.scope(|| self.forward_in_scope(inputs))
        })
    }

    fn forward_in_scope(&self, inputs: &mut [SeqInput<'_, B>]) -> B::Buf {
        let (cfg, be) = (&self.config, &self.backend);
        let (c, qd, kv, hd, i_dim) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.head_dim(),
            cfg.intermediate_size,
        );
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let rope_factor = cfg.rope_attention_factor() as f32;
        let n: usize = inputs.iter().map(|s| s.tokens.len()).sum();
        if n == 0 {
            return be.zeros(0);
        }
        let positions: Vec<usize> = inputs
            .iter()
            .flat_map(|s| (0..s.tokens.len()).map(move |i| s.cache.len + i))
            .collect();
        let tokens: Vec<u32> = inputs
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();

        let mut x = be.zeros(n * c); // (N, C)
        be.embedding_forward(&mut x, &self.weights.embed.data, &tokens);
        let (mut h, mut rstd) = (be.zeros(n * c), be.zeros(n));
        let (mut q, mut k, mut v) = (be.zeros(n * qd), be.zeros(n * kv), be.zeros(n * kv));
        let (mut att_out, mut proj) = (be.zeros(n * qd), be.zeros(n * c));
        // Qwen3: q and k before their per-head norm, and the norms' 1/rms (unused here).
        let qk_norm = cfg.architecture.qk_norm();
        let (mut q_pre, mut k_pre) = if qk_norm {
            (be.zeros(n * qd), be.zeros(n * kv))
        } else {
            (be.zeros(0), be.zeros(0))
        };
        let (mut rstd_q, mut rstd_k) = if qk_norm {
            (be.zeros(n * heads), be.zeros(n * kv_heads))
        } else {
            (be.zeros(0), be.zeros(0))
        };
        // Stacked products (`freeze`) write q, k and v — and gate and up — side by side; a
        // layer without its stacked form uses the separate buffers.
        let packed_layers = self.packed.as_ref().map_or(&[][..], |p| &p.layers[..]);
        let any = |stacked: fn(&PackedLayer<B::Packed>) -> bool| packed_layers.iter().any(stacked);
        let every_gate_up = packed_layers.len() == self.weights.layers.len()
            && packed_layers.iter().all(|l| l.w_gate_up.is_some());
        let mut qkv = be.zeros(if any(|l| l.wqkv.is_some()) {
            n * (qd + 2 * kv)
        } else {
            0
        });
        let gate_up_width = if any(|l| l.w_gate_up.is_some()) {
            n * 2 * i_dim
        } else {
            0
        };
        let split_width = if every_gate_up { 0 } else { n * i_dim };
        let mut gate_up = be.zeros(gate_up_width);
        let (mut gate, mut up, mut act) = (
            be.zeros(split_width),
            be.zeros(split_width),
            be.zeros(n * i_dim),
        );
        let eps = cfg.rms_norm_eps as f32;
        // Each sequence's new rows of the step and the positions they take in its cache.
        let mut offset = 0;
        let mut kv_rows: Vec<KvRows<'_, B::Kv>> = inputs
            .iter_mut()
            .map(|seq| {
                let t = seq.tokens.len();
                offset += t;
                KvRows {
                    kv: &mut seq.cache.kv,
                    rows: offset - t..offset,
                    start: seq.cache.len,
                }
            })
            .collect();
        let kv_step = be.kv_prepare(&mut kv_rows);

        let no_packed = PackedLayer::default();
        for (l, w) in self.weights.layers.iter().enumerate() {
            let p = self
                .packed
                .as_ref()
                .and_then(|p| p.layers.get(l))
                .unwrap_or(&no_packed);
            if l == 0 {
                be.rmsnorm_forward(&mut h, &mut rstd, &x, &w.attn_norm.data, eps);
            } else {
                // The last layer's MLP residual, fused with this layer's first norm.
                be.add_rmsnorm_forward(&mut x, &proj, &mut h, &mut rstd, &w.attn_norm.data, eps);
            }
            if let Some(wqkv) = &p.wqkv {
                self.backend.matmul_packed(&mut qkv, &h, wqkv, None, n);
                be.qkv_split_rope(
                    (&mut q, &mut k, &mut v),
                    &qkv,
                    [&w.bq, &w.bk, &w.bv].map(|b| b.as_ref().map(|b| &b.data)),
                    (heads, kv_heads, hd),
                    &positions,
                    &self.inv_freq,
                    rope_factor,
                    Some(CacheWrite {
                        layer: l,
                        step: &kv_step,
                        seqs: &mut kv_rows,
                    }),
                );
            } else {
                let qk_pre = w.q_norm.is_some() && w.k_norm.is_some();
                {
                    // Qwen3 norms q and k per head afterwards: its products go to q_pre, k_pre.
                    let (q_out, k_out) = if qk_pre {
                        (&mut q_pre, &mut k_pre)
                    } else {
                        (&mut q, &mut k)
                    };
                    self.linears(
                        &h,
                        n,
                        &mut [
                            (q_out, &w.wq, p.wq.as_ref(), w.bq.as_ref()),
                            (k_out, &w.wk, p.wk.as_ref(), w.bk.as_ref()),
                            (&mut v, &w.wv, p.wv.as_ref(), w.bv.as_ref()),
                        ],
                    );
                }
                if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                    // Per-head RMSNorm: rows of hd, (N·nh, hd) and (N·nkv, hd).
                    be.rmsnorm_forward(&mut q, &mut rstd_q, &q_pre, &qn.data, eps);
                    be.rmsnorm_forward(&mut k, &mut rstd_k, &k_pre, &kn.data, eps);
                }
                be.rope_apply(&mut q, heads, &positions, &self.inv_freq, 1.0);
                be.rope_apply(&mut k, kv_heads, &positions, &self.inv_freq, 1.0);
                if rope_factor != 1.0 {
                    // transformers scales cos and sin (YaRN's mscale): the rotated q and k.
                    be.scale(&mut q, rope_factor);
                    be.scale(&mut k, rope_factor);
                }
                // Into each sequence's cache (the stacked path's split does it itself).
                be.kv_write(l, &kv_step, &mut kv_rows, &k, &v);
            }
            // Then attend over it.
            be.kv_attention(
                l,
                &kv_step,
                &mut att_out,
                &q,
                &k,
                &v,
                &kv_rows,
                heads,
                kv_heads,
                hd,
            );
            self.linear(&mut proj, &att_out, &w.wo, p.wo.as_ref(), None, n);
            be.add_rmsnorm_forward(&mut x, &proj, &mut h, &mut rstd, &w.ffn_norm.data, eps);
            if let Some(w_gate_up) = &p.w_gate_up {
                be.matmul_packed_swiglu(&mut act, &mut gate_up, &h, w_gate_up, n, i_dim);
            } else {
                self.linears(
                    &h,
                    n,
                    &mut [
                        (&mut gate, &w.w_gate, p.w_gate.as_ref(), None),
                        (&mut up, &w.w_up, p.w_up.as_ref(), None),
                    ],
                );
                be.swiglu_forward(&mut act, &gate, &up);
            }
            self.linear(&mut proj, &act, &w.w_down, p.w_down.as_ref(), None, n);
        }
        if !self.weights.layers.is_empty() {
            be.add_assign(&mut x, &proj);
        }
        drop(kv_rows);
        for seq in inputs.iter_mut() {
            seq.cache.len += seq.tokens.len();
        }

        // Logits only at each sequence's last token.
        let last_rows: Vec<usize> = inputs
            .iter()
            .scan(0, |end, seq| {
                *end += seq.tokens.len();
                Some(*end - 1)
            })
            .collect();
        let m = last_rows.len();
        let mut last = be.zeros(m * c);
        be.gather_rows(&mut last, &x, &last_rows, c);
        let (mut normed, mut r) = (be.zeros(m * c), be.zeros(m));
        be.rmsnorm_forward(
            &mut normed,
            &mut r,
            &last,
            &self.weights.final_norm.data,
            eps,
        );
        let vocab = cfg.vocab_size;
        let mut logits = be.zeros(m * vocab);
        let packed_head = self.packed.as_ref().and_then(|p| p.head.as_ref());
        self.linear(
            &mut logits,
            &normed,
            self.weights.head(),
            packed_head,
            None,
            m,
        );
        logits
    }
}
