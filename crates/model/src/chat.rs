//! Chat templates (Jinja, from `tokenizer_config.json` or GGUF `tokenizer.chat_template`)
//! rendered the way Hugging Face's `apply_chat_template` does: Python string methods,
//! `raise_exception`, and `tojson` with Python's `json.dumps` spacing — so a rendered
//! prompt, and therefore its token ids, matches the reference byte for byte.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    #[error("rendering the chat template failed: {0}")]
    Render(String),
    /// A template file or tokenizer_config.json entry that cannot be used.
    #[error("{path}: {reason}")]
    Source { path: String, reason: String },
}

/// A Hugging Face folder's chat template source, chosen as transformers 5 chooses it:
/// `chat_template.jinja` and `additional_chat_templates/<name>.jinja` files, when there
/// are any, replace the templates of `tokenizer_config.json`; there, `chat_template` is
/// a string or a list of `{name, template}`. Of several named templates, "default" is
/// the one used (what `apply_chat_template` picks without a name or tools); several
/// without a "default" are an error, as they are in transformers. None: no template.
pub fn hf_template_source(
    dir: &std::path::Path,
    tokenizer_config: &serde_json::Value,
) -> Result<Option<String>, ChatError> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).map_err(|e| ChatError::Source {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    };
    let mut files: Vec<(String, std::path::PathBuf)> = Vec::new();
    let single = dir.join("chat_template.jinja");
    if single.is_file() {
        files.push(("default".into(), single));
    }
    if let Ok(entries) = std::fs::read_dir(dir.join("additional_chat_templates")) {
        for entry in entries.flatten() {
            let path = entry.path();
            if let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jinja"))
            {
                files.push((name.to_owned(), path.clone()));
            }
        }
    }
    let pick = |names: Vec<String>, origin: &str| ChatError::Source {
        path: origin.to_owned(),
        reason: format!(
            "several chat templates ({}) and none named \"default\"",
            names.join(", ")
        ),
    };
    if !files.is_empty() {
        return match files.iter().find(|(name, _)| name == "default") {
            Some((_, path)) => read(path).map(Some),
            None => Err(pick(
                files.into_iter().map(|(n, _)| n).collect(),
                &dir.join("additional_chat_templates").display().to_string(),
            )),
        };
    }
    let origin = dir.join("tokenizer_config.json").display().to_string();
    match &tokenizer_config["chat_template"] {
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Array(list) => {
            let mut names = Vec::new();
            for entry in list {
                let (Some(name), Some(template)) =
                    (entry["name"].as_str(), entry["template"].as_str())
                else {
                    return Err(ChatError::Source {
                        path: origin,
                        reason: format!(
                            "chat_template list entry {entry} is not {{\"name\": …, \"template\": …}}"
                        ),
                    });
                };
                if name == "default" {
                    return Ok(Some(template.to_owned()));
                }
                names.push(name.to_owned());
            }
            if names.is_empty() {
                Ok(None)
            } else {
                Err(pick(names, &origin))
            }
        }
        serde_json::Value::Null => Ok(None),
        other => Err(ChatError::Source {
            path: origin,
            reason: format!("chat_template is {other}, expected a string or a list"),
        }),
    }
}

#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// One message as in OpenAI's API (`content` may be null for tool-call turns).
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| -> String {
            // Templates use it for "Today Date"; a fixed date keeps prompts reproducible.
            format
                .replace("%d", "26")
                .replace("%b", "Jul")
                .replace("%Y", "2024")
                .replace("%B", "July")
        });
        env.add_filter("tojson", python_tojson);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| ChatError::Compile(e.to_string()))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Render(e.to_string()))?;
        let context = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        template
            .render(context)
            .map_err(|e| ChatError::Render(format!("{e:#}")))
    }
}

/// `tojson` as Hugging Face defines it: `json.dumps(x, ensure_ascii=False)` (with
/// `indent` when given), i.e. `", "` and `": "` separators.
fn python_tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_python_json(
    value: &serde_json::Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_like_hugging_face() {
        let template = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let text = template
            .render(
                &[
                    ChatMessage::new("system", "Be brief."),
                    ChatMessage::new("user", "Hi"),
                ],
                None,
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tojson_uses_python_spacing_and_keeps_unicode() {
        let template = ChatTemplate::new("{{ x | tojson }}", "", "").unwrap();
        let env = &template.env;
        let out = env
            .render_str(
                "{{ x | tojson }}",
                minijinja::context! { x => serde_json::json!({"a": [1, "é"], "b": {}}) },
            )
            .unwrap();
        assert_eq!(out, r#"{"a": [1, "é"], "b": {}}"#);
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let template = ChatTemplate::new(
            "{% if messages[0]['content'].startswith(' x') %}{{ messages[0]['content'].strip() }}{% else %}{{ raise_exception('bad role') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            template
                .render(&[ChatMessage::new("user", " x ")], None, false)
                .unwrap(),
            "x"
        );
        let err = template
            .render(&[ChatMessage::new("user", "y")], None, false)
            .unwrap_err();
        assert!(err.to_string().contains("bad role"), "{err}");
    }
}

#[cfg(test)]
mod template_source_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn a_chat_template_jinja_file_wins_over_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), "FILE").unwrap();
        let config = serde_json::json!({"chat_template": "CONFIG"});
        assert_eq!(
            hf_template_source(dir.path(), &config).unwrap().as_deref(),
            Some("FILE")
        );
    }

    #[test]
    fn a_list_of_named_templates_gives_the_default_one() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT"},
        ]});
        assert_eq!(
            hf_template_source(dir.path(), &config).unwrap().as_deref(),
            Some("DEFAULT")
        );
        let config = serde_json::json!({"chat_template": [{"name": "rag", "template": "R"}]});
        let e = hf_template_source(dir.path(), &config)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rag") && e.contains("\"default\""), "{e}");
        assert_eq!(
            hf_template_source(dir.path(), &serde_json::json!({})).unwrap(),
            None
        );
    }

    #[test]
    fn additional_template_files_are_read_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let extra = dir.path().join("additional_chat_templates");
        std::fs::create_dir(&extra).unwrap();
        std::fs::write(extra.join("default.jinja"), "EXTRA DEFAULT").unwrap();
        std::fs::write(extra.join("tool_use.jinja"), "TOOLS").unwrap();
        assert_eq!(
            hf_template_source(dir.path(), &serde_json::json!({"chat_template": "C"}))
                .unwrap()
                .as_deref(),
            Some("EXTRA DEFAULT")
        );
    }
}
