//! Training: a forward pass over whole sequences that keeps every activation, the
//! per-token log-probability (and entropy) of each next token, and the explicit backward
//! pass that turns their gradients into parameter gradients.
//!
//! Sequence `s` of length T yields T-1 predictions: `logprobs[s][t] = log p(tokens[t+1] |
//! tokens[..=t])`. The vocabulary projection is the backend's fused head
//! ([`Backend::head_forward`]), so all (N, V) logits never exist at once.

use crate::backend::{AdamStep, Backend, Product, ProductGrad, Span};
use crate::model::Model;
use crate::ops::Cpu;
use crate::tensor::Tensor;
use crate::weights::Weights;

struct LayerActs<B: Backend> {
    x_in: B::Buf,  // (N, C) residual stream entering the layer
    rstd1: B::Buf, // (N)
    h1: B::Buf,    // (N, C)
    /// Qwen3: q and k before their per-head norm, and the norms' 1/rms.
    qk_norm: Option<QkNormActs<B>>,
    q: B::Buf,       // (N, Q) after RoPE (and its attention factor)
    k: B::Buf,       // (N, KV) after RoPE
    v: B::Buf,       // (N, KV)
    att_lse: B::Buf, // (N, nh) attention's row log-sum-exp
    att_out: B::Buf, // (N, Q)
    x_mid: B::Buf,   // (N, C)
    rstd2: B::Buf,   // (N)
    h2: B::Buf,      // (N, C)
    gate: B::Buf,    // (N, I)
    up: B::Buf,      // (N, I)
    act: B::Buf,     // (N, I)
}

struct QkNormActs<B: Backend> {
    q_pre: B::Buf,  // (N, Q) = (N·nh, hd)
    rstd_q: B::Buf, // (N·nh)
    k_pre: B::Buf,  // (N, KV) = (N·nkv, hd)
    rstd_k: B::Buf, // (N·nkv)
}

/// What a pass keeps of one layer for the backward.
enum LayerMemory<B: Backend> {
    /// Every activation.
    Kept(LayerActs<B>),
    /// Only the layer's input: the backward runs the layer's forward again (activation
    /// checkpointing — less memory for one more forward of each layer).
    Checkpoint(B::Buf),
}

/// How much of the forward a training pass keeps for the backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// Every activation of every layer.
    #[default]
    Keep,
    /// Each layer's input only; the backward recomputes the rest, one layer at a time.
    /// Gradients are the same; peak memory falls to about one layer's activations.
    Recompute,
}

/// Everything the backward pass needs from a forward pass.
pub struct TrainPass<B: Backend = Cpu> {
    tokens: Vec<u32>,
    /// Start of each sequence in the concatenated token rows, and its length.
    spans: Vec<Span>,
    positions: Vec<usize>,
    /// The token each row predicts (None on a sequence's last row).
    targets: Vec<Option<u32>>,
    layers: Vec<LayerMemory<B>>,
    x_final: B::Buf, // (N, C)
    rstd_final: B::Buf,
    h_final: B::Buf, // (N, C)
    /// The rows the head scores (all rows, or those a mask asks for): (M).
    scored: Scored,
    /// h_final at the scored rows: (M, C) (h_final itself when every row is scored).
    h_scored: Option<B::Buf>,
    /// Per scored row: log Σ exp(logits), to rebuild probabilities in the backward pass.
    lse: B::Buf,
    entropy: B::Buf,
    /// The entropy of every row in host memory (0 on rows not scored).
    entropy_rows: Vec<f32>,
}

/// Which rows of a pass go through the vocabulary head.
enum Scored {
    All,
    /// Ascending row indices.
    Rows(Vec<usize>),
}

impl<B: Backend> TrainPass<B> {
    /// Per sequence, the rows that predict a next token.
    fn per_sequence(&self, rows: &[f32]) -> Vec<Vec<f32>> {
        self.spans
            .iter()
            .map(|&(start, len)| rows[start..start + len - 1].to_vec())
            .collect()
    }

    pub fn entropies(&self) -> Vec<Vec<f32>> {
        self.per_sequence(&self.entropy_rows)
    }

    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }
}

