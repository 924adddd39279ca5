//! One LLM call of one trial, version 2: it also says whose weights answered, as the
//! backend named them. Version 1 recorded only the version the call was trained as, so two
//! runs on one engine could not be told apart in the record (and an engine that names no
//! version looked like it served every one). A version-1 payload reads as version 2 with
//! nothing said of the serving policy.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::events::Example;
use crate::events::v1::{CallTiming, FinishReason, LlmCallV1};
use crate::{RunId, TrialId};

/// Exactly what the engine saw and produced. These ids, never re-tokenized text, are what
/// trajectories are built from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LlmCallV2 {
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
    /// The version the call is trained as.
    pub policy_version: u64,
    /// The run whose weights answered, as the backend named it; None when it named none
    /// (the base model, or a backend that does not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_run_id: Option<RunId>,
    /// The policy version that answered, as the backend said it (ARL's engine) or as the
    /// proxy loaded it into a followed vLLM or SGLang; None when not known (a backend
    /// that does not say and is not followed, or a weight update during the call):
    /// such a call is not trained on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_version: Option<u64>,
    pub finish_reason: FinishReason,
    pub timing: CallTiming,
    /// The backend that served the call (URL or name).
    pub backend: String,
    pub model: String,
}
// One subject per run (`arl.llm.<run_id>.call`), like every other event: a subject per
// trial cost nats-server ~400 bytes of heap for each trial as long as its records were
// kept (14 days), and a consumer per trial to read them. The rollout reads an attempt's
// calls by the stream sequences the proxy reports when it revokes the trial's key.
impl crate::Event for LlmCallV2 {
    const TYPE: &'static str = "llm.call";
    const VERSION: u32 = 2;
    const DOMAIN: crate::Domain = crate::Domain::Llm;

    fn filter(ns: &crate::Namespace) -> String {
        ns.event_filter(Self::DOMAIN, "call")
    }

    fn subject(&self, ns: &crate::Namespace) -> String {
        ns.event_subject(Self::DOMAIN, &self.run_id, "call")
    }

    /// The same as version 1's: one record per turn, whichever version stored it.
    fn message_id(&self) -> String {
        format!("llm.call:{}:{}", self.trial_id, self.turn_index)
    }
}

impl LlmCallV2 {
    /// Whether the serving policy the backend named is the run's own: its run's weights,
    /// or the base model at version 0 (every run starts from it). A backend that named
    /// neither run nor version counts as its own (nothing says otherwise; see
    /// `served_version`).
    pub fn served_by_own_run(&self) -> bool {
        match (&self.served_run_id, self.served_version) {
            (Some(run), _) => *run == self.run_id,
            (None, Some(version)) => version == 0,
            (None, None) => true,
        }
    }
}

impl From<LlmCallV1> for LlmCallV2 {
    fn from(v1: LlmCallV1) -> Self {
        Self {
            run_id: v1.run_id,
            trial_id: v1.trial_id,
            turn_index: v1.turn_index,
            request_messages: v1.request_messages,
            tools: v1.tools,
            prompt_token_ids: v1.prompt_token_ids,
            completion_token_ids: v1.completion_token_ids,
            logprobs: v1.logprobs,
            policy_version: v1.policy_version,
            served_run_id: None,
            served_version: None,
            finish_reason: v1.finish_reason,
            timing: v1.timing,
            backend: v1.backend,
            model: v1.model,
        }
    }
}

impl Example for LlmCallV2 {
    fn example() -> Self {
        let v1 = LlmCallV1::example();
        Self {
            served_run_id: Some(v1.run_id.clone()),
            served_version: Some(v1.policy_version),
            ..Self::from(v1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Event;

    #[test]
    fn a_version_1_record_reads_as_version_2_with_nothing_said_of_the_server() {
        let v1 = LlmCallV1::example();
        let read = LlmCallV2::decode(&v1.encode().unwrap()).unwrap();
        assert_eq!(read, LlmCallV2::from(v1));
        assert!(read.served_by_own_run());
    }

    #[test]
    fn another_runs_weights_or_a_trained_version_of_no_run_are_foreign() {
        let own = LlmCallV2::example();
        assert!(own.served_by_own_run());
        let other = LlmCallV2 {
            served_run_id: Some(RunId::new("run-other").unwrap()),
            ..own.clone()
        };
        assert!(!other.served_by_own_run());
        let base = LlmCallV2 {
            served_run_id: None,
            served_version: Some(0),
            ..own.clone()
        };
        assert!(base.served_by_own_run());
        let orphan = LlmCallV2 {
            served_version: Some(3),
            ..base
        };
        assert!(!orphan.served_by_own_run());
    }
}
