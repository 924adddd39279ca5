//! Training: a forward pass over whole sequences that keeps every activation, the
//! per-token log-probability (and entropy) of each next token, and the explicit backward
//! pass that turns their gradients into parameter gradients.
//!
//! Sequence `s` of length T yields T-1 predictions: `logprobs[s][t] = log p(tokens[t+1] |
//! tokens[..=t])`. The vocabulary projection runs over row chunks, so all (N, V) logits
//! never exist at once.

use rayon::prelude::*;

use crate::model::Model;
use crate::ops;
use crate::weights::Weights;

/// Rows of the (rows, V) logits block the head works on at once.
const HEAD_CHUNK: usize = 32;

struct LayerActs {
    x_in: Vec<f32>,     // (N, C) residual stream entering the layer
    rstd1: Vec<f32>,    // (N)
    h1: Vec<f32>,       // (N, C)
    q: Vec<f32>,        // (N, C) after RoPE
    k: Vec<f32>,        // (N, KV) after RoPE
    v: Vec<f32>,        // (N, KV)
    att: Vec<Vec<f32>>, // per sequence (nh, T, T)
    att_out: Vec<f32>,  // (N, C)
    x_mid: Vec<f32>,    // (N, C)
    rstd2: Vec<f32>,    // (N)
    h2: Vec<f32>,       // (N, C)
    gate: Vec<f32>,     // (N, I)
    up: Vec<f32>,       // (N, I)
    act: Vec<f32>,      // (N, I)
}

/// Everything the backward pass needs from a forward pass.
pub struct TrainPass {
    tokens: Vec<u32>,
    /// Start of each sequence in the concatenated token rows, and its length.
    spans: Vec<(usize, usize)>,
    positions: Vec<usize>,
    layers: Vec<LayerActs>,
    x_final: Vec<f32>, // (N, C)
    rstd_final: Vec<f32>,
    h_final: Vec<f32>, // (N, C)
    /// Per row: log Σ exp(logits), to rebuild probabilities in the backward pass.
    lse: Vec<f32>,
    entropy: Vec<f32>,
}

impl TrainPass {
    /// `logprobs[s][t]` for every sequence.
    pub fn logprobs(&self, logprob_rows: &[f32]) -> Vec<Vec<f32>> {
        self.spans
            .iter()
            .map(|&(start, len)| logprob_rows[start..start + len - 1].to_vec())
            .collect()
    }

    pub fn entropies(&self) -> Vec<Vec<f32>> {
        self.spans
            .iter()
            .map(|&(start, len)| self.entropy[start..start + len - 1].to_vec())
            .collect()
    }

    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }
}

