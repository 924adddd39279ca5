//! The built-in agents. `swe` speaks OpenAI tool calling (run a shell command, view a
//! file, edit it by exact string replacement, submit); `swe-text` is the same loop for
//! models without tool calling — one fenced shell block per turn, `submit` to finish (the
//! way mini-swe-agent's text mode works). Math tasks get one question and one answer, or
//! with `mcp-tools` the tools of MCP servers until they answer.
//! Every LLM call goes through the token proxy; every command runs in the trial's sandbox.

use std::time::{Duration, Instant};

use arl_runtime::text::head_and_tail as truncate;
use arl_sandbox_client::Lease;
use arl_schemas::dataset::ChatMessage;
use arl_schemas::events::{AgentExit, FailureClass};
use arl_schemas::rpc::ExecRequest;
use serde_json::{Value, json};
use tracing::Instrument;

use crate::llm::{LlmClient, Sampling, TrialError};
use crate::mcp::McpSession;

/// How the agent loop ended, and what it produced.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentOutcome {
    pub exit: AgentExit,
    pub turns: u32,
    /// Replies that broke the action protocol (no block, a malformed tool call).
    pub parse_failures: u32,
    /// Math: the answer text (code tasks' output is the sandbox's diff).
    pub answer: Option<String>,
    /// Tool calls made through MCP (the `mcp-tools` agent).
    pub tool_calls: u32,
}

/// What an agent needs to run one trial.
pub struct AgentContext<'a> {
    pub llm: &'a LlmClient,
    pub base_url: &'a str,
    pub instruction: &'a str,
    /// The task's own prompt (VeRL's rows), sent as written in place of the agent's.
    pub messages: Option<&'a [ChatMessage]>,
    pub sampling: Sampling,
    pub max_turns: u32,
    pub max_observation_chars: usize,
    pub deadline: Instant,
}

const TEXT_SYSTEM: &str = "You are a careful software engineer working in a repository. \
Each turn, write one short thought and then exactly one shell command in a fenced block:\n\
```bash\n<command>\n```\n\
The command runs in the repository's root and you will see its output. Inspect the code, \
make the change the task asks for, and check it. When you are done, reply with a block \
that holds only the word submit.";

const TOOL_SYSTEM: &str = "You are a careful software engineer working in a repository. \
Use the tools to inspect the code, make the change the task asks for, and check it. Call \
submit when you are done.";

const MATH_TOOLS_SYSTEM: &str = "You are a math assistant with a Python tool. First call the \
run_code tool with a short program that prints the answer. After you see its output, reply \
with the final answer on a last line `#### <number>`.";

/// After the output of a call written as text (a user message, ours to word): without it
/// a small model repeats the call it just made.
const TEXT_CALL_FOLLOW_UP: &str = "If this answers the question, reply with the final answer \
on a last line `#### <number>`; otherwise call a tool again.";

const MATH_SYSTEM: &str = "Solve the problem step by step. End your answer with a line \
`#### <number>` holding only the final number.";

