//! The grade of one trial's output, version 2: it names the trial's whole slot (step,
//! split, sample), so the evaluator can tally validation trials and the rollout can join
//! a grade to its trajectory without another lookup. Version 1 carried only the task and
//! attempt; nothing ever published it, so there is nothing to upgrade.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::events::v1::{RewardBreakdown, TestReport, TestSetOutcome, TrialSlot};
use crate::events::{Example, Split, event};
use crate::{RunId, TaskId, TrialId};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RewardScoredV2 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub slot: TrialSlot,
    pub reward: f64,
    pub breakdown: RewardBreakdown,
    /// The tests pass (SWE-bench: FAIL_TO_PASS and PASS_TO_PASS all pass; Harbor: the
    /// test script's reward is positive; math: the final answer matches).
    pub resolved: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tests: Option<TestReport>,
    pub grading_seconds: f64,
    pub at: DateTime<Utc>,
}
event!(RewardScoredV2, reward, "scored", 2, |e| format!(
    "reward.scored:{}:{}",
    e.trial_id, e.slot.attempt
));

impl Example for RewardScoredV2 {
    fn example() -> Self {
        Self {
            run_id: crate::events::v1::example_run(),
            trial_id: crate::events::v1::example_trial(),
            slot: TrialSlot {
                task_id: TaskId::known("django__django-11880"),
                step: 1,
                split: Split::Train,
                sample_index: 2,
                attempt: 0,
            },
            reward: 1.1,
            breakdown: RewardBreakdown {
                pass: 1.0,
                short_patch_bonus: 0.1,
                fast_bonus: 0.0,
            },
            resolved: true,
            tests: Some(TestReport {
                fail_to_pass: TestSetOutcome {
                    passed: vec![
                        "test_missing_attr (model_fields.tests.GetFieldDisplayTests)".into(),
                    ],
                    failed: vec![],
                },
                pass_to_pass: TestSetOutcome {
                    passed: vec!["test_choices (model_fields.tests.GetFieldDisplayTests)".into()],
                    failed: vec![],
                },
            }),
            grading_seconds: 12.4,
            at: crate::events::v1::example_time(),
        }
    }
}