impl<B: Backend> Model<B> {
    /// Forward over whole sequences (each at least 2 tokens), keeping activations.
    /// Returns the pass and, per sequence, the log-probabilities of its next tokens.
    pub fn forward_train(&self, sequences: &[&[u32]]) -> (TrainPass<B>, Vec<Vec<f32>>) {
        self.forward_train_with(sequences, None, Activations::Keep)
    }

    /// [`Self::forward_train`], scoring only the tokens a mask marks: `masks[s][t] == 1`
    /// asks for the log-probability of token t of sequence s (masks align with the
    /// tokens, as a trajectory's loss mask does). Other predictions are 0, skip the
    /// vocabulary head (a fifth of SmolLM2's compute per row) and carry no gradient.
    pub fn forward_train_masked(
        &self,
        sequences: &[&[u32]],
        masks: &[&[u8]],
    ) -> (TrainPass<B>, Vec<Vec<f32>>) {
        self.forward_train_with(sequences, Some(masks), Activations::Keep)
    }

    /// The training forward with a choice of what it keeps for the backward.
    pub fn forward_train_with(
        &self,
        sequences: &[&[u32]],
        masks: Option<&[&[u8]]>,
        activations: Activations,
    ) -> (TrainPass<B>, Vec<Vec<f32>>) {
        self.backend
            .scope(|| self.forward_train_in_scope(sequences, masks, activations))
    }

    fn forward_train_in_scope(
        &self,
        sequences: &[&[u32]],
        masks: Option<&[&[u8]]>,
        activations: Activations,
    ) -> (TrainPass<B>, Vec<Vec<f32>>) {
        let (cfg, be) = (&self.config, &self.backend);
        let c = cfg.hidden_size;
        let eps = cfg.rms_norm_eps as f32;
        let mut spans = Vec::with_capacity(sequences.len());
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        for seq in sequences {
            spans.push((tokens.len(), seq.len()));
            tokens.extend_from_slice(seq);
            positions.extend(0..seq.len());
        }
        let n = tokens.len();
        let mut x = be.zeros(n * c);
        be.embedding_forward(&mut x, &self.weights.embed.data, &tokens);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let (acts, x_out) = self.layer_forward(l, x, &spans, &positions);
            layers.push(match activations {
                Activations::Keep => LayerMemory::Kept(acts),
                Activations::Recompute => LayerMemory::Checkpoint(acts.x_in),
            });
            x = x_out;
        }
        let (mut h_final, mut rstd_final) = (be.zeros(n * c), be.zeros(n));
        be.rmsnorm_forward(
            &mut h_final,
            &mut rstd_final,
            &x,
            &self.weights.final_norm.data,
            eps,
        );