/// The tool definitions of the `swe` agent.
pub fn tools() -> Value {
    let function = |name: &str, description: &str, properties: Value, required: &[&str]| {
        json!({"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required}}})
    };
    json!([
        function(
            "run_shell",
            "Run a shell command in the repository's root; returns its exit code and output.",
            json!({"command": {"type": "string"}}),
            &["command"]
        ),
        function(
            "view_file",
            "Show a file with line numbers.",
            json!({"path": {"type": "string"}}),
            &["path"]
        ),
        function(
            "edit_file",
            "Replace the one occurrence of old_text in the file with new_text.",
            json!({"path": {"type": "string"}, "old_text": {"type": "string"}, "new_text": {"type": "string"}}),
            &["path", "old_text", "new_text"]
        ),
        function("submit", "Finish the task.", json!({}), &[]),
    ])
}

fn user(text: String) -> Value {
    json!({"role": "user", "content": text})
}

/// Whether the agent goes on after a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Turn {
    Continue,
    Submitted,
}

/// A turn's span: its LLM call and the commands it runs are its children.
fn turn_span(turn: u32) -> tracing::Span {
    tracing::info_span!("agent_turn", turn, otel.name = "agent turn")
}

/// The `swe-text` loop.
pub async fn run_text(ctx: &AgentContext<'_>, lease: &Lease) -> Result<AgentOutcome, TrialError> {
    let mut messages = vec![
        json!({"role": "system", "content": TEXT_SYSTEM}),
        user(ctx.instruction.to_owned()),
    ];
    let mut outcome = AgentOutcome {
        exit: AgentExit::TurnLimit,
        turns: 0,
        parse_failures: 0,
        answer: None,
        tool_calls: 0,
    };
    while outcome.turns < ctx.max_turns {
        let span = turn_span(outcome.turns);
        let turn = text_turn(ctx, lease, &mut messages, &mut outcome)
            .instrument(span)
            .await?;
        if turn == Turn::Submitted {
            outcome.exit = AgentExit::Submitted;
            break;
        }
    }
    Ok(outcome)
}

async fn text_turn(
    ctx: &AgentContext<'_>,
    lease: &Lease,
    messages: &mut Vec<Value>,
    outcome: &mut AgentOutcome,
) -> Result<Turn, TrialError> {
    let answer = ctx
        .llm
        .chat(ctx.base_url, messages, None, &ctx.sampling, ctx.deadline)
        .await?;
    outcome.turns += 1;
    let text = answer.message["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    messages.push(json!({"role": "assistant", "content": text}));
    let observation = match shell_block(&text) {
        None => {
            outcome.parse_failures += 1;
            "Your reply had no command. Reply with exactly one ```bash block, or a block \
             holding only submit."
                .to_owned()
        }
        Some(command) if command.trim() == "submit" => return Ok(Turn::Submitted),
        Some(command) => run_shell(ctx, lease, &command).await?,
    };
    messages.push(user(observation));
    Ok(Turn::Continue)
}

/// The `swe` (tool-calling) loop.
pub async fn run_tools(ctx: &AgentContext<'_>, lease: &Lease) -> Result<AgentOutcome, TrialError> {
    let tools = tools();
    let mut messages = vec![
        json!({"role": "system", "content": TOOL_SYSTEM}),
        user(ctx.instruction.to_owned()),
    ];
    let mut outcome = AgentOutcome {
        exit: AgentExit::TurnLimit,
        turns: 0,
        parse_failures: 0,
        answer: None,
        tool_calls: 0,
    };
    while outcome.turns < ctx.max_turns {
        let span = turn_span(outcome.turns);
        let turn = tool_turn(ctx, lease, &tools, &mut messages, &mut outcome)
            .instrument(span)
            .await?;
        if turn == Turn::Submitted {
            outcome.exit = AgentExit::Submitted;
            break;
        }
    }
    Ok(outcome)
}

async fn tool_turn(
    ctx: &AgentContext<'_>,
    lease: &Lease,
    tools: &Value,
    messages: &mut Vec<Value>,
    outcome: &mut AgentOutcome,
) -> Result<Turn, TrialError> {
    let answer = ctx
        .llm
        .chat(
            ctx.base_url,
            messages,
            Some(tools),
            &ctx.sampling,
            ctx.deadline,
        )
        .await?;
    outcome.turns += 1;
    let calls = answer.message["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut assistant = json!({"role": "assistant", "content": answer.message["content"].clone()});
    if !calls.is_empty() {
        assistant["tool_calls"] = Value::Array(calls.clone());
    }
    messages.push(assistant);
    if calls.is_empty() {
        outcome.parse_failures += 1;
        messages.push(user(
            "Use the tools (run_shell, view_file, edit_file); call submit when you are done."
                .into(),
        ));
        return Ok(Turn::Continue);
    }
    for call in &calls {
        let name = call["function"]["name"].as_str().unwrap_or_default();
        if name == "submit" {
            return Ok(Turn::Submitted);
        }
        let arguments: Value = call["function"]["arguments"]
            .as_str()
            .and_then(|a| serde_json::from_str(a).ok())
            .unwrap_or(Value::Null);
        let result = match tool(ctx, lease, name, &arguments).await? {
            Some(result) => result,
            None => {
                outcome.parse_failures += 1;
                format!("unknown tool {name:?} or bad arguments {arguments}")
            }
        };
        messages
            .push(json!({"role": "tool", "tool_call_id": call["id"].clone(), "content": result}));
    }
    Ok(Turn::Continue)
}

/// Where an agent inside the sandbox sends its calls. A sandbox whose proxy URL is on its
/// own loopback relays to the proxy that serves this machine: the key goes in that URL's
/// path. Otherwise the sandbox reaches proxies over the network (a cluster), and the
/// calls go to the replica that issued the key (`key_url`, its own address): trial keys
/// live in the replica that issued them, so a Service spreading calls over replicas
/// would lose them.
fn agent_base_url(sandbox_proxy: &str, key_url: &str, trial_key: &str) -> String {
    let relayed = ["http://127.0.0.1:", "http://localhost:", "http://[::1]:"]
        .iter()
        .any(|loopback| sandbox_proxy.starts_with(loopback));
    if relayed {
        format!("{}/{trial_key}/v1", sandbox_proxy.trim_end_matches("/v1"))
    } else {
        key_url.to_owned()
    }
}

/// The command agent: mini-swe-agent, unchanged, inside the sandbox, its LLM calls going
/// to the token proxy through the sandbox's relay with the trial's key.
pub async fn run_mini_swe_agent(
    ctx: &AgentContext<'_>,
    lease: &Lease,
    trial_key: &str,
) -> Result<AgentOutcome, TrialError> {
    let Some(proxy) = &lease.grant.proxy_url else {
        return Err(TrialError::new(
            FailureClass::Infrastructure,
            "the sandbox has no relay to the token proxy: start arl-sandbox with --proxy-socket",
        ));
    };
    let left = ctx.deadline.saturating_duration_since(Instant::now());
    let env = [
        (
            "OPENAI_BASE_URL",
            agent_base_url(proxy, ctx.base_url, trial_key),
        ),
        ("OPENAI_API_KEY", trial_key.to_owned()),
        ("AGENT_TASK", ctx.instruction.to_owned()),
        ("AGENT_STEP_LIMIT", ctx.max_turns.to_string()),
        ("AGENT_MAX_TOKENS", ctx.sampling.max_tokens.to_string()),
        ("AGENT_TEMPERATURE", ctx.sampling.temperature.to_string()),
    ];
    let result = lease
        .exec(&ExecRequest {
            command: format!("{MINI_SWE_AGENT_PYTHON} -"),
            timeout_s: left.as_secs_f64().clamp(1.0, 3600.0),
            env: env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            stdin: Some(MINI_SWE_AGENT_RUNNER.to_owned()),
        })
        .await
        .map_err(TrialError::from_sandbox)?;
    if result.timed_out {
        return Err(TrialError::new(
            FailureClass::Timeout,
            "mini-swe-agent ran past the trial's budget",
        ));
    }
    if result.exit_code == 127 && result.stderr.contains(MINI_SWE_AGENT_PYTHON) {
        // A deployment problem, not the agent's fault.
        return Err(TrialError::new(
            FailureClass::Infrastructure,
            "the sandbox has no agents venv at /opt/arl-agents: start arl-sandbox with \
             --agents-dir (arl up --agents-dir), a venv with mini-swe-agent built on the \
             system Python",
        ));
    }
    let summary: Option<Value> = result
        .stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok());
    let Some(summary) = summary.filter(|_| result.exit_code == 0) else {
        return Err(TrialError::new(
            FailureClass::AgentError,
            format!(
                "mini-swe-agent exited with {}: {}",
                result.exit_code,
                truncate(&result.stderr, 2000)
            ),
        ));
    };
    let status = summary["exit_status"].as_str().unwrap_or_default();
    Ok(AgentOutcome {
        exit: match status {
            "Submitted" => AgentExit::Submitted,
            s if s.contains("Limit") => AgentExit::TurnLimit,
            _ => AgentExit::NoAction,
        },
        turns: summary["steps"].as_u64().map_or(0, |n| n as u32),
        parse_failures: 0,
        answer: None,
        tool_calls: 0,
    })
}

/// The interpreter of the agents venv mounted in every sandbox (`arl-sandbox --agents-dir`).
pub const MINI_SWE_AGENT_PYTHON: &str = "/opt/arl-agents/bin/python";
const MINI_SWE_AGENT_RUNNER: &str = include_str!("mini_swe_agent.py");

/// One question, one answer.
pub async fn run_math(ctx: &AgentContext<'_>) -> Result<AgentOutcome, TrialError> {
    let messages = math_prompt(ctx.instruction, ctx.messages);
    let answer = ctx
        .llm
        .chat(ctx.base_url, &messages, None, &ctx.sampling, ctx.deadline)
        .instrument(turn_span(0))
        .await?;
    Ok(AgentOutcome {
        exit: AgentExit::Submitted,
        turns: 1,
        parse_failures: 0,
        tool_calls: 0,
        answer: Some(
            answer.message["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        ),
    })
}

/// The `mcp-tools` loop (math tasks): the tools of every MCP server, offered to the model
/// as OpenAI tools; each tool call is made through MCP and its output goes back as a
/// `tool` message (masked in the trajectory: the proxy recorded only what the model
/// generated). It ends at a reply without a tool call — the final answer, which the
/// reward service grades — or at `max_turns`. A checking tool's verdict is only feedback:
/// the reward is never the tools' to decide.
pub async fn run_mcp_tools(
    ctx: &AgentContext<'_>,
    servers: &[String],
) -> Result<AgentOutcome, TrialError> {
    let mut sessions = Vec::with_capacity(servers.len());
    let mut owner: std::collections::HashMap<String, usize> = Default::default();
    let mut offered = Vec::new();
    for url in servers {
        let mut session = McpSession::open(url).await?;
        for tool in session.list_tools().await? {
            if owner.contains_key(&tool.name) {
                return Err(TrialError::new(
                    FailureClass::Infrastructure,
                    format!(
                        "two MCP servers of rollout.mcp_servers offer a tool named {:?}: a \
                         model could not tell them apart",
                        tool.name
                    ),
                ));
            }
            owner.insert(tool.name.clone(), sessions.len());
            offered.push(json!({"type": "function", "function": {
                "name": tool.name, "description": tool.description,
                "parameters": tool.input_schema}}));
        }
        sessions.push(session);
    }
    let tools = Value::Array(offered);
    let mut messages = math_prompt(ctx.instruction, ctx.messages);
    if ctx.messages.is_none() {
        messages[0] = json!({"role": "system", "content": MATH_TOOLS_SYSTEM});
    }
    let mut outcome = AgentOutcome {
        exit: AgentExit::TurnLimit,
        turns: 0,
        parse_failures: 0,
        answer: None,
        tool_calls: 0,
    };
    let ran = async {
        while outcome.turns < ctx.max_turns {
            let answer = ctx
                .llm
                .chat(
                    ctx.base_url,
                    &messages,
                    Some(&tools),
                    &ctx.sampling,
                    ctx.deadline,
                )
                .instrument(turn_span(outcome.turns))
                .await?;
            outcome.turns += 1;
            let calls = answer.message["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let content = answer.message["content"].as_str().unwrap_or_default();
            if calls.is_empty() {
                let Some((name, arguments)) = text_tool_call(content) else {
                    outcome.exit = AgentExit::Submitted;
                    outcome.answer = Some(content.to_owned());
                    break;
                };
                // A call written as text: answered as text, so that the conversation
                // the model sees next is exactly what it wrote.
                messages.push(json!({"role": "assistant", "content": content}));
                let result = call_mcp_tool(
                    ctx,
                    &mut sessions,
                    &owner,
                    &name,
                    Some(arguments),
                    &mut outcome,
                )
                .await?;
                messages.push(user(format!(
                    "{name} returned:\n{result}\n{TEXT_CALL_FOLLOW_UP}"
                )));
                continue;
            }
            messages.push(json!({"role": "assistant", "content": content, "tool_calls": calls}));
            for call in &calls {
                let name = call["function"]["name"].as_str().unwrap_or_default();
                let arguments: Option<Value> = call["function"]["arguments"]
                    .as_str()
                    .and_then(|a| serde_json::from_str(a).ok())
                    .filter(Value::is_object);
                let result =
                    call_mcp_tool(ctx, &mut sessions, &owner, name, arguments, &mut outcome)
                        .await?;
                messages.push(
                    json!({"role": "tool", "tool_call_id": call["id"].clone(), "content": result}),
                );
            }
        }
        Ok::<_, TrialError>(())
    }
    .await;
    for session in sessions {
        session.close().await;
    }
    ran.map(|()| outcome)
}

/// One tool call of the `mcp-tools` agent, on the server that offers `name`: its output
/// (cut to the observation budget), or what was wrong with the call (a parse failure).
async fn call_mcp_tool(
    ctx: &AgentContext<'_>,
    sessions: &mut [McpSession],
    owner: &std::collections::HashMap<String, usize>,
    name: &str,
    arguments: Option<Value>,
    outcome: &mut AgentOutcome,
) -> Result<String, TrialError> {
    match (owner.get(name), arguments) {
        (Some(&server), Some(arguments)) => {
            outcome.tool_calls += 1;
            let output = sessions[server].call_tool(name, &arguments).await?;
            Ok(truncate(&output.text, ctx.max_observation_chars))
        }
        (None, _) => {
            outcome.parse_failures += 1;
            Ok(no_such_tool(name, owner))
        }
        (Some(_), None) => {
            outcome.parse_failures += 1;
            Ok(format!("the arguments of {name} must be a JSON object"))
        }
    }
}

fn no_such_tool(name: &str, tools: &std::collections::HashMap<String, usize>) -> String {
    let mut names: Vec<&str> = tools.keys().map(String::as_str).collect();
    names.sort_unstable();
    format!(
        "there is no tool {name:?}; the tools are {}",
        names.join(", ")
    )
}

/// A tool call a model wrote as its whole reply in text rather than in its chat
/// template's tool-call syntax: one JSON object of exactly `name` and `arguments` (an
/// object), bare or in one fenced block — as Qwen2.5-Coder-0.5B writes them. Line breaks
/// inside its strings are read as `\n` (small models write code that way). Anything else
/// is not a call.
fn text_tool_call(content: &str) -> Option<(String, Value)> {
    let mut text = content.trim();
    if let Some(fenced) = text.strip_prefix("```") {
        let body = fenced.strip_suffix("```")?;
        let body = body.strip_prefix("json").unwrap_or(body);
        if body.contains("```") {
            return None;
        }
        text = body.trim();
    }
    if !text.starts_with('{') {
        return None;
    }
    let value: Value = serde_json::from_str(&escape_raw_line_breaks(text)).ok()?;
    let object = value.as_object()?;
    let (name, arguments) = (object.get("name")?.as_str()?, object.get("arguments")?);
    if object.len() != 2 || !arguments.is_object() {
        return None;
    }
    Some((name.to_owned(), arguments.clone()))
}

/// Line breaks and tabs inside JSON strings, escaped (outside strings they are whitespace).
fn escape_raw_line_breaks(text: &str) -> String {
    let (mut out, mut in_string, mut escaped) = (String::with_capacity(text.len()), false, false);
    for c in text.chars() {
        match c {
            '\n' if in_string => out.push_str("\\n"),
            '\r' if in_string => out.push_str("\\r"),
            '\t' if in_string => out.push_str("\\t"),
            _ => out.push(c),
        }
        if in_string && escaped {
            escaped = false;
        } else if in_string && c == '\\' {
            escaped = true;
        } else if c == '"' {
            in_string = !in_string;
        }
    }
    out
}

/// A math task's prompt: the task's own messages exactly as the dataset wrote them (they
/// carry their instruction, e.g. VeRL's "output the final answer after ####", and a prompt
/// of ours beside it would change what the policy is trained on), else our instruction and
/// the question.
fn math_prompt(instruction: &str, messages: Option<&[ChatMessage]>) -> Vec<Value> {
    match messages {
        Some(messages) => messages
            .iter()
            .map(|m| json!({"role": m.role.as_str(), "content": m.content}))
            .collect(),
        None => vec![
            json!({"role": "system", "content": MATH_SYSTEM}),
            user(instruction.to_owned()),
        ],
    }
}

async fn tool(
    ctx: &AgentContext<'_>,
    lease: &Lease,
    name: &str,
    arguments: &Value,
) -> Result<Option<String>, TrialError> {
    let text = |field: &str| arguments[field].as_str().map(str::to_owned);
    Ok(match name {
        "run_shell" => match text("command") {
            Some(command) => Some(run_shell(ctx, lease, &command).await?),
            None => None,
        },
        "view_file" => match text("path") {
            Some(path) => Some(match lease.read(&path).await {
                Ok(content) => truncate(
                    &content
                        .lines()
                        .enumerate()
                        .map(|(i, l)| format!("{:>5}  {l}\n", i + 1))
                        .collect::<String>(),
                    ctx.max_observation_chars,
                ),
                Err(err) => format!("cannot read {path}: {err}"),
            }),
            None => None,
        },
        "edit_file" => match (text("path"), text("old_text"), text("new_text")) {
            (Some(path), Some(old), Some(new)) => Some(edit(lease, &path, &old, &new).await),
            _ => None,
        },
        _ => None,
    })
}

/// Exact string replacement: exactly one occurrence, or the agent is told why not.
async fn edit(lease: &Lease, path: &str, old: &str, new: &str) -> String {
    let content = match lease.read(path).await {
        Ok(content) => content,
        Err(err) => return format!("cannot read {path}: {err}"),
    };
    match content.matches(old).count() {
        0 => format!("old_text does not occur in {path}; nothing changed"),
        1 => match lease.write(path, &content.replacen(old, new, 1)).await {
            Ok(()) => format!("edited {path}"),
            Err(err) => format!("cannot write {path}: {err}"),
        },
        n => format!("old_text occurs {n} times in {path}; give more context so it is unique"),
    }
}

async fn run_shell(
    ctx: &AgentContext<'_>,
    lease: &Lease,
    command: &str,
) -> Result<String, TrialError> {
    let left = ctx.deadline.saturating_duration_since(Instant::now());
    if left < Duration::from_secs(1) {
        return Err(TrialError::new(
            FailureClass::Timeout,
            "the trial's budget ran out",
        ));
    }
    let result = lease
        .exec(&ExecRequest {
            command: command.to_owned(),
            timeout_s: left.as_secs_f64().min(120.0),
            env: Default::default(),
            stdin: None,
        })
        .await
        .map_err(TrialError::from_sandbox)?;
    let mut output = result.stdout;
    output.push_str(&result.stderr);
    let status = if result.timed_out {
        "the command timed out".to_owned()
    } else {
        format!("exit code {}", result.exit_code)
    };
    Ok(format!(
        "{status}\n{}",
        truncate(&output, ctx.max_observation_chars)
    ))
}

/// The first fenced code block's body (```bash, ```sh or plain ```).
pub fn shell_block(text: &str) -> Option<String> {
    let start = text.find("```")?;
    let rest = &text[start + 3..];
    let body_start = rest.find('\n')? + 1;
    let header = rest[..body_start].trim();
    if !(header.is_empty() || header == "bash" || header == "sh" || header == "shell") {
        return None;
    }
    let body = &rest[body_start..];
    let end = body.find("```")?;
    let command = body[..end].trim();
    (!command.is_empty()).then(|| command.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_use_the_relay_on_one_machine_and_the_issuing_replica_in_a_cluster() {
        assert_eq!(
            agent_base_url(
                "http://127.0.0.1:8000/v1",
                "http://10.0.0.5:8000/tk-1/v1",
                "tk-1"
            ),
            "http://127.0.0.1:8000/tk-1/v1"
        );
        assert_eq!(
            agent_base_url(
                "http://arl-proxy.arl.svc:8000/v1",
                "http://10.0.0.5:8000/tk-1/v1",
                "tk-1"
            ),
            "http://10.0.0.5:8000/tk-1/v1"
        );
    }

    #[test]
    fn a_tool_call_written_as_text_is_read_and_nothing_else_is() {
        let fenced = "```json\n{\n  \"name\": \"run_code\",\n  \"arguments\": {\"code\": \"x = 2\nprint(x * 21)\"}\n}\n```";
        assert_eq!(
            text_tool_call(fenced),
            Some(("run_code".into(), json!({"code": "x = 2\nprint(x * 21)"})))
        );
        assert_eq!(
            text_tool_call(r#" {"name": "calc", "arguments": {}} "#),
            Some(("calc".into(), json!({})))
        );
        for not_a_call in [
            "The answer is 42.\n#### 42",
            r#"{"name": "run_code"}"#,
            r#"{"name": "run_code", "arguments": "print(1)"}"#,
            r#"{"name": "run_code", "arguments": {}, "id": 1}"#,
            "Let me compute.\n```json\n{\"name\": \"run_code\", \"arguments\": {}}\n```",
            "```json\n{\"name\": \"a\", \"arguments\": {}}\n```\n```json\n{}\n```",
        ] {
            assert_eq!(text_tool_call(not_a_call), None, "{not_a_call}");
        }
    }

    #[test]
    fn a_math_task_with_messages_sends_them_as_written() {
        use arl_schemas::dataset::ChatRole;
        let question = "Natalia sold clips to 48 of her friends in April, and then she sold half \
                        as many clips in May. How many clips did Natalia sell altogether? Let's \
                        think step by step and output the final answer after \"####\".";
        let messages = [
            ChatMessage {
                role: ChatRole::System,
                content: "You are a careful tutor.".into(),
            },
            ChatMessage {
                role: ChatRole::User,
                content: question.into(),
            },
        ];
        assert_eq!(
            math_prompt(question, Some(&messages)),
            [
                json!({"role": "system", "content": "You are a careful tutor."}),
                json!({"role": "user", "content": question}),
            ]
        );
        // Without them, ours: the system prompt asking for `#### <number>`, then the question.
        let ours = math_prompt("What is 5 + 7?", None);
        assert_eq!(ours.len(), 2);
        assert_eq!(ours[0]["content"], MATH_SYSTEM);
        assert_eq!(
            ours[1],
            json!({"role": "user", "content": "What is 5 + 7?"})
        );
    }

    #[test]
    fn shell_blocks_are_found_or_refused() {
        assert_eq!(
            shell_block("look:\n```bash\nls -la\n```\n").as_deref(),
            Some("ls -la")
        );
        assert_eq!(shell_block("```\nsubmit\n```").as_deref(), Some("submit"));
        assert_eq!(shell_block("```python\nprint(1)\n```"), None);
        assert_eq!(shell_block("no block"), None);
        assert_eq!(shell_block("```bash\n\n```"), None);
    }
}
