//! The grade of one trial's patch.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{example_run, example_task, example_time, example_trial};
use crate::events::{Example, event};
use crate::{RunId, TaskId, TrialId};

/// How the reward was made up; the parts add to `reward`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RewardBreakdown {
    pub pass: f64,
    pub short_patch_bonus: f64,
    pub fast_bonus: f64,
}

/// Names of tests that passed and failed in one set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TestSetOutcome {
    pub passed: Vec<String>,
    pub failed: Vec<String>,
}

/// SWE-bench's view of a graded patch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TestReport {
    pub fail_to_pass: TestSetOutcome,
    pub pass_to_pass: TestSetOutcome,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RewardScoredV1 {
    pub run_id: RunId,
    pub trial_id: TrialId,
    pub task_id: TaskId,
    pub attempt: u32,
    pub reward: f64,
    pub breakdown: RewardBreakdown,
    pub resolved: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tests: Option<TestReport>,
    pub grading_seconds: f64,
    pub at: DateTime<Utc>,
}
event!(RewardScoredV1, reward, "scored", 1, |e| format!(
    "reward.scored:{}:{}",
    e.trial_id, e.attempt
));

impl Example for RewardScoredV1 {
    fn example() -> Self {
        Self {
            run_id: example_run(),
            trial_id: example_trial(),
            task_id: example_task(),
            attempt: 0,
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
            at: example_time(),
        }
    }
}