        let targets = next_tokens(&tokens, &spans);
        let scored = match masks {
            None => Scored::All,
            Some(masks) => Scored::Rows(scored_rows(masks, &spans)),
        };
        let h_scored = match &scored {
            Scored::All => None,
            Scored::Rows(rows) => {
                let mut h = be.zeros(rows.len() * c);
                be.gather_rows(&mut h, &h_final, rows, c);
                Some(h)
            }
        };
        let m = scored.count(n);
        let scored_targets = scored.pick(&targets);
        let (mut lse, mut entropy, mut logprob) = (be.zeros(m), be.zeros(m), be.zeros(m));
        if m > 0 {
            be.head_forward(
                &mut lse,
                &mut entropy,
                &mut logprob,
                h_scored.as_ref().unwrap_or(&h_final),
                &self.weights.head().data,
                &scored_targets,
                c,
                cfg.vocab_size,
            );
        }
        let entropy_rows = scored.spread(&be.download(&entropy), n);
        let logprob_rows = scored.spread(&be.download(&logprob), n);
        let pass = TrainPass {
            tokens,
            spans,
            positions,
            targets,
            layers,
            x_final: x,
            rstd_final,
            h_final,
            scored,
            h_scored,
            lse,
            entropy,
            entropy_rows,
        };
        let logprobs = pass.per_sequence(&logprob_rows);
        (pass, logprobs)
    }

    /// Layer `l`'s forward from its input x_in (N, C): its activations and its output.
    fn layer_forward(
        &self,
        l: usize,
        x_in: B::Buf,
        spans: &[Span],
        positions: &[usize],
    ) -> (LayerActs<B>, B::Buf) {
        let (cfg, be) = (&self.config, &self.backend);
        let w = &self.weights.layers[l];
        let (c, qd, kv, hd, i_dim) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.head_dim(),
            cfg.intermediate_size,
        );
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let rope_factor = cfg.rope_attention_factor() as f32;
        let eps = cfg.rms_norm_eps as f32;
        let n = positions.len();
        let (mut h1, mut rstd1) = (be.zeros(n * c), be.zeros(n));
        be.rmsnorm_forward(&mut h1, &mut rstd1, &x_in, &w.attn_norm.data, eps);
        let (mut q, mut k, mut v) = (be.zeros(n * qd), be.zeros(n * kv), be.zeros(n * kv));
        be.matmul_forward_shared(
            &h1,
            n,
            c,
            &mut [
                Product {
                    out: &mut q,
                    w: &w.wq.data,
                    bias: bias(&w.bq),
                    o: qd,
                },
                Product {
                    out: &mut k,
                    w: &w.wk.data,
                    bias: bias(&w.bk),
                    o: kv,
                },
                Product {
                    out: &mut v,
                    w: &w.wv.data,
                    bias: bias(&w.bv),
                    o: kv,
                },
            ],
        );
        let qk_norm = match (&w.q_norm, &w.k_norm) {
            (Some(qn), Some(kn)) => {
                // Per-head RMSNorm: rows of hd.
                let (q_pre, k_pre) = (q, k);
                let (mut rstd_q, mut rstd_k) = (be.zeros(n * heads), be.zeros(n * kv_heads));
                (q, k) = (be.zeros(n * qd), be.zeros(n * kv));
                be.rmsnorm_forward(&mut q, &mut rstd_q, &q_pre, &qn.data, eps);
                be.rmsnorm_forward(&mut k, &mut rstd_k, &k_pre, &kn.data, eps);
                Some(QkNormActs {
                    q_pre,
                    rstd_q,
                    k_pre,
                    rstd_k,
                })
            }
            _ => None,
        };
        be.rope_apply(&mut q, heads, positions, &self.inv_freq, 1.0);
        be.rope_apply(&mut k, kv_heads, positions, &self.inv_freq, 1.0);
        if rope_factor != 1.0 {
            // transformers scales cos and sin (YaRN's mscale): the rotated q and k.
            be.scale(&mut q, rope_factor);
            be.scale(&mut k, rope_factor);
        }
        let (mut att_out, mut att_lse) = (be.zeros(n * qd), be.zeros(n * heads));
        be.attention_forward(
            &mut att_out,
            &mut att_lse,
            &q,
            &k,
            &v,
            spans,
            heads,
            kv_heads,
            hd,
        );
        let mut x_mid = be.zeros(n * c);
        be.matmul_forward(&mut x_mid, &att_out, &w.wo.data, None, n, qd, c);
        be.add_assign(&mut x_mid, &x_in);
        let (mut h2, mut rstd2) = (be.zeros(n * c), be.zeros(n));
        be.rmsnorm_forward(&mut h2, &mut rstd2, &x_mid, &w.ffn_norm.data, eps);
        let (mut gate, mut up, mut act) = (
            be.zeros(n * i_dim),
            be.zeros(n * i_dim),
            be.zeros(n * i_dim),
        );
        be.matmul_forward_shared(
            &h2,
            n,
            c,
            &mut [
                Product {
                    out: &mut gate,
                    w: &w.w_gate.data,
                    bias: None,
                    o: i_dim,
                },
                Product {
                    out: &mut up,
                    w: &w.w_up.data,
                    bias: None,
                    o: i_dim,
                },
            ],
        );
        be.swiglu_forward(&mut act, &gate, &up);
        let mut x = be.zeros(n * c);
        be.matmul_forward(&mut x, &act, &w.w_down.data, None, n, i_dim, c);
        be.add_assign(&mut x, &x_mid);
        let acts = LayerActs {
            x_in,
            rstd1,
            h1,
            qk_norm,
            q,
            k,
            v,
            att_lse,
            att_out,
            x_mid,
            rstd2,
            h2,
            gate,
            up,
            act,
        };
        (acts, x)
    }

    /// Adds to `grads` the gradient of L, given ∂L/∂logprob and ∂L/∂entropy for every
    /// prediction (same shapes as `forward_train`'s output; entropy may be empty).
    pub fn backward(
        &self,
        pass: &TrainPass<B>,
        d_logprob: &[Vec<f32>],
        d_entropy: &[Vec<f32>],
        grads: &mut Weights<B::Buf>,
    ) {
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
        let n = pass.tokens.len();

        // Per-row upstream gradients (0 on each sequence's last row: it predicts nothing,
        // and on rows the pass did not score).
        let (d_lp, d_h) = (
            pass.scored.pick(&rows_from(d_logprob, &pass.spans, n)),
            pass.scored.pick(&rows_from(d_entropy, &pass.spans, n)),
        );
        let dh_final = match &pass.scored {
            Scored::All => {
                let mut dh = be.zeros(n * c);
                self.head_backward(&mut dh, grads, &pass.h_final, pass, &d_lp, &d_h);
                dh
            }
            Scored::Rows(rows) => {
                // (M + 1, C): the scored rows' gradient and a zero row, spread back to (N, C)
                // by a gather in which every unscored row reads the zero row.
                let m = rows.len();
                let mut dh_scored = be.zeros((m + 1) * c);
                let h = pass.h_scored.as_ref().unwrap_or(&pass.h_final);
                self.head_backward(&mut dh_scored, grads, h, pass, &d_lp, &d_h);
                let mut from = vec![m; n];
                for (j, &r) in rows.iter().enumerate() {
                    from[r] = j;
                }
                let mut dh = be.zeros(n * c);
                be.gather_rows(&mut dh, &dh_scored, &from, c);
                dh
            }
        };

        let mut dx = be.zeros(n * c);
        be.rmsnorm_backward(
            &mut dx,
            &mut grads.final_norm.data,
            &dh_final,
            &pass.x_final,
            &self.weights.final_norm.data,
            &pass.rstd_final,
        );

        for (l, memory) in pass.layers.iter().enumerate().rev() {
            let rebuilt;
            let acts = match memory {
                LayerMemory::Kept(acts) => acts,
                LayerMemory::Checkpoint(x_in) => {
                    rebuilt = self
                        .layer_forward(l, x_in.clone(), &pass.spans, &pass.positions)
                        .0;
                    &rebuilt
                }
            };
            let w = &self.weights.layers[l];
            let g = &mut grads.layers[l];
            // MLP: x_out = x_mid + down(swiglu(gate(h2), up(h2)))
            let mut d_act = be.zeros(n * i_dim);
            be.matmul_backward(
                &mut d_act,
                &mut g.w_down.data,
                None,
                &dx,
                &acts.act,
                &w.w_down.data,
                n,
                i_dim,
                c,
            );
            let (mut d_gate, mut d_up) = (be.zeros(n * i_dim), be.zeros(n * i_dim));
            be.swiglu_backward(&mut d_gate, &mut d_up, &d_act, &acts.gate, &acts.up);
            let mut d_h2 = be.zeros(n * c);
            be.matmul_backward_shared(
                &mut d_h2,
                &acts.h2,
                n,
                c,
                &mut [
                    ProductGrad {
                        dw: &mut g.w_gate.data,
                        db: None,
                        dout: &d_gate,
                        w: &w.w_gate.data,
                        o: i_dim,
                    },
                    ProductGrad {
                        dw: &mut g.w_up.data,
                        db: None,
                        dout: &d_up,
                        w: &w.w_up.data,
                        o: i_dim,
                    },
                ],
            );
            // dx now means ∂L/∂x_mid: the residual path plus the norm's path.
            be.rmsnorm_backward(
                &mut dx,
                &mut g.ffn_norm.data,
                &d_h2,
                &acts.x_mid,
                &w.ffn_norm.data,
                &acts.rstd2,
            );

            // Attention: x_mid = x_in + o(attn(rope(q(h1)), rope(k(h1)), v(h1)))
            let mut d_att_out = be.zeros(n * qd);
            be.matmul_backward(
                &mut d_att_out,
                &mut g.wo.data,
                None,
                &dx,
                &acts.att_out,
                &w.wo.data,
                n,
                qd,
                c,
            );
            let (mut dq, mut dk, mut dv) = (be.zeros(n * qd), be.zeros(n * kv), be.zeros(n * kv));
            be.attention_backward(
                &mut dq,
                &mut dk,
                &mut dv,
                &d_att_out,
                &acts.att_out,
                &acts.att_lse,
                &acts.q,
                &acts.k,
                &acts.v,
                &pass.spans,
                heads,
                kv_heads,
                hd,
            );
            // RoPE is a rotation: its transpose rotates back.
            // With an attention factor s it is s times a rotation: the transpose is s
            // times the inverse rotation.
            be.rope_apply(&mut dq, heads, &pass.positions, &self.inv_freq, -1.0);
            be.rope_apply(&mut dk, kv_heads, &pass.positions, &self.inv_freq, -1.0);
            if rope_factor != 1.0 {
                be.scale(&mut dq, rope_factor);
                be.scale(&mut dk, rope_factor);
            }
            // Qwen3: back through the per-head norms to the projections' outputs.
            if let (Some(a), Some(qn), Some(kn), Some(gqn), Some(gkn)) = (
                &acts.qk_norm,
                &w.q_norm,
                &w.k_norm,
                g.q_norm.as_mut(),
                g.k_norm.as_mut(),
            ) {
                let (mut dq_pre, mut dk_pre) = (be.zeros(n * qd), be.zeros(n * kv));
                be.rmsnorm_backward(
                    &mut dq_pre,
                    &mut gqn.data,
                    &dq,
                    &a.q_pre,
                    &qn.data,
                    &a.rstd_q,
                );
                be.rmsnorm_backward(
                    &mut dk_pre,
                    &mut gkn.data,
                    &dk,
                    &a.k_pre,
                    &kn.data,
                    &a.rstd_k,
                );
                (dq, dk) = (dq_pre, dk_pre);
            }
            let mut d_h1 = be.zeros(n * c);
            be.matmul_backward_shared(
                &mut d_h1,
                &acts.h1,
                n,
                c,
                &mut [
                    ProductGrad {
                        dw: &mut g.wq.data,
                        db: bias_grad(&mut g.bq),
                        dout: &dq,
                        w: &w.wq.data,
                        o: qd,
                    },
                    ProductGrad {
                        dw: &mut g.wk.data,
                        db: bias_grad(&mut g.bk),
                        dout: &dk,
                        w: &w.wk.data,
                        o: kv,
                    },
                    ProductGrad {
                        dw: &mut g.wv.data,
                        db: bias_grad(&mut g.bv),
                        dout: &dv,
                        w: &w.wv.data,
                        o: kv,
                    },
                ],
            );
            be.rmsnorm_backward(
                &mut dx,
                &mut g.attn_norm.data,
                &d_h1,
                &acts.x_in,
                &w.attn_norm.data,
                &acts.rstd1,
            );
        }
        be.embedding_backward(&mut grads.embed.data, &dx, &pass.tokens);
    }

    /// The head's backward over the pass's scored rows (h: their (M, C) rows).
    fn head_backward(
        &self,
        dh: &mut B::Buf,
        grads: &mut Weights<B::Buf>,
        h: &B::Buf,
        pass: &TrainPass<B>,
        d_lp: &[f32],
        d_h: &[f32],
    ) {
        let targets = pass.scored.pick(&pass.targets);
        if targets.is_empty() {
            return;
        }
        self.backend.head_backward(
            dh,
            &mut grads.head_mut().data,
            h,
            &self.weights.head().data,
            &pass.lse,
            &pass.entropy,
            &targets,
            d_lp,
            d_h,
            self.config.hidden_size,
            self.config.vocab_size,
        );
    }

    /// The global L2 norm of all gradients.
    pub fn grad_norm(&self, grads: &Weights<B::Buf>) -> f32 {
        let tensors: Vec<&B::Buf> = grads.named().into_iter().map(|(_, t)| &t.data).collect();
        self.backend.sum_squares(&tensors).sqrt() as f32
    }

    /// Multiplies every gradient by `factor` (for clipping).
    pub fn scale_grads(&self, grads: &mut Weights<B::Buf>, factor: f32) {
        for (_, t) in grads.named_mut() {
            self.backend.scale(&mut t.data, factor);
        }
    }
}

