//! One LLM call of one trial, as recorded by the token proxy.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_time, example_trial};
use crate::events::Example;
use crate::{RunId, TrialId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    /// The request was aborted (client gone, weights swap with abort policy).
    Abort,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CallTiming {
    pub started_at: DateTime<Utc>,
    /// From the request reaching the proxy to the last byte of the answer.
    pub latency_ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_to_first_token_ms: Option<f64>,
}

/// Exactly what the engine saw and produced. These ids, never re-tokenized text, are what
/// trajectories are built from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LlmCallV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    /// 0 for the first call of the trial.
    pub turn_index: u32,
    /// The OpenAI `messages` of the request, as sent by the agent.
    pub request_messages: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<serde_json::Value>,
    pub prompt_token_ids: Vec<u32>,
    pub completion_token_ids: Vec<u32>,
    /// Log-probability of each completion token under the sampling policy.
    pub logprobs: Vec<f32>,
    pub policy_version: u64,
    pub finish_reason: FinishReason,
    pub timing: CallTiming,
    /// The backend that served the call (URL or name).
    pub backend: String,
    pub model: String,
}
// Version 1 was stored on a subject per trial (`arl.llm.<run_id>.<trial_id>.call`);
// nothing publishes it any more, and it reads as version 2, on the run's subject.
impl crate::Event for LlmCallV1 {
    const TYPE: &'static str = "llm.call";
    const VERSION: u32 = 1;
    const DOMAIN: crate::Domain = crate::Domain::Llm;

    fn filter(ns: &crate::Namespace) -> String {
        ns.event_filter(Self::DOMAIN, "call")
    }

    fn subject(&self, ns: &crate::Namespace) -> String {
        ns.event_subject(Self::DOMAIN, &self.run_id, "call")
    }

    fn message_id(&self) -> String {
        format!("llm.call:{}:{}", self.trial_id, self.turn_index)
    }
}

impl Example for LlmCallV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            trial_id: example_trial(),
            turn_index: 0,
            request_messages: serde_json::json!([
                {"role": "system", "content": "You are a careful software engineer."},
                {"role": "user", "content": "Fix the failing test in fizzbuzz.py."}
            ]),
            tools: None,
            prompt_token_ids: vec![1, 9690, 198, 2683, 359, 253, 5356, 2],
            completion_token_ids: vec![28, 4301, 16201, 2],
            logprobs: vec![-0.12, -1.03, -0.4, -0.01],
            policy_version: 1,
            finish_reason: FinishReason::Stop,
            timing: CallTiming {
                started_at: example_time(),
                latency_ms: 812.5,
                time_to_first_token_ms: Some(95.0),
            },
            backend: "http://127.0.0.1:8000".into(),
            model: "SmolLM2-135M-Instruct".into(),
        }
    }
}
