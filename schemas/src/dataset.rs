//! A registered dataset: every task of a run's dataset with what the agent is told and
//! what grading needs, and the split. The dataset service writes it to the `ARL_DATASETS`
//! object store under its content digest; rollout, reward and evaluator read it from
//! there by the digest a task batch names. Like an event, a published version is never
//! edited.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::TaskId;
use crate::events::{EnvironmentRef, TaskKind};

/// One dataset row that failed validation: where it is and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct InvalidRow {
    pub file: String,
    /// 1-based line (JSONL), index (JSON array, Arrow, Parquet) or task folder name.
    pub row: String,
    pub field: String,
    pub reason: String,
}

impl std::fmt::Display for InvalidRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: field {}: {}",
            self.file, self.row, self.field, self.reason
        )
    }
}

/// How a task is graded. Hidden from the agent: only rollout, reward and evaluator read
/// the manifest, and the agent's sandbox never holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Grading {
    /// SWE-bench: apply `test_patch`, run the instance's tests, compare with the lists.
    Swebench {
        repo: String,
        base_commit: String,
        test_patch: String,
        fail_to_pass: Vec<String>,
        pass_to_pass: Vec<String>,
        /// The SWE-bench version of the instance (`3.1`): it selects the environment and
        /// test spec of the repository. Absent in manifests written before it was kept.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<String>,
    },
    /// Harbor: the task's hidden `tests/` files (path relative to `tests/`, content);
    /// `tests/test.sh` writes the reward.
    Harbor { tests: Vec<HarborFile> },
    /// Math: exact match of the final answer.
    Math { answer: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HarborFile {
    pub path: String,
    pub content: String,
}

/// One task: what the agent is told, where it runs, how it is graded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskRecord {
    pub task_id: TaskId,
    pub kind: TaskKind,
    pub environment: EnvironmentRef,
    /// The problem statement / instruction / question. For a task with `messages`, the
    /// last user message (for people and logs; the agent sends `messages`).
    pub instruction: String,
    pub grading: Grading,
    /// The prompt exactly as the dataset wrote it (VeRL's `prompt` column): the agent sends
    /// these messages as they are, with no prompt of its own. Absent for tasks whose agent
    /// builds the prompt from `instruction` (every manifest written before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<ChatMessage>>,
}

/// One message of a task's prompt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: ChatRole,
    pub content: String,
}

/// The roles of OpenAI's chat format that a dataset's prompt may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChatRole {
    System,
    User,
    Assistant,
    Tool,
}

impl ChatRole {
    pub const ALL: [ChatRole; 4] = [Self::System, Self::User, Self::Assistant, Self::Tool];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|role| role.as_str() == name)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DatasetManifestV1 {
    /// `sha256:<hex>` of the dataset's canonical content (its tasks, in order).
    pub digest: String,
    /// Where it was loaded from, for people.
    pub source: String,
    pub tasks: Vec<TaskRecord>,
    /// Task ids of the training split, in split order.
    pub train: Vec<TaskId>,
    /// Task ids of the validation split.
    pub validation: Vec<TaskId>,
    /// Rows that failed validation and were left out (only when the run allowed it).
    #[serde(default)]
    pub invalid_rows: Vec<InvalidRow>,
}

impl DatasetManifestV1 {
    pub fn task(&self, id: &TaskId) -> Option<&TaskRecord> {
        self.tasks.iter().find(|t| &t.task_id == id)
    }
}

/// The final answer of a GSM8K solution (`… #### 1,234` → `1234`).
pub fn final_answer(solution: &str) -> Option<String> {
    let (_, tail) = solution.rsplit_once("####")?;
    let number = tail.trim().replace([',', '$'], "");
    let valid = !number.is_empty()
        && number
            .trim_start_matches('-')
            .chars()
            .all(|c| c.is_ascii_digit() || c == '.')
        && number.chars().filter(|c| *c == '.').count() <= 1;
    valid.then(|| {
        number
            .strip_suffix(".0")
            .map(str::to_owned)
            .unwrap_or(number)
    })
}

/// How a math answer gave its final number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerForm {
    /// A number right after the first `####` (the form the prompt asks for).
    Marked,
    /// A `####` with no number right after it (e.g. the prompt's own `#### <number>`
    /// copied): no answer, whatever numbers follow.
    MarkedWithoutNumber,
    /// No `####`: the last number of the text.
    LastNumber,
    /// Neither a `####` nor any number.
    NoNumber,
}

impl AnswerForm {
    pub fn as_str(self) -> &'static str {
        match self {
            AnswerForm::Marked => "marked",
            AnswerForm::MarkedWithoutNumber => "marked_without_number",
            AnswerForm::LastNumber => "last_number",
            AnswerForm::NoNumber => "no_number",
        }
    }
}