/// A projection's bias, where it has one (Qwen2's q, k, v).
fn bias<S>(b: &Option<Tensor<S>>) -> Option<&S> {
    b.as_ref().map(|b| &b.data)
}

/// The gradient of a projection's bias, where it has one.
fn bias_grad<S>(b: &mut Option<Tensor<S>>) -> Option<&mut S> {
    b.as_mut().map(|b| &mut b.data)
}

/// Per-sequence values laid out as one value per row (0 on rows without a value).
fn rows_from(per_sequence: &[Vec<f32>], spans: &[Span], n: usize) -> Vec<f32> {
    let mut rows = vec![0f32; n];
    for (s, &(start, len)) in spans.iter().enumerate() {
        for t in 0..len - 1 {
            rows[start + t] = per_sequence
                .get(s)
                .and_then(|d| d.get(t))
                .copied()
                .unwrap_or(0.0);
        }
    }
    rows
}

impl Scored {
    fn count(&self, n: usize) -> usize {
        match self {
            Scored::All => n,
            Scored::Rows(rows) => rows.len(),
        }
    }

    /// The scored rows' values of a per-row vector.
    fn pick<T: Copy>(&self, per_row: &[T]) -> Vec<T> {
        match self {
            Scored::All => per_row.to_vec(),
            Scored::Rows(rows) => rows.iter().map(|&r| per_row[r]).collect(),
        }
    }

