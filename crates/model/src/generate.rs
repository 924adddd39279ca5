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
    if sampling.top_k == 0 && sampling.top_p >= 1.0 {
        return sample_full(logits, sampling.temperature, rng);
    }
    let mut candidates: Vec<(usize, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &z)| (i, z / sampling.temperature))
        .collect();
    let by_logit = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1);
    if sampling.top_k > 0 && sampling.top_k < candidates.len() {
        // Only the top k need ordering: select them in O(V), then sort k.
        candidates.select_nth_unstable_by(sampling.top_k - 1, by_logit);
        candidates.truncate(sampling.top_k);
    }
    candidates.sort_by(by_logit);
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

/// Sampling from the whole tempered distribution in one pass over the vocabulary (no sort).
fn sample_full(logits: &[f32], temperature: f32, rng: &mut Rng) -> (u32, f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits
        .iter()
        .map(|&z| f64::from(((z - max) / temperature).exp()))
        .sum();
    let target = f64::from(rng.next_f32()) * total;
    let mut cumulative = 0.0;
    let mut chosen = logits.len() - 1;
    for (i, &z) in logits.iter().enumerate() {
        cumulative += f64::from(((z - max) / temperature).exp());
        if target < cumulative {
            chosen = i;
            break;
        }
    }
    let p = f64::from(((logits[chosen] - max) / temperature).exp()) / total;
    (chosen as u32, p.ln() as f32)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Frequencies of 40,000 draws against the tempered (and truncated) softmax.
    fn frequencies(sampling: &Sampling, logits: &[f32]) -> Vec<f64> {
        let mut rng = Rng::new(7);
        let mut counts = vec![0usize; logits.len()];
        let draws = 40_000;
        for _ in 0..draws {
            counts[sample(logits, sampling, &mut rng).0 as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn samples_follow_the_tempered_distribution() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5];
        let t = 0.7f64;
        let weights: Vec<f64> = logits.iter().map(|&z| (f64::from(z) / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        let sampling = Sampling {
            temperature: 0.7,
            ..Sampling::default()
        };
        for (freq, w) in frequencies(&sampling, &logits).iter().zip(&weights) {
            assert!((freq - w / total).abs() < 0.01, "{freq} vs {}", w / total);
        }
        // top_k = 2 keeps logits 2.0 and 1.5 only, renormalized.
        let top2 = Sampling {
            top_k: 2,
            ..sampling
        };
        let f = frequencies(&top2, &logits);
        let (a, b) = (weights[1], weights[4]);
        assert!((f[1] - a / (a + b)).abs() < 0.01 && (f[4] - b / (a + b)).abs() < 0.01);
        assert_eq!(f[0] + f[2] + f[3], 0.0);
    }
}
