//! Experiment tracking where ML people look: every `train.step` and `eval.completed` is
//! also written as TensorBoard scalars, one event file per run and controller under
//! `<dir>/<run_id>/`, with VeRL's metric names (`actor/pg_loss`, `critic/score/mean`,
//! `timing_s/step`, `val/…`) so ARL runs and VeRL runs chart side by side.
//!
//! The file format is TensorBoard's own: TFRecord framing (length, masked CRC-32C, data,
//! masked CRC-32C) around `tensorflow.Event` protocol buffers, written here by hand (a few
//! fields) rather than pulling a protobuf stack in.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use arl_schemas::RunId;
use arl_schemas::events::{EvaluationCompletedV1, TrainStep};

/// One scalar: a tag and its value at a step.
pub type Scalar = (String, f64);

/// The scalars of a train step (either version), under VeRL's names.
pub fn step_scalars(step: &TrainStep) -> Vec<Scalar> {
    let (m, t) = match step {
        TrainStep::V1(s) => (&s.metrics, &s.timing),
        TrainStep::V2(s) => (&s.metrics, &s.timing),
    };
    let mut scalars: Vec<Scalar> = [
        ("actor/pg_loss", m.pg_loss),
        ("actor/grad_norm", m.grad_norm),
        ("actor/kl_loss", m.kl),
        ("actor/entropy", m.entropy),
        ("actor/pg_clipfrac", m.clip_fraction),
        ("actor/lr", m.lr),
        ("critic/score/mean", m.reward_mean),
        ("critic/score/max", m.reward_max),
        ("response_length/mean", m.response_length_mean),
        ("num_turns/mean", m.num_turns_mean),
        ("tool_calls/mean", m.tool_calls_mean),
        ("perf/throughput", m.tokens_per_second),
        ("timing_s/gen", t.wait_for_trajectories),
        ("timing_s/old_log_prob", t.old_logprobs),
        ("timing_s/update_actor", t.update),
        ("timing_s/save_checkpoint", t.save),
        ("timing_s/step", t.total),
    ]
    .into_iter()
    .map(|(tag, value)| (tag.to_owned(), value))
    .collect();
    if let TrainStep::V2(s) = step {
        let b = &s.batch;
        for (tag, count) in [
            ("batch/trajectories", b.trajectories),
            ("batch/masked", b.masked),
            ("batch/stale", b.stale),
            ("batch/zero_advantage_groups", b.zero_advantage_groups),
            ("batch/samples_trained", b.samples_trained),
        ] {
            scalars.push((tag.to_owned(), f64::from(count)));
        }
    }
    scalars
}

/// The scalars of an evaluation, under VeRL's `val/` names.
pub fn eval_scalars(eval: &EvaluationCompletedV1) -> Vec<Scalar> {
    let mut scalars = vec![
        ("val/test_score/mean".to_owned(), eval.resolution_rate),
        ("val/test_score/ci95_low".to_owned(), eval.ci95_low),
        ("val/test_score/ci95_high".to_owned(), eval.ci95_high),
    ];
    for p in &eval.pass_at_k {
        scalars.push((format!("val/pass@{}", p.k), p.value));
    }
    scalars
}

/// Writes each run's scalars to its own event file under a folder.
#[derive(Debug)]
pub struct TensorBoard {
    dir: PathBuf,
    files: Mutex<HashMap<RunId, EventFile>>,
}

impl TensorBoard {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            files: Mutex::new(HashMap::new()),
        }
    }

    /// Appends `scalars` at `step` to the run's event file (opened on first use) and
    /// flushes it, so TensorBoard shows them at once.
    pub fn write(&self, run: &RunId, step: u32, scalars: &[Scalar]) -> std::io::Result<()> {
        let mut files = self
            .files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let file = match files.entry(run.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(EventFile::create(&self.dir.join(run.as_str()))?)
            }
        };
        file.scalars(i64::from(step), scalars)
    }
}

/// One `events.out.tfevents.*` file.
#[derive(Debug)]
pub struct EventFile {
    file: File,
    path: PathBuf,
}

