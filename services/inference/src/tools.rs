//! Tool calls in the models' native format, to and from OpenAI's `tool_calls`.
//!
//! Qwen2.5 writes each call as `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`;
//! SmolLM2's function-calling format is a JSON list inside one tag:
//! `<tool_call>[{"name": …, "arguments": {…}}]</tool_call>`. Both are parsed. Text that
//! opens a tool call but does not parse is returned as content, never repaired.

use serde_json::{Value, json};

pub const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON string (OpenAI's form).
    pub arguments: String,
}

/// What a completion held.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed {
    /// No tool call: all content.
    Text(String),
    /// Content before the first call, and the calls.
    Calls(String, Vec<ToolCall>),
    /// Opened a tool call that does not parse; the reason.
    Malformed(String),
}

pub fn parse(text: &str) -> Parsed {
    let Some(start) = text.find(OPEN) else {
        return Parsed::Text(text.to_owned());
    };
    let content = text[..start].trim_end().to_owned();
    let mut calls = Vec::new();
    let mut rest = &text[start..];
    while let Some(body_start) = rest.strip_prefix(OPEN) {
        let (body, after) = match body_start.find(CLOSE) {
            Some(end) => (&body_start[..end], &body_start[end + CLOSE.len()..]),
            // A stop token may end the completion right before the closing tag.
            None => (body_start, ""),
        };
        let value: Value = match serde_json::from_str(body.trim()) {
            Ok(value) => value,
            Err(e) => return Parsed::Malformed(format!("tool call is not JSON: {e}")),
        };
        let items = match value {
            Value::Array(items) => items,
            other => vec![other],
        };
        for item in items {
            match call_from(&item) {
                Some(call) => calls.push(call),
                None => {
                    return Parsed::Malformed(
                        "tool call needs a string \"name\" and object \"arguments\"".into(),
                    );
                }
            }
        }
        rest = after.trim_start();
        if !rest.is_empty() && !rest.starts_with(OPEN) {
            return Parsed::Malformed("text after a tool call".into());
        }
    }
    Parsed::Calls(content, calls)
}

fn call_from(item: &Value) -> Option<ToolCall> {
    let name = item.get("name")?.as_str()?.to_owned();
    let arguments = match item.get("arguments") {
        None => "{}".to_owned(),
        Some(Value::Object(map)) => Value::Object(map.clone()).to_string(),
        // Some models write the arguments already as a JSON string.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => {
            s.clone()
        }
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// Where in `text` a tool call may be starting: the first `<tool_call>`, or a suffix that
/// could still grow into one. Streaming holds text from there back until it is decided.
pub fn hold_from(text: &str) -> Option<usize> {
    if let Some(i) = text.find(OPEN) {
        return Some(i);
    }
    (1..OPEN.len())
        .rev()
        .find(|&k| {
            text.len() >= k
                && text.is_char_boundary(text.len() - k)
                && OPEN.starts_with(&text[text.len() - k..])
        })
        .map(|k| text.len() - k)
}

/// A system prompt that teaches the call format to a model whose chat template has no
/// notion of tools (SmolLM2's function-calling prompt, in substance).
pub fn system_prompt(tools: &[Value]) -> String {
    let functions: Vec<&Value> = tools
        .iter()
        .map(|t| t.get("function").unwrap_or(t))
        .collect();
    format!(
        "You are an expert in composing functions. You are given a question and a set of possible functions. \
Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \
If none of the functions can be used, point it out and refuse to answer.\n\n\
You have access to the following tools:\n<tools>{}</tools>\n\n\
The output MUST strictly adhere to the following format, and NO other text MUST be included.\n\
<tool_call>[\n{{\"name\": \"func_name1\", \"arguments\": {{\"argument1\": \"value1\"}}}},\n... (more tool calls as required)\n]</tool_call>",
        json!(functions)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_calls_parse_into_openai_form() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let Parsed::Calls(content, calls) = parse(text) else {
            panic!("{:?}", parse(text))
        };
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
    }

    #[test]
    fn smollm2_list_format_and_missing_close_tag_parse() {
        let text = "<tool_call>[{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
        let Parsed::Calls(content, calls) = parse(text) else {
            panic!()
        };
        assert_eq!((content.as_str(), calls.len()), ("", 2));
        assert_eq!(calls[1].name, "b");
    }

    #[test]
    fn malformed_calls_are_reported_not_guessed() {
        for text in [
            "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": }</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"a\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": \"a\"}</tool_call> and more words",
        ] {
            assert!(matches!(parse(text), Parsed::Malformed(_)), "{text}");
        }
        assert_eq!(parse("plain answer"), Parsed::Text("plain answer".into()));
    }

    #[test]
    fn streaming_holds_back_a_possible_call() {
        assert_eq!(hold_from("hello <tool"), Some(6));
        assert_eq!(hold_from("hello <tool_call>{"), Some(6));
        assert_eq!(hold_from("hello"), None);
        assert_eq!(hold_from("a < b"), None);
        assert_eq!(hold_from("é<"), Some(2));
    }
}
