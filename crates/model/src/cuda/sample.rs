//! The engine's next tokens, drawn on the GPU from the step's logits (`sample_rows` in
//! kernels.cu): only each pick's token, its raw log-probability and its top alternatives
//! come back, never the vocabulary-wide rows (151,936 floats a row for Qwen2.5).
//!
//! The draw is the host's (`generate::sample`): the same uniform from the sequence's
//! generator, the inverse CDF of softmax(z / T) summed in f64. Without top-k and top-p it
//! is the host's token (only the order of the sums differs, so a uniform within rounding of
//! a boundary between two tokens may pick the neighbour). With them, the kept tokens are
//! the host's (those at or above a threshold logit, found by radix select: ties at the
//! threshold all stay), but they are walked in vocabulary order where the host walks them
//! best first: the same distribution, another token for a given uniform.

use cudarc::driver::LaunchConfig;

use super::{Arg, Cuda, CudaError, GpuBuf, args};

/// Threads of one pick's block (kernels.cu's SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 512;
/// Alternatives one pick reports at most (kernels.cu's TOP_MAX; the API's cap).
pub const TOP_MAX: usize = 20;
/// Floats a pick writes back: its token, log-probability, then TOP_MAX ids and values.
const PICKED_FLOATS: usize = 2 + 2 * TOP_MAX;

/// One draw from a row of logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pick {
    /// The row of the (rows, vocab) logits it reads.
    pub row: usize,
    /// ≤ 0: greedy (the first index of the largest logit).
    pub temperature: f32,
    /// A uniform in [0, 1), drawn on the host from the sequence's generator (unused when
    /// greedy), so a seed means what it means on the CPU.
    pub uniform: f32,
    /// Alternatives to report, at most [`TOP_MAX`].
    pub top_n: usize,
    /// Only the `top_k` likeliest tokens (0: all).
    pub top_k: usize,
    /// Only the likeliest tokens whose tempered probabilities first sum to `top_p` (1: all).
    pub top_p: f32,
}

/// What a pick drew: the token, its log-probability under the raw logits (log-softmax
/// before temperature, as the engine reports them) and the `top_n` likeliest tokens with
/// theirs, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct Picked {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl Cuda {
    /// Draws every pick from `logits` (rows of `vocab`), one block per pick, and brings back
    /// what they drew. A device failure, or a pick outside what the kernel can do (a row
    /// past the buffer, more than [`TOP_MAX`] alternatives), is the error.
    pub fn sample_rows(
        &self,
        logits: &GpuBuf,
        vocab: usize,
        picks: &[Pick],
    ) -> Result<Vec<Picked>, CudaError> {
        if picks.is_empty() {
            return Ok(Vec::new());
        }
        let rows = logits.len / vocab.max(1);
        if let Some(bad) = picks.iter().find(|p| p.row >= rows || p.top_n > TOP_MAX) {
            return Err(CudaError::Driver {
                what: "sampling on the device",
                reason: format!(
                    "pick {bad:?} is outside {rows} rows of logits or over {TOP_MAX} alternatives"
                ),
            });
        }
        let table: Vec<f32> = picks
            .iter()
            .flat_map(|p| {
                [
                    p.row as f32,
                    p.temperature,
                    p.uniform,
                    p.top_n as f32,
                    p.top_k.min(1 << 24) as f32,
                    p.top_p,
                ]
            })
            .collect();
        let out = self.alloc(picks.len() * PICKED_FLOATS, "sampling on the device");
        if let Some(table) = self.upload_any(&table) {
            let (op, zp, v32) = (out.ptr(0), logits.ptr(0), vocab as i32);
            let cfg = LaunchConfig {
                grid_dim: (picks.len() as u32, 1, 1),
                block_dim: (SAMPLE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch("sample_rows", cfg, args![op, zp, table, v32]);
        }
        let host = crate::backend::Backend::download(self, &out);
        self.synchronize()?;
        Ok(picks
            .iter()
            .zip(host.chunks(PICKED_FLOATS))
            .map(|(pick, o)| Picked {
                id: o[0].to_bits(),
                logprob: o[1],
                top: (0..pick.top_n)
                    .map(|t| (o[2 + t].to_bits(), o[2 + TOP_MAX + t]))
                    .collect(),
            })
            .collect())
    }

    /// Row `row` of (rows, `vocab`) logits, on the host: for draws the device does not make
    /// (top-k, top-p).
    pub fn download_row(
        &self,
        logits: &GpuBuf,
        vocab: usize,
        row: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let mut host = vec![0f32; vocab];
        if (row + 1) * vocab > logits.len {
            return Err(CudaError::Driver {
                what: "reading logits",
                reason: format!("row {row} is past {} rows", logits.len / vocab.max(1)),
            });
        }
        self.read(logits, row * vocab, &mut host, "reading logits");
        self.synchronize()?;
        Ok(host)
    }
}