impl EventFile {
    /// A new event file in `dir` (created), named as TensorBoard's writers name theirs,
    /// starting with the file-version event readers expect first.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = wall_time();
        let host = arl_runtime::host::host_name();
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            now as u64,
            std::process::id(),
            uuid::Uuid::now_v7().simple()
        ));
        let mut file = Self {
            file: File::create(&path)?,
            path,
        };
        let mut event = Vec::new();
        event_header(&mut event, now, 0);
        put_bytes(&mut event, 3, b"brain.Event:2");
        file.record(&event)?;
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event holding `scalars` at `step`.
    pub fn scalars(&mut self, step: i64, scalars: &[Scalar]) -> std::io::Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut entry = Vec::new();
            put_bytes(&mut entry, 1, tag.as_bytes());
            // simple_value: field 2, fixed32 (TensorBoard's scalar plugin reads it as f32).
            entry.push(0x15);
            entry.extend_from_slice(&(*value as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &entry);
        }
        let mut event = Vec::new();
        event_header(&mut event, wall_time(), step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.file.flush()
    }

    /// TFRecord framing: length, its masked CRC, the data, its masked CRC.
    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        let mut framed = Vec::with_capacity(data.len() + 16);
        framed.extend_from_slice(&length);
        framed.extend_from_slice(&masked_crc32c(&length).to_le_bytes());
        framed.extend_from_slice(data);
        framed.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.file.write_all(&framed)
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `Event.wall_time` (field 1, double) and `Event.step` (field 2, int64).
fn event_header(out: &mut Vec<u8>, wall_time: f64, step: i64) {
    out.push(0x09);
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(0x10);
    put_varint(out, step as u64);
}

/// A length-delimited field (strings, bytes, sub-messages).
fn put_bytes(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push((field << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// CRC-32C (Castagnoli), as TFRecord uses it.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut crc = i as u32;
            let mut bit = 0;
            while bit < 8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
                bit += 1;
            }
            table[i] = crc;
            i += 1;
        }
        table
    };
    let mut crc = !0u32;
    for &byte in data {
        crc = TABLE[((crc ^ u32::from(byte)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masking of a CRC (so a CRC of data holding CRCs is not degenerate).
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use arl_schemas::events::Example;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C of "123456789" (RFC 3720, appendix B.4).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_are_framed_with_checksums_a_reader_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = EventFile::create(dir.path()).unwrap();
        file.scalars(3, &[("actor/pg_loss".into(), 0.5)]).unwrap();
        let bytes = std::fs::read(file.path()).unwrap();
        let mut at = 0;
        let mut records = 0;
        while at < bytes.len() {
            let length = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let length_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(length_crc, masked_crc32c(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + length];
            let data_crc = u32::from_le_bytes(
                bytes[at + 12 + length..at + 16 + length]
                    .try_into()
                    .unwrap(),
            );
            assert_eq!(data_crc, masked_crc32c(data));
            at += 16 + length;
            records += 1;
        }
        assert_eq!(records, 2, "the file version, then one scalar event");
        // The tag and the f32 value are in the second record, as protobuf fields.
        let tail = &bytes[bytes.len() - 40..];
        assert!(tail.windows(13).any(|w| w == b"actor/pg_loss"));
        assert!(tail.windows(4).any(|w| w == 0.5f32.to_le_bytes()));
    }

    #[test]
    fn a_step_is_charted_under_verl_names() {
        let step = arl_schemas::events::TrainStepV2::example();
        let scalars = step_scalars(&TrainStep::V2(step.clone()));
        let value = |tag: &str| scalars.iter().find(|(t, _)| t == tag).map(|(_, v)| *v);
        assert_eq!(value("actor/pg_loss"), Some(step.metrics.pg_loss));
        assert_eq!(value("critic/score/mean"), Some(step.metrics.reward_mean));
        assert_eq!(value("timing_s/step"), Some(step.timing.total));
        let eval = EvaluationCompletedV1::example();
        let scalars = eval_scalars(&eval);
        assert_eq!(
            scalars[0],
            ("val/test_score/mean".into(), eval.resolution_rate)
        );
    }
}