impl Model {
    /// Forward over whole sequences (each at least 2 tokens), keeping activations.
    /// Returns the pass and, per sequence, the log-probabilities of its next tokens.
    pub fn forward_train(&self, sequences: &[&[u32]]) -> (TrainPass, Vec<Vec<f32>>) {
        let cfg = &self.config;
        let (c, kv, hd, i_dim) = (
            cfg.hidden_size,
            cfg.kv_dim(),
            cfg.head_dim(),
            cfg.intermediate_size,
        );
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
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
        let mut x = vec![0f32; n * c];
        ops::embedding_forward(&mut x, &self.weights.embed.data, &tokens);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for w in &self.weights.layers {
            let x_in = x.clone();
            let (mut h1, mut rstd1) = (vec![0f32; n * c], vec![0f32; n]);
            ops::rmsnorm_forward(&mut h1, &mut rstd1, &x_in, &w.attn_norm.data, eps);
            let (mut q, mut k, mut v) = (vec![0f32; n * c], vec![0f32; n * kv], vec![0f32; n * kv]);
            ops::matmul_forward(
                &mut q,
                &h1,
                &w.wq.data,
                w.bq.as_ref().map(|b| &b.data[..]),
                n,
                c,
                c,
            );
            ops::matmul_forward(
                &mut k,
                &h1,
                &w.wk.data,
                w.bk.as_ref().map(|b| &b.data[..]),
                n,
                c,
                kv,
            );
            ops::matmul_forward(
                &mut v,
                &h1,
                &w.wv.data,
                w.bv.as_ref().map(|b| &b.data[..]),
                n,
                c,
                kv,
            );
            ops::rope_apply(&mut q, heads, &positions, &self.inv_freq, 1.0);
            ops::rope_apply(&mut k, kv_heads, &positions, &self.inv_freq, 1.0);
            let mut att_out = vec![0f32; n * c];
            let mut att = Vec::with_capacity(spans.len());
            for &(start, t) in &spans {
                let mut probs = vec![0f32; heads * t * t];
                ops::attention_forward(
                    &mut att_out[start * c..(start + t) * c],
                    &mut probs,
                    &q[start * c..(start + t) * c],
                    &k[start * kv..(start + t) * kv],
                    &v[start * kv..(start + t) * kv],
                    t,
                    heads,
                    kv_heads,
                    hd,
                );
                att.push(probs);
            }
            let mut proj = vec![0f32; n * c];
            ops::matmul_forward(&mut proj, &att_out, &w.wo.data, None, n, c, c);
            let x_mid: Vec<f32> = x_in.iter().zip(&proj).map(|(a, b)| a + b).collect();
            let (mut h2, mut rstd2) = (vec![0f32; n * c], vec![0f32; n]);
            ops::rmsnorm_forward(&mut h2, &mut rstd2, &x_mid, &w.ffn_norm.data, eps);
            let (mut gate, mut up, mut act) = (
                vec![0f32; n * i_dim],
                vec![0f32; n * i_dim],
                vec![0f32; n * i_dim],
            );
            ops::matmul_forward(&mut gate, &h2, &w.w_gate.data, None, n, c, i_dim);
            ops::matmul_forward(&mut up, &h2, &w.w_up.data, None, n, c, i_dim);
            ops::swiglu_forward(&mut act, &gate, &up);
            ops::matmul_forward(&mut proj, &act, &w.w_down.data, None, n, i_dim, c);
            x = x_mid.iter().zip(&proj).map(|(a, b)| a + b).collect();
            layers.push(LayerActs {
                x_in,
                rstd1,
                h1,
                q,
                k,
                v,
                att,
                att_out,
                x_mid,
                rstd2,
                h2,
                gate,
                up,
                act,
            });
        }
        let (mut h_final, mut rstd_final) = (vec![0f32; n * c], vec![0f32; n]);
        ops::rmsnorm_forward(
            &mut h_final,
            &mut rstd_final,
            &x,
            &self.weights.final_norm.data,
            eps,
        );

        // Head, chunk by chunk: log-probability of the next token and entropy per row.
        let head = self.head();
        let vocab = cfg.vocab_size;
        let targets = next_tokens(&tokens, &spans);
        let stats: Vec<(f32, f32, f32)> = h_final
            .par_chunks(HEAD_CHUNK * c)
            .zip(targets.par_chunks(HEAD_CHUNK))
            .flat_map_iter(|(h, targets)| {
                let rows = h.len() / c;
                let mut logits = vec![0f32; rows * vocab];
                ops::matmul_forward(&mut logits, h, head, None, rows, c, vocab);
                logits
                    .chunks(vocab)
                    .zip(targets)
                    .map(|(z, target)| {
                        let (lse, entropy) = ops::logsumexp_entropy(z);
                        let logprob = target.map_or(0.0, |t| z[t as usize] - lse);
                        (lse, entropy, logprob)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let lse = stats.iter().map(|s| s.0).collect();
        let entropy = stats.iter().map(|s| s.1).collect();
        let logprob_rows: Vec<f32> = stats.iter().map(|s| s.2).collect();
        let pass = TrainPass {
            tokens,
            spans,
            positions,
            layers,
            x_final: x,
            rstd_final,
            h_final,
            lse,
            entropy,
        };
        let logprobs = pass.logprobs(&logprob_rows);
        (pass, logprobs)
    }

    fn head(&self) -> &[f32] {
        &self
            .weights
            .lm_head
            .as_ref()
            .unwrap_or(&self.weights.embed)
            .data
    }

    /// Adds to `grads` the gradient of L, given ∂L/∂logprob and ∂L/∂entropy for every
    /// prediction (same shapes as `forward_train`'s output; entropy may be empty).
    pub fn backward(
        &self,
        pass: &TrainPass,
        d_logprob: &[Vec<f32>],
        d_entropy: &[Vec<f32>],
        grads: &mut Weights,
    ) {
        let cfg = &self.config;
        let (c, kv, hd, i_dim) = (
            cfg.hidden_size,
            cfg.kv_dim(),
            cfg.head_dim(),
            cfg.intermediate_size,
        );
        let (heads, kv_heads, vocab) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.vocab_size,
        );
        let n = pass.tokens.len();

        // Per-row upstream gradients (0 on each sequence's last row: it predicts nothing).
        let mut d_lp = vec![0f32; n];
        let mut d_h = vec![0f32; n];
        for (s, &(start, len)) in pass.spans.iter().enumerate() {
            for t in 0..len - 1 {
                d_lp[start + t] = d_logprob
                    .get(s)
                    .and_then(|d| d.get(t))
                    .copied()
                    .unwrap_or(0.0);
                d_h[start + t] = d_entropy
                    .get(s)
                    .and_then(|d| d.get(t))
                    .copied()
                    .unwrap_or(0.0);
            }
        }
        let targets = next_tokens(&pass.tokens, &pass.spans);
        let head = self.head();
        let mut dh_final = vec![0f32; n * c];
        let mut d_head = vec![0f32; vocab * c];
        for chunk in 0..n.div_ceil(HEAD_CHUNK) {
            let (r0, r1) = (chunk * HEAD_CHUNK, ((chunk + 1) * HEAD_CHUNK).min(n));
            let rows = r1 - r0;
            if (r0..r1).all(|r| d_lp[r] == 0.0 && d_h[r] == 0.0) {
                continue;
            }
            let h = &pass.h_final[r0 * c..r1 * c];
            let mut dlogits = vec![0f32; rows * vocab];
            ops::matmul_forward(&mut dlogits, h, head, None, rows, c, vocab);
            dlogits
                .par_chunks_mut(vocab)
                .enumerate()
                .for_each(|(i, z)| {
                    let r = r0 + i;
                    let (lse, entropy) = (pass.lse[r], pass.entropy[r]);
                    for zj in z.iter_mut() {
                        let logp = *zj - lse;
                        let p = logp.exp();
                        // ∂logp_t/∂z_j = δ_tj - p_j ; ∂H/∂z_j = -p_j (log p_j + H)
                        *zj = -d_lp[r] * p - d_h[r] * p * (logp + entropy);
                    }
                    if let Some(t) = targets[r] {
                        z[t as usize] += d_lp[r];
                    }
                });
            ops::matmul_backward(
                &mut dh_final[r0 * c..r1 * c],
                &mut d_head,
                None,
                &dlogits,
                h,
                head,
                rows,
                c,
                vocab,
            );
        }
        match grads.lm_head.as_mut() {
            Some(g) => add(&mut g.data, &d_head),
            None => add(&mut grads.embed.data, &d_head),
        }

        let mut dx = vec![0f32; n * c];
        ops::rmsnorm_backward(
            &mut dx,
            &mut grads.final_norm.data,
            &dh_final,
            &pass.x_final,
            &self.weights.final_norm.data,
            &pass.rstd_final,
        );

        for (l, acts) in pass.layers.iter().enumerate().rev() {
            let w = &self.weights.layers[l];
            let g = &mut grads.layers[l];
            // MLP: x_out = x_mid + down(swiglu(gate(h2), up(h2)))
            let mut d_act = vec![0f32; n * i_dim];
            ops::matmul_backward(
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
            let (mut d_gate, mut d_up) = (vec![0f32; n * i_dim], vec![0f32; n * i_dim]);
            ops::swiglu_backward(&mut d_gate, &mut d_up, &d_act, &acts.gate, &acts.up);
            let mut d_h2 = vec![0f32; n * c];
            ops::matmul_backward(
                &mut d_h2,
                &mut g.w_gate.data,
                None,
                &d_gate,
                &acts.h2,
                &w.w_gate.data,
                n,
                c,
                i_dim,
            );
            ops::matmul_backward(
                &mut d_h2,
                &mut g.w_up.data,
                None,
                &d_up,
                &acts.h2,
                &w.w_up.data,
                n,
                c,
                i_dim,
            );
            // dx now means ∂L/∂x_mid: the residual path plus the norm's path.
            ops::rmsnorm_backward(
                &mut dx,
                &mut g.ffn_norm.data,
                &d_h2,
                &acts.x_mid,
                &w.ffn_norm.data,
                &acts.rstd2,
            );

            // Attention: x_mid = x_in + o(attn(rope(q(h1)), rope(k(h1)), v(h1)))
            let mut d_att_out = vec![0f32; n * c];
            ops::matmul_backward(
                &mut d_att_out,
                &mut g.wo.data,
                None,
                &dx,
                &acts.att_out,
                &w.wo.data,
                n,
                c,
                c,
            );
            let (mut dq, mut dk, mut dv) =
                (vec![0f32; n * c], vec![0f32; n * kv], vec![0f32; n * kv]);
            for (s, &(start, t)) in pass.spans.iter().enumerate() {
                ops::attention_backward(
                    &mut dq[start * c..(start + t) * c],
                    &mut dk[start * kv..(start + t) * kv],
                    &mut dv[start * kv..(start + t) * kv],
                    &d_att_out[start * c..(start + t) * c],
                    &acts.att[s],
                    &acts.q[start * c..(start + t) * c],
                    &acts.k[start * kv..(start + t) * kv],
                    &acts.v[start * kv..(start + t) * kv],
                    t,
                    heads,
                    kv_heads,
                    hd,
                );
            }
            // RoPE is a rotation: its transpose rotates back.
            ops::rope_apply(&mut dq, heads, &pass.positions, &self.inv_freq, -1.0);
            ops::rope_apply(&mut dk, kv_heads, &pass.positions, &self.inv_freq, -1.0);
            let mut d_h1 = vec![0f32; n * c];
            ops::matmul_backward(
                &mut d_h1,
                &mut g.wq.data,
                g.bq.as_mut().map(|b| &mut b.data[..]),
                &dq,
                &acts.h1,
                &w.wq.data,
                n,
                c,
                c,
            );
            ops::matmul_backward(
                &mut d_h1,
                &mut g.wk.data,
                g.bk.as_mut().map(|b| &mut b.data[..]),
                &dk,
                &acts.h1,
                &w.wk.data,
                n,
                c,
                kv,
            );
            ops::matmul_backward(
                &mut d_h1,
                &mut g.wv.data,
                g.bv.as_mut().map(|b| &mut b.data[..]),
                &dv,
                &acts.h1,
                &w.wv.data,
                n,
                c,
                kv,
            );
            ops::rmsnorm_backward(
                &mut dx,
                &mut g.attn_norm.data,
                &d_h1,
                &acts.x_in,
                &w.attn_norm.data,
                &acts.rstd1,
            );
        }
        ops::embedding_backward(&mut grads.embed.data, &dx, &pass.tokens);
    }
}

fn add(into: &mut [f32], from: &[f32]) {
    into.iter_mut().zip(from).for_each(|(a, b)| *a += b);
}

/// The token each row predicts (None on a sequence's last row).
fn next_tokens(tokens: &[u32], spans: &[(usize, usize)]) -> Vec<Option<u32>> {
    let mut targets = vec![None; tokens.len()];
    for &(start, len) in spans {
        for t in 0..len.saturating_sub(1) {
            targets[start + t] = Some(tokens[start + t + 1]);
        }
    }
    targets
}

/// AdamW with decoupled weight decay (not applied to norms and biases).
#[derive(Clone, Debug)]
pub struct AdamW {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub step: u64,
    pub m: Weights,
    pub v: Weights,
}

impl AdamW {
    pub fn new(params: &Weights, weight_decay: f32) -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            step: 0,
            m: params.zeros_like(),
            v: params.zeros_like(),
        }
    }

    pub fn update(&mut self, params: &mut Weights, grads: &Weights, lr: f32) {
        self.step += 1;
        let (b1, b2, eps, wd) = (self.beta1, self.beta2, self.eps, self.weight_decay);
        let c1 = 1.0 - b1.powi(self.step as i32);
        let c2 = 1.0 - b2.powi(self.step as i32);
        let grads = grads.named();
        let m = self.m.named_mut();
        let v = self.v.named_mut();
        for ((((_, p), (_, g)), (_, m)), (_, v)) in
            params.named_mut().into_iter().zip(grads).zip(m).zip(v)
        {
            let decay = if p.shape.len() >= 2 { wd } else { 0.0 };
            p.data
                .par_iter_mut()
                .zip(g.data.par_iter())
                .zip(m.data.par_iter_mut())
                .zip(v.data.par_iter_mut())
                .for_each(|(((p, g), m), v)| {
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    let update = (*m / c1) / ((*v / c2).sqrt() + eps);
                    *p -= lr * (update + decay * *p);
                });
        }
    }
}

/// The global L2 norm of all gradients.
pub fn grad_norm(grads: &Weights) -> f32 {
    grads
        .named()
        .iter()
        .map(|(_, t)| {
            t.data
                .iter()
                .map(|g| f64::from(*g) * f64::from(*g))
                .sum::<f64>()
        })
        .sum::<f64>()
        .sqrt() as f32
}

/// Multiplies every gradient by `factor` (for clipping).
pub fn scale_grads(grads: &mut Weights, factor: f32) {
    for (_, t) in grads.named_mut() {
        t.data.iter_mut().for_each(|g| *g *= factor);
    }
}
