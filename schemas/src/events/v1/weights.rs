//! A new policy version, ready for engines to load.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_time};
use crate::RunId;
use crate::events::{Example, event};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightsFormat {
    /// A Hugging Face directory: `config.json`, `*.safetensors`, tokenizer files.
    HfSafetensors,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WeightsPublishedV1 {
    pub run_id: RunId,
    pub policy_version: u64,
    pub step: u32,
    /// `file:///…` on one machine; an object-store URI in a cluster.
    pub uri: String,
    /// SHA-256 over the weight files, hex.
    pub sha256: String,
    pub format: WeightsFormat,
    pub size_bytes: u64,
    pub at: DateTime<Utc>,
}
event!(WeightsPublishedV1, weights, "published", 1, |e| format!(
    "weights.published:{}:{}",
    e.run_id, e.policy_version
));

impl Example for WeightsPublishedV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            policy_version: 1,
            step: 1,
            uri: "file:///home/ada/.cache/arl/runs/run-0193a1b2c3d4/step-1".into(),
            sha256: "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae".into(),
            format: WeightsFormat::HfSafetensors,
            size_bytes: 538_090_408,
            at: example_time(),
        }
    }
}