    /// Per-row values from the scored rows' (0 elsewhere).
    fn spread(&self, scored: &[f32], n: usize) -> Vec<f32> {
        match self {
            Scored::All => scored.to_vec(),
            Scored::Rows(rows) => {
                let mut out = vec![0f32; n];
                for (&r, &v) in rows.iter().zip(scored) {
                    out[r] = v;
                }
                out
            }
        }
    }
}

/// Rows whose prediction a mask asks for: row start+t predicts token t+1 of its sequence.
fn scored_rows(masks: &[&[u8]], spans: &[Span]) -> Vec<usize> {
    let mut rows = Vec::new();
    for (s, &(start, len)) in spans.iter().enumerate() {
        let mask = masks.get(s).copied().unwrap_or_default();
        for t in 0..len.saturating_sub(1) {
            if mask.get(t + 1).is_some_and(|m| *m != 0) {
                rows.push(start + t);
            }
        }
    }
    rows
}

/// The token each row predicts (None on a sequence's last row).
fn next_tokens(tokens: &[u32], spans: &[Span]) -> Vec<Option<u32>> {
    let mut targets = vec![None; tokens.len()];
    for &(start, len) in spans {
        for t in 0..len.saturating_sub(1) {
            targets[start + t] = Some(tokens[start + t + 1]);
        }
    }
    targets
}

