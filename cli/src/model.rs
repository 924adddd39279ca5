//! `arl model …`: open a model and look at it, generate, or score tokens.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use arl_model::chat::ChatMessage;
use arl_model::generate::{Sampling, generate};
use arl_model::load::{LoadedModel, open_model, open_tokenizer};
use arl_runtime::args::model_path_or_name;

use crate::cli::ModelCommand;
use crate::run::CliError;

pub fn execute(command: ModelCommand) -> Result<ExitCode, CliError> {
    match command {
        ModelCommand::Info { path } => info(&path),
        ModelCommand::Generate {
            path,
            prompt,
            chat,
            max_tokens,
            temperature,
            seed,
        } => {
            let sampling = Sampling {
                temperature,
                seed,
                ..Sampling::default()
            };
            generate_text(&path, &prompt, chat, max_tokens, &sampling)
        }
        ModelCommand::Logprobs { path, tokens } => logprobs(&path, &tokens),
    }
}

fn open(path: &str) -> Result<LoadedModel, CliError> {
    let resolved = model_path_or_name(path);
    LoadedModel::open(&resolved)
        .map_err(|err| CliError::Usage(format!("cannot open model {}: {err}", resolved.display())))
}

fn info(path: &str) -> Result<ExitCode, CliError> {
    let loaded = open(path)?;
    let c = &loaded.model.config;
    let json = serde_json::json!({
        "source": loaded.source,
        "format": loaded.format,
        "architecture": c.architecture.model_type(),
        "parameters": loaded.model.weights().parameter_count(),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "layers": c.num_hidden_layers,
        "attention_heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim(),
        "rope_theta": c.rope_theta,
        "rope_type": c.rope_scaling.as_ref().map_or("default", |s| s.rope_type()),
        "rope_attention_factor": c.rope_attention_factor(),
        "q_k_norm": c.architecture.qk_norm(),
        "rms_norm_eps": c.rms_norm_eps,
        "context_length": c.max_position_embeddings,
        "tied_embeddings": c.tie_word_embeddings,
        "tokenizer": {
            "vocab_size": loaded.tokenizer.vocab_size(),
            "bos": loaded.tokenizer.bos_id(),
            "eos": loaded.tokenizer.eos_id(),
            "stop_ids": loaded.tokenizer.stop_ids(),
        },
        "chat_template": loaded.chat_template_source.is_some(),
        "chat_template_supports_tools": loaded.chat_template_source.as_deref().is_some_and(|t| t.contains("tools")),
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&json).unwrap_or_default()
    );
    Ok(ExitCode::SUCCESS)
}

fn generate_text(
    path: &str,
    prompt: &str,
    chat: bool,
    max_tokens: usize,
    sampling: &Sampling,
) -> Result<ExitCode, CliError> {
    let loaded = open(path)?;
    let text = if chat {
        let template = loaded
            .chat_template
            .as_ref()
            .ok_or_else(|| CliError::Usage("the model has no chat template; drop --chat".into()))?;
        template
            .render(&[ChatMessage::new("user", prompt)], None, true)
            .map_err(|e| CliError::Usage(e.to_string()))?
    } else {
        prompt.to_owned()
    };
    let ids = loaded
        .tokenizer
        .encode(&text)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let (tokens, _) = generate(
        &loaded.model,
        &ids,
        max_tokens,
        loaded.tokenizer.stop_ids(),
        sampling,
    );
    let output = loaded
        .tokenizer
        .decode(&tokens, true)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    println!("{output}");
    Ok(ExitCode::SUCCESS)
}

fn logprobs(path: &str, tokens_file: &PathBuf) -> Result<ExitCode, CliError> {
    let shown = tokens_file.display().to_string();
    let text = if shown == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| CliError::Unreadable {
                path: shown.clone(),
                reason: e.to_string(),
            })?;
        text
    } else {
        std::fs::read_to_string(tokens_file).map_err(|e| CliError::Unreadable {
            path: shown.clone(),
            reason: e.to_string(),
        })?
    };
    let tokens: Vec<u32> = serde_json::from_str(&text).map_err(|e| {
        CliError::Usage(format!("{shown} must hold a JSON array of token ids: {e}"))
    })?;
    if tokens.len() < 2 {
        return Err(CliError::Usage(
            "give at least two token ids: the first has no prefix to be scored against".into(),
        ));
    }
    // The model alone: a folder without tokenizer files scores ids all the same; the
    // tokenizer, where there is one, only adds each token's text.
    let resolved = model_path_or_name(path);
    let model = open_model(&resolved).map_err(|err| {
        CliError::Usage(format!("cannot open model {}: {err}", resolved.display()))
    })?;
    let tokenizer = open_tokenizer(&resolved).ok();
    let vocab = model.config.vocab_size as u32;
    if let Some(bad) = tokens.iter().find(|t| **t >= vocab) {
        return Err(CliError::Usage(format!(
            "token id {bad} is outside the vocabulary (size {vocab})"
        )));
    }
    let (_, logprobs) = model.forward_train(&[&tokens]);
    let out: Vec<serde_json::Value> = tokens[1..]
        .iter()
        .zip(&logprobs[0])
        .map(|(t, lp)| match &tokenizer {
            Some(tokenizer) => serde_json::json!({"token": t, "text": tokenizer.decode(&[*t], false).unwrap_or_default(), "logprob": lp}),
            None => serde_json::json!({"token": t, "logprob": lp}),
        })
        .collect();
    println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    Ok(ExitCode::SUCCESS)
}