/// The final number of a trial's answer to a math task, and how it was given: the number
/// right after the first `####` when there is one (lm-evaluation-harness's GSM8K
/// "strict-match": the answer the model commits to first, whatever it writes after), else
/// the last number in the text ("flexible-extract"). Only one number is read, so listing
/// guesses earns nothing.
pub fn final_number(candidate: &str) -> (AnswerForm, Option<String>) {
    match candidate.split_once("####") {
        Some((_, tail)) => {
            // Strict: the number must come first after the marker.
            let first = numbers(tail).into_iter().next().filter(|_| {
                tail.trim_start()
                    .starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '$')
            });
            match first {
                Some(n) => (AnswerForm::Marked, Some(n)),
                None => (AnswerForm::MarkedWithoutNumber, None),
            }
        }
        None => match numbers(candidate).pop() {
            Some(n) => (AnswerForm::LastNumber, Some(n)),
            None => (AnswerForm::NoNumber, None),
        },
    }
}

/// Whether a trial's answer to a math task matches the expected final answer
/// ([`final_number`]); equal strings or equal numbers match (`12.0` = `12`, `1,234` =
/// `1234`).
pub fn answer_matches(candidate: &str, expected: &str) -> bool {
    final_number(candidate)
        .1
        .is_some_and(|found| number_matches(&found, expected))
}

/// Whether a final number read by [`final_number`] is the expected answer: equal strings
/// or equal numbers.
pub fn number_matches(found: &str, expected: &str) -> bool {
    let found = found.strip_suffix(".0").unwrap_or(found);
    found == expected
        || matches!(
            (found.parse::<f64>(), expected.parse::<f64>()),
            (Ok(a), Ok(b)) if a == b
        )
}

/// The numbers of a text in order: an optional `-` or `$`, digits with `,` thousands
/// separators and at most one decimal point (a trailing `.` or `,` is punctuation).
fn numbers(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let negative =
            i > 0 && chars[i - 1] == '-' && (i < 2 || !chars[i - 2].is_ascii_alphanumeric());
        let mut number = String::from(if negative { "-" } else { "" });
        let mut seen_point = false;
        while i < chars.len() {
            let c = chars[i];
            let next_is_digit = chars.get(i + 1).is_some_and(char::is_ascii_digit);
            if c.is_ascii_digit() {
                number.push(c);
            } else if c == ',' && next_is_digit {
                // thousands separator: dropped
            } else if c == '.' && next_is_digit && !seen_point {
                seen_point = true;
                number.push(c);
            } else {
                break;
            }
            i += 1;
        }
        out.push(number);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Manifests written before `messages` existed read as tasks without them, and a task
    /// without them is written exactly as before (so its manifest's digest is unchanged).
    #[test]
    fn messages_are_optional_on_the_wire() {
        let before = serde_json::json!({
            "task_id": "math-1",
            "kind": "math",
            "environment": {"name": "math"},
            "instruction": "What is 5 + 7?",
            "grading": {"kind": "math", "answer": "12"}
        });
        let task: TaskRecord = serde_json::from_value(before.clone()).unwrap();
        assert_eq!(task.messages, None);
        assert_eq!(serde_json::to_value(&task).unwrap(), before);

        let mut with = task;
        with.messages = Some(vec![ChatMessage {
            role: ChatRole::User,
            content: "What is 5 + 7?".into(),
        }]);
        let written = serde_json::to_value(&with).unwrap();
        assert_eq!(
            written["messages"],
            serde_json::json!([{"role": "user", "content": "What is 5 + 7?"}])
        );
        assert_eq!(serde_json::from_value::<TaskRecord>(written).unwrap(), with);
    }

    #[test]
    fn answers_match_by_final_line_or_number() {
        assert!(answer_matches("so 5 + 7 = 12\n#### 12", "12"));
        assert!(answer_matches("12", "12"));
        assert!(answer_matches("The total is\n12.", "12"));
        // Strict: the number right after the first ####, whatever follows it.
        assert!(answer_matches(
            "8 + 20 = 28.\n#### 28\nThe answer is: 28",
            "28"
        ));
        assert!(answer_matches("#### $1,234.", "1234"));
        assert!(!answer_matches("#### 13\nno, 12", "12"));
        assert!(
            !answer_matches("#### 13\n#### 12", "12"),
            "the first #### counts"
        );
        assert!(!answer_matches("12 #### the answer", "12"));
        assert_eq!(
            final_number("so 12\n#### <number>\n12").0,
            AnswerForm::MarkedWithoutNumber,
            "the prompt's placeholder copied is no answer"
        );
        assert_eq!(
            final_number("#### $12"),
            (AnswerForm::Marked, Some("12".into()))
        );
        assert_eq!(
            final_number("it is 7, not 8"),
            (AnswerForm::LastNumber, Some("8".into()))
        );
        assert_eq!(final_number("no idea"), (AnswerForm::NoNumber, None));
        // Flexible: the last number of the text.
        assert!(answer_matches("3 + 2 = 5", "5"));
        assert!(answer_matches("She has 7 - 9 = -2 left.", "-2"));
        assert!(answer_matches("x-3 is 3", "3"));
        assert!(
            !answer_matches("5, 6, 7 or 8", "5"),
            "one guess only: the last"
        );
        assert!(answer_matches("It costs 0.5.", "0.5"));
        assert!(answer_matches("#### 1,234", "1234"));
        assert!(answer_matches("#### 12.0", "12"));
        assert!(answer_matches("#### 0.50", "0.5"));
        assert!(!answer_matches("#### 13", "12"));
        assert!(!answer_matches("twelve", "12"));
        assert!(!answer_matches("", "12"));
    }
}
