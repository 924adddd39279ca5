//! Token generation on top of [`Model::forward`]: greedy or sampled, with log-probabilities.

use crate::backend::Backend;
use crate::model::{KvCache, Model, SeqInput};
use crate::ops;

/// Sampling settings; temperature 0 is greedy.
#[derive(Clone, Debug)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// A small deterministic generator (xorshift64*), so a seed reproduces a sample.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32) / (1u64 << 24) as f32
    }
}

/// Picks the next token from logits; returns (token, log-probability under the sampling
/// distribution actually used — temperature, top-k and top-p applied).
pub fn sample(logits: &[f32], sampling: &Sampling, rng: &mut Rng) -> (u32, f32) {
    if sampling.temperature <= 0.0 {
        let (best, _) = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |acc, (i, &z)| if z > acc.1 { (i, z) } else { acc },
            );
        let (lse, _) = ops::logsumexp_entropy(logits);
        return (best as u32, logits[best] - lse);
    }
    let mut candidates: Vec<(usize, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &z)| (i, z / sampling.temperature))
        .collect();
    candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
    if sampling.top_k > 0 {
        candidates.truncate(sampling.top_k);
    }
    let max = candidates[0].1;
    let mut probs: Vec<f32> = candidates.iter().map(|(_, z)| (z - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if sampling.top_p < 1.0 {
        let mut cumulative = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                cumulative += p;
                cumulative >= sampling.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        candidates.truncate(keep);
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let r = rng.next_f32();
    let mut cumulative = 0.0;
    for (i, p) in probs.iter().enumerate() {
        cumulative += p;
        if r < cumulative || i == probs.len() - 1 {
            return (candidates[i].0 as u32, p.ln());
        }
    }
    (candidates[0].0 as u32, probs[0].ln())
}

/// Generates up to `max_tokens` after `prompt`, stopping at any of `stop_ids`.
/// Returns the new tokens and their log-probabilities.
pub fn generate<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    sampling: &Sampling,
) -> (Vec<u32>, Vec<f32>) {
    let mut cache = KvCache::new(model);
    let mut rng = Rng::new(sampling.seed);
    let mut logits = model
        .forward(&mut [SeqInput {
            tokens: prompt,
            cache: &mut cache,
        }])
        .remove(0);
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    for _ in 0..max_tokens {
        let (token, logprob) = sample(&logits, sampling, &mut rng);
        tokens.push(token);
        logprobs.push(logprob);
        if stop_ids.contains(&token) {
            break;
        }
        logits = model
            .forward(&mut [SeqInput {
                tokens: &[token],
                cache: &mut cache,
            }])
            .remove(0);
    }
    (tokens, logprobs)
}
