//! The OpenAI request fields ARL knows (OpenAI's, and the vLLM / SGLang extensions agents
//! and RL stacks send), one list for the proxy and ARL's engine:
//! - the proxy passes these on and refuses any other field (a typo must not be ignored);
//! - ARL's engine honours some of them, and refuses any other one unless its value asks
//!   nothing of an engine (its default: `frequency_penalty: 0`, `response_format` text,
//!   an empty `chat_template_kwargs`), rather than ignore what it cannot do.

use serde_json::Value;

/// The OpenAI endpoints the fields belong to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
}

/// The values of a field that ask nothing of an engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Inert {
    /// Every value but `null` asks something (the request itself, or sampling).
    Never,
    /// Any value: the field does not change what is generated (`metadata`, `store`).
    Always,
    /// `null` or this number.
    Number(f64),
    /// `null` or this boolean.
    Bool(bool),
    /// `null`, `{}` or `[]`.
    Empty,
    /// `null` or `{"type": "text"}` (`response_format`).
    TextFormat,
}

impl Inert {
    /// Whether `value` asks nothing of an engine.
    pub fn holds(self, value: &Value) -> bool {
        // `null` is how JSON clients leave a field at its default.
        if value.is_null() {
            return true;
        }
        match self {
            Inert::Never => false,
            Inert::Always => true,
            Inert::Number(n) => value.as_f64() == Some(n),
            Inert::Bool(b) => value.as_bool() == Some(b),
            Inert::Empty => match value {
                Value::Object(o) => o.is_empty(),
                Value::Array(a) => a.is_empty(),
                _ => false,
            },
            Inert::TextFormat => value.get("type").and_then(Value::as_str) == Some("text"),
        }
    }

    /// The default, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Inert::Never => "null",
            Inert::Always => "any value",
            Inert::Number(0.0) => "0 or null",
            Inert::Number(_) => "1 or null",
            Inert::Bool(true) => "true or null",
            Inert::Bool(false) => "false or null",
            Inert::Empty => "empty or null",
            Inert::TextFormat => "{\"type\": \"text\"} or null",
        }
    }
}

/// A request field ARL knows.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub chat: bool,
    pub completion: bool,
    pub inert: Inert,
}

const fn both(name: &'static str, inert: Inert) -> Field {
    Field {
        name,
        chat: true,
        completion: true,
        inert,
    }
}

const fn chat(name: &'static str, inert: Inert) -> Field {
    Field {
        name,
        chat: true,
        completion: false,
        inert,
    }
}

const fn completion(name: &'static str, inert: Inert) -> Field {
    Field {
        name,
        chat: false,
        completion: true,
        inert,
    }
}

/// Every field ARL knows.
pub const FIELDS: &[Field] = &[
    both("model", Inert::Always),
    both("stream", Inert::Bool(false)),
    both("stream_options", Inert::Always),
    both("n", Inert::Number(1.0)),
    both("temperature", Inert::Never),
    both("top_p", Inert::Number(1.0)),
    both("top_k", Inert::Never),
    both("min_p", Inert::Number(0.0)),
    both("max_tokens", Inert::Never),
    both("min_tokens", Inert::Number(0.0)),
    both("stop", Inert::Empty),
    both("stop_token_ids", Inert::Empty),
    both("seed", Inert::Never),
    both("logprobs", Inert::Never),
    both("user", Inert::Always),
    both("frequency_penalty", Inert::Number(0.0)),
    both("presence_penalty", Inert::Number(0.0)),
    both("repetition_penalty", Inert::Number(1.0)),
    both("logit_bias", Inert::Empty),
    both("ignore_eos", Inert::Bool(false)),
    both("skip_special_tokens", Inert::Bool(true)),
    both("prompt_token_ids", Inert::Never),
    // vLLM's: return the token ids (ARL's engine always does).
    both("return_token_ids", Inert::Always),
    chat("messages", Inert::Never),
    chat("tools", Inert::Empty),
    chat("tool_choice", Inert::Never),
    chat("parallel_tool_calls", Inert::Bool(true)),
    chat("top_logprobs", Inert::Number(0.0)),
    chat("max_completion_tokens", Inert::Never),
    chat("response_format", Inert::TextFormat),
    // Variables for the chat template (Qwen3's `enable_thinking`).
    chat("chat_template_kwargs", Inert::Empty),
    chat("reasoning_effort", Inert::Never),
    chat("metadata", Inert::Always),
    chat("store", Inert::Always),
    completion("prompt", Inert::Never),
    completion("echo", Inert::Bool(false)),
    completion("suffix", Inert::Empty),
    completion("best_of", Inert::Number(1.0)),
];

/// The field `name` of `endpoint`, when ARL knows it.
pub fn field(endpoint: Endpoint, name: &str) -> Option<&'static Field> {
    FIELDS.iter().find(|f| {
        f.name == name
            && match endpoint {
                Endpoint::Chat => f.chat,
                Endpoint::Completion => f.completion,
            }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_belong_to_their_endpoints() {
        assert!(field(Endpoint::Chat, "messages").is_some());
        assert!(field(Endpoint::Completion, "messages").is_none());
        assert!(field(Endpoint::Completion, "prompt").is_some());
        assert!(field(Endpoint::Chat, "chat_template_kwargs").is_some());
        assert!(
            field(Endpoint::Chat, "temprature").is_none(),
            "a typo is unknown"
        );
        let mut names: Vec<_> = FIELDS.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FIELDS.len(), "each field once");
    }

    #[test]
    fn defaults_ask_nothing_and_other_values_do() {
        let inert = |name: &str, value: Value| {
            let f = field(Endpoint::Chat, name)
                .or_else(|| field(Endpoint::Completion, name))
                .unwrap();
            f.inert.holds(&value)
        };
        assert!(inert("frequency_penalty", json!(0)) && inert("frequency_penalty", json!(0.0)));
        assert!(!inert("frequency_penalty", json!(0.5)));
        assert!(inert("response_format", json!({"type": "text"})));
        assert!(!inert("response_format", json!({"type": "json_object"})));
        assert!(inert("chat_template_kwargs", json!({})));
        assert!(!inert(
            "chat_template_kwargs",
            json!({"enable_thinking": false})
        ));
        assert!(
            inert("skip_special_tokens", json!(true))
                && !inert("skip_special_tokens", json!(false))
        );
        assert!(inert("logit_bias", Value::Null) && !inert("logit_bias", json!({"7": 5})));
        assert!(!inert("reasoning_effort", json!("low")) && inert("reasoning_effort", Value::Null));
        assert!(!inert("temperature", json!(0.7)) && !inert("messages", json!([])));
        assert!(inert("metadata", json!({"k": "v"})));
    }
}
