//! Valid inputs the fuzzers start from: mutations of a valid file reach deeper than
//! random bytes.

use arl_model::config::{Architecture, ModelConfig};

/// The model the safetensors target loads: one layer, 16 wide, 8 tokens.
pub fn tiny_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 8,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 128,
        tie_word_embeddings: true,
    }
}

/// The tiny model's parameters: Hugging Face name, (rows, cols).
fn parameters() -> Vec<(String, usize, usize)> {
    let (v, c, kv, i) = (8, 16, 8, 32);
    let mut p = vec![("model.embed_tokens.weight".to_owned(), v, c)];
    for (name, rows, cols) in [
        ("input_layernorm.weight", 1, c),
        ("self_attn.q_proj.weight", c, c),
        ("self_attn.k_proj.weight", kv, c),
        ("self_attn.v_proj.weight", kv, c),
        ("self_attn.o_proj.weight", c, c),
        ("post_attention_layernorm.weight", 1, c),
        ("mlp.gate_proj.weight", i, c),
        ("mlp.up_proj.weight", i, c),
        ("mlp.down_proj.weight", c, i),
    ] {
        p.push((format!("model.layers.0.{name}"), rows, cols));
    }
    p.push(("model.norm.weight".to_owned(), 1, c));
    p
}

/// A valid `model.safetensors` of [`tiny_config`] (f32, small values).
pub fn safetensors() -> Vec<Vec<u8>> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, rows, cols) in parameters() {
        let shape: Vec<usize> = if rows == 1 {
            vec![cols]
        } else {
            vec![rows, cols]
        };
        let start = data.len();
        for k in 0..rows * cols {
            data.extend(((k % 7) as f32 * 0.01).to_le_bytes());
        }
        header.insert(
            name,
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend(data);
    vec![file]
}

/// GGUF v3, written field by field.
#[derive(Default)]
struct Writer {
    bytes: Vec<u8>,
}

impl Writer {
    fn u32(&mut self, v: u32) {
        self.bytes.extend(v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.bytes.extend(v.to_le_bytes());
    }

    fn string(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes.extend(s.as_bytes());
    }

    fn key_string(&mut self, key: &str, value: &str) {
        self.string(key);
        self.u32(8);
        self.string(value);
    }

    fn key_u32(&mut self, key: &str, value: u32) {
        self.string(key);
        self.u32(4);
        self.u32(value);
    }

    fn key_f32(&mut self, key: &str, value: f32) {
        self.string(key);
        self.u32(6);
        self.bytes.extend(value.to_le_bytes());
    }

    fn key_strings(&mut self, key: &str, values: &[&str]) {
        self.string(key);
        self.u32(9);
        self.u32(8);
        self.u64(values.len() as u64);
        for v in values {
            self.string(v);
        }
    }
}

/// A valid GGUF of the tiny model: llama metadata, a byte-level BPE vocabulary, f32
/// tensors.
pub fn gguf() -> Vec<Vec<u8>> {
    let tokens = ["<s>", "</s>", "a", "b", "c", "ab", "Ġ", "Ċ"];
    let mut w = Writer::default();
    w.bytes.extend(b"GGUF");
    w.u32(3);
    let params = parameters();
    w.u64(params.len() as u64);
    w.u64(12);
    w.key_string("general.architecture", "llama");
    w.key_u32("general.alignment", 32);
    w.key_u32("llama.embedding_length", 16);
    w.key_u32("llama.feed_forward_length", 32);
    w.key_u32("llama.block_count", 1);
    w.key_u32("llama.attention.head_count", 2);
    w.key_u32("llama.attention.head_count_kv", 1);
    w.key_u32("llama.context_length", 128);
    // Required, as llama.cpp requires it (no default: it changes the math).
    w.key_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    w.key_string("tokenizer.ggml.model", "gpt2");
    w.key_strings("tokenizer.ggml.tokens", &tokens);
    w.key_strings("tokenizer.ggml.merges", &["a b"]);
    let mut offset = 0u64;
    for (name, rows, cols) in &params {
        let gguf = arl_model::weights::gguf_name(name).unwrap_or_else(|| name.clone());
        w.string(&gguf);
        if *rows == 1 {
            w.u32(1);
            w.u64(*cols as u64);
        } else {
            w.u32(2);
            w.u64(*cols as u64);
            w.u64(*rows as u64);
        }
        w.u32(0); // f32
        w.u64(offset);
        offset += (rows * cols * 4) as u64;
    }
    while !w.bytes.len().is_multiple_of(32) {
        w.bytes.push(0);
    }
    for (_, rows, cols) in &params {
        for k in 0..rows * cols {
            w.bytes.extend(((k % 5) as f32 * 0.02).to_le_bytes());
        }
    }
    vec![w.bytes]
}

const SPECS: [&str; 3] = [
    include_str!("../../../examples/arithmetic.toml"),
    include_str!("../../../examples/smoke.toml"),
    include_str!("../../../examples/swebench-mini.toml"),
];

pub fn run_spec_toml() -> Vec<Vec<u8>> {
    SPECS.iter().map(|s| s.as_bytes().to_vec()).collect()
}

pub fn run_spec_json() -> Vec<Vec<u8>> {
    SPECS
        .iter()
        .filter_map(|s| arl_schemas::spec::RunSpec::from_toml(s).ok())
        .filter_map(|spec| serde_json::to_vec(&spec).ok())
        .collect()
}

pub fn proxy_request() -> Vec<Vec<u8>> {
    [
        r#"{"model":"policy","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"2+2?"}],"temperature":0.7,"max_tokens":64}"#,
        r#"{"model":"policy","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"bash","parameters":{"type":"object"}}}],"stream":true}"#,
        r#"{"model":"policy","prompt":"1+1=","max_tokens":4,"logprobs":1}"#,
        r#"{"model":"policy","prompt_token_ids":[1,2,3],"max_tokens":2,"n":1}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

/// Dataset files, each behind the format byte [`crate::dataset`] reads.
pub fn dataset() -> Vec<Vec<u8>> {
    let jsonl = concat!(
        r#"{"id":"m1","question":"What is 2 + 3?","answer":"2 + 3 = 5\n#### 5"}"#,
        "\n",
        "{\"question\":\"Half of 1,000?\",\"answer\":\"#### 500\"}",
        "\n",
        r#"{"instance_id":"o__r-1","repo":"o/r","base_commit":"0123456789abcdef0123456789abcdef01234567","problem_statement":"fix","version":"1.0","patch":"diff","test_patch":"diff","FAIL_TO_PASS":"[\"t::a\"]","PASS_TO_PASS":"[]"}"#,
        "\n"
    );
    let json = format!("[{}]", jsonl.trim_end().replace('\n', ","));
    let verl_jsonl = concat!(
        r#"{"data_source":"openai/gsm8k","prompt":[{"content":"What is 2 + 3?","role":"user"}],"ability":"math","reward_model":{"ground_truth":"5","style":"rule"},"extra_info":{"answer":"2 + 3 = 5","index":0,"question":"What is 2 + 3?","split":"train"}}"#,
        "\n"
    );
    // VeRL's GSM8K as its preprocessing writes it: lists of structs, structs, a null
    // inside a list.
    let mut rows =
        arl_testkit::verl::VerlRow::gsm8k_split("train", &arl_testkit::verl::GSM8K_TRAIN[..2]);
    rows[1].prompt.insert(0, ("system".into(), None));
    let verl_parquet = arl_testkit::verl::verl_parquet(&rows).unwrap_or_default();
    vec![
        [&[0u8][..], jsonl.as_bytes()].concat(),
        [&[1u8][..], json.as_bytes()].concat(),
        [&[2u8][..], b"PAR1\0\0\0\0PAR1"].concat(),
        [&[3u8][..], b"ARROW1\0\0"].concat(),
        [&[0u8][..], verl_jsonl.as_bytes()].concat(),
        [&[2u8][..], &verl_parquet].concat(),
    ]
}
