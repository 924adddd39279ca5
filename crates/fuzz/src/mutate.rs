//! A small mutational fuzzer for stable Rust: it starts from a target's seeds and feeds it
//! mutants (bit flips, interesting integers over 1–8 bytes, insertions, deletions, copied
//! ranges, splices of two inputs) for a time budget. No coverage guidance — that is what
//! cargo-fuzz adds (`make fuzz`) — but the seeds are valid files, so mutants reach past the
//! first checks. Runs are reproducible from the printed seed.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use crate::Target;

/// What a run did.
#[derive(Debug)]
pub struct Outcome {
    pub executions: u64,
    /// The first input that panicked, and the panic's message.
    pub crash: Option<(Vec<u8>, String)>,
}

/// xorshift64*: fast, and the same sequence from the same seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Values at the edges of ranges, where length and offset checks go wrong.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    7,
    8,
    0x7f,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 40,
    u64::MAX,
];

fn mutate(input: &mut Vec<u8>, other: &[u8], rng: &mut Rng) {
    for _ in 0..1 + rng.below(4) {
        let len = input.len();
        match rng.below(7) {
            0 if len > 0 => {
                let at = rng.below(len);
                input[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let width = [1, 2, 4, 8][rng.below(4)];
                let at = rng.below(len);
                let value = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                for (k, byte) in value.iter().take(width).enumerate() {
                    if let Some(slot) = input.get_mut(at + k) {
                        *slot = *byte;
                    }
                }
            }
            2 => {
                let at = rng.below(len + 1);
                let count = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..count).map(|_| rng.next() as u8).collect();
                input.splice(at..at, bytes);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let end = (at + 1 + rng.below(64)).min(len);
                input.drain(at..end);
            }
            4 if len > 0 => {
                let from = rng.below(len);
                let end = (from + 1 + rng.below(64)).min(len);
                let chunk = input[from..end].to_vec();
                let at = rng.below(len + 1);
                input.splice(at..at, chunk);
            }
            5 if !other.is_empty() => {
                let cut = rng.below(input.len() + 1);
                let from = rng.below(other.len());
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            _ if len > 0 => input.truncate(rng.below(len)),
            _ => input.push(rng.next() as u8),
        }
    }
}

/// Feeds `target` its seeds, then mutants of them, for `budget`; stops at the first panic.
pub fn run(target: &Target, budget: Duration, seed: u64) -> Outcome {
    let seeds = (target.seeds)();
    let mut rng = Rng(seed | 1);
    let started = Instant::now();
    let mut executions = 0;
    // The default hook would print every caught panic; the crash is reported once instead.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut crash = None;
    let mut corpus = seeds.clone();
    if corpus.is_empty() {
        corpus.push(Vec::new());
    }
    let mut next_input = 0usize;
    while crash.is_none() && (next_input < seeds.len() || started.elapsed() < budget) {
        let input = if next_input < seeds.len() {
            next_input += 1;
            seeds[next_input - 1].clone()
        } else {
            let mut input = corpus[rng.below(corpus.len())].clone();
            let other = corpus[rng.below(corpus.len())].clone();
            mutate(&mut input, &other, &mut rng);
            input
        };
        executions += 1;
        if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| (target.run)(&input))) {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic without a message".into());
            crash = Some((input, message));
        } else if corpus.len() < 256 && rng.below(64) == 0 {
            // Keep a few mutants: later mutations then stack on earlier ones.
            corpus.push(input);
        }
    }
    std::panic::set_hook(hook);
    Outcome { executions, crash }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panics_on_zz(data: &[u8]) {
        assert!(!data.windows(2).any(|w| w == b"zz"), "found zz");
    }

    #[test]
    fn a_panicking_input_is_found_and_reported() {
        let target = Target {
            name: "zz",
            run: panics_on_zz,
            seeds: || vec![b"z".to_vec(), b"az".to_vec()],
        };
        let outcome = run(&target, Duration::from_secs(20), 7);
        let (input, message) = outcome.crash.expect("the mutator splices `z` into `z`");
        assert!(input.windows(2).any(|w| w == b"zz"));
        assert!(message.contains("found zz"), "{message}");
    }
}