/// AdamW with decoupled weight decay (not applied to norms and biases). The moments live
/// in the model's backend.
#[derive(Clone, Debug)]
pub struct AdamW<B: Backend = Cpu> {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub step: u64,
    pub m: Weights<B::Buf>,
    pub v: Weights<B::Buf>,
}

impl<B: Backend> AdamW<B> {
    pub fn new(model: &Model<B>, weight_decay: f32) -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            step: 0,
            m: model.zeros_like_weights(),
            v: model.zeros_like_weights(),
        }
    }

    /// One update of the model's weights from `grads`.
    pub fn update(&mut self, model: &mut Model<B>, grads: &Weights<B::Buf>, lr: f32) {
        self.step += 1;
        let step = AdamStep {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: 0.0,
            correction1: 1.0 - self.beta1.powi(self.step as i32),
            correction2: 1.0 - self.beta2.powi(self.step as i32),
        };
        let backend = model.backend.clone();
        let params = model.weights_mut().named_mut();
        let (grads, m, v) = (grads.named(), self.m.named_mut(), self.v.named_mut());
        backend.scope(|| {
            for ((((_, p), (_, g)), (_, m)), (_, v)) in params.into_iter().zip(grads).zip(m).zip(v)
            {
                let weight_decay = if p.shape.len() >= 2 {
                    self.weight_decay
                } else {
                    0.0
                };
                let step = AdamStep {
                    weight_decay,
                    ..step
                };
                backend.adamw(&mut p.data, &g.data, &mut m.data, &mut v.data, step);
            }
        });
    }
}
