//! Crafted model files: each must be refused with an error — no panic, no abort (a stack
//! overflow is one), no giant allocation. A counting allocator watches the largest single
//! allocation each test's thread makes while a file is read.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// A global allocator is unsafe to implement; this one only forwards to the system's.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use arl_model::config::{Architecture, ModelConfig};
use arl_model::gguf::GgufFile;
use arl_model::load::LoadedModel;
use arl_model::weights::Weights;

/// Records the largest allocation asked for, per thread (tests run side by side).
struct Watch;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: allocations after the thread's locals are gone are not watched.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static WATCH: Watch = Watch;

/// No single allocation while reading a crafted file of a few bytes may pass this.
const ALLOCATION_LIMIT: usize = 64 << 20;

/// Runs `read` and checks it failed without a large allocation.
fn refused<T: std::fmt::Debug, E: std::fmt::Display>(
    case: &str,
    read: impl FnOnce() -> Result<T, E>,
) -> String {
    LARGEST.with(|l| l.set(0));
    let result = read();
    let largest = LARGEST.with(Cell::get);
    assert!(
        largest < ALLOCATION_LIMIT,
        "{case}: an allocation of {largest} bytes"
    );
    match result {
        Ok(value) => panic!("{case}: accepted as {value:?}"),
        Err(err) => err.to_string(),
    }
}

/// A GGUF v3 file written field by field.
#[derive(Default)]
struct Gguf {
    bytes: Vec<u8>,
}

impl Gguf {
    fn header(tensors: u64, kvs: u64) -> Self {
        let mut g = Self::default();
        g.bytes.extend(b"GGUF");
        g.u32(3).u64(tensors).u64(kvs);
        g
    }

    fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend(v.to_le_bytes());
        self
    }

    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend(v.to_le_bytes());
        self
    }

    fn string(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.bytes.extend(s.as_bytes());
        self
    }

    /// A key holding a u32 value.
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.string(key).u32(4).u32(v)
    }

    /// A tensor info: name, dims, ggml type, offset.
    fn tensor(&mut self, name: &str, dims: &[u64], kind: u32, offset: u64) -> &mut Self {
        self.string(name).u32(dims.len() as u32);
        for d in dims {
            self.u64(*d);
        }
        self.u32(kind).u64(offset)
    }

    fn parse(&self) -> Result<GgufFile, arl_model::gguf::GgufError> {
        GgufFile::parse(self.bytes.clone())
    }
}

#[test]
fn crafted_gguf_files_are_refused() {
    // Arrays of arrays, 100,000 deep.
    let mut nested = Gguf::header(0, 1);
    // The key's type is an array; each level is an array (item type, length 1) of the next.
    nested.string("deep").u32(9);
    for _ in 0..100_000 {
        nested.u32(9).u64(1);
    }
    let err = refused("nested arrays", || nested.parse());
    assert!(err.contains("nested"), "{err}");

    // An array claiming 2^60 items, with none there.
    let mut huge = Gguf::header(0, 1);
    huge.string("tokens").u32(9).u32(8).u64(1 << 60);
    refused("a huge array length", || huge.parse());
    // An array claiming u64::MAX u8 items.
    let mut huge = Gguf::header(0, 1);
    huge.string("bytes").u32(9).u32(0).u64(u64::MAX);
    refused("u64::MAX items", || huge.parse());
    // A string claiming u64::MAX bytes.
    let mut long = Gguf::header(0, 1);
    long.string("name").u32(8).u64(u64::MAX);
    refused("a huge string", || long.parse());
    // Counts of tensors and keys far beyond the file.
    refused("u64::MAX keys", || Gguf::header(0, u64::MAX).parse());
    refused("u64::MAX tensors", || Gguf::header(u64::MAX, 0).parse());

    // Dims whose product overflows u64.
    let mut dims = Gguf::header(1, 0);
    dims.tensor("t", &[1 << 32, 1 << 32, 16], 0, 0);
    let err = refused("overflowing dims", || dims.parse());
    assert!(err.contains("more elements"), "{err}");
    // Dims whose product fits u64 but whose f32 bytes do not.
    let mut bytes = Gguf::header(1, 0);
    bytes.tensor("t", &[1 << 31, 1 << 31, 2], 0, 0);
    refused("dims whose bytes overflow", || bytes.parse());
    // 2^40 dimensions.
    let mut many = Gguf::header(1, 0);
    many.string("t").u32(u32::MAX);
    refused("u32::MAX dimensions", || many.parse());
    // Data past the end of the file, and an offset that overflows.
    let mut past = Gguf::header(1, 0);
    past.tensor("t", &[8], 0, 4096);
    let err = refused("an offset past the file", || past.parse());
    assert!(err.contains("outside the file"), "{err}");
    let mut wrap = Gguf::header(1, 0);
    wrap.tensor("t", &[8], 0, u64::MAX - 2);
    refused("an offset that overflows", || wrap.parse());
    // Alignments that are no power of two, or absurd.
    for alignment in [0, 3, 1 << 31] {
        let mut aligned = Gguf::header(0, 1);
        aligned.kv_u32("general.alignment", alignment);
        let err = refused("a bad alignment", || aligned.parse());
        assert!(err.contains("alignment"), "{err}");
    }
    // A key given twice.
    let mut twice = Gguf::header(0, 2);
    twice.kv_u32("k", 1).kv_u32("k", 2);
    refused("a key given twice", || twice.parse());
    // An unknown value type and an unknown tensor type.
    let mut kind = Gguf::header(0, 1);
    kind.string("k").u32(99);
    refused("an unknown value type", || kind.parse());
    let mut tensor = Gguf::header(1, 0);
    tensor.tensor("t", &[8], 999, 0);
    refused("an unknown tensor type", || tensor.parse());
}

#[test]
fn every_truncation_of_a_real_header_is_an_error() {
    let mut file = Gguf::header(1, 2);
    file.kv_u32("general.alignment", 32)
        .string("general.name")
        .u32(8)
        .string("crafted")
        .tensor("t", &[4, 2], 0, 0);
    while !file.bytes.len().is_multiple_of(32) {
        file.bytes.push(0);
    }
    file.bytes.extend([0u8; 32]);
    let whole = file.parse().unwrap();
    assert_eq!(whole.tensor_f32("t").unwrap().len(), 8);
    for cut in 0..file.bytes.len() {
        let prefix = file.bytes[..cut].to_vec();
        refused(&format!("cut at {cut}"), || GgufFile::parse(prefix));
    }
}

/// A model whose sizes are absurd: the config is refused before anything is allocated.
#[test]
fn crafted_model_configs_are_refused() {
    let base = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 16,
        "hidden_act": "silu",
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": true
    });
    ModelConfig::from_hf_json(&base.to_string()).unwrap();
    for (field, value) in [
        ("num_hidden_layers", serde_json::json!(1u64 << 40)),
        ("vocab_size", serde_json::json!(u64::MAX)),
        ("hidden_size", serde_json::json!(0)),
        ("max_position_embeddings", serde_json::json!(1u64 << 50)),
        ("rms_norm_eps", serde_json::json!(-1.0)),
        ("num_attention_heads", serde_json::json!(3)),
    ] {
        let mut config = base.clone();
        config[field] = value;
        let text = config.to_string();
        refused(field, || ModelConfig::from_hf_json(&text));
    }
}

fn tiny_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 64,
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

fn safetensors(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    bytes
}

#[test]
fn crafted_safetensors_files_are_refused() {
    let config = tiny_config();
    let dir = tempfile::tempdir().unwrap();
    let load = |bytes: Vec<u8>| {
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        Weights::from_safetensors_dir(dir.path(), &config)
    };
    let embed = r#""model.embed_tokens.weight":{"dtype":"F32","shape":[64,16],"data_offsets":"#;
    for (case, bytes) in [
        ("a header length of u64::MAX", {
            let mut b = u64::MAX.to_le_bytes().to_vec();
            b.extend(b"{}");
            b
        }),
        ("a header that is not JSON", safetensors("{nope", &[])),
        (
            "offsets past the data",
            safetensors(&format!("{{{embed}[0,4096]}}}}"), &[0; 16]),
        ),
        (
            "offsets that overflow",
            safetensors(&format!("{{{embed}[18446744073709551615,4]}}}}"), &[0; 16]),
        ),
        (
            "a shape whose product overflows",
            safetensors(
                r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}}"#,
                &[0; 16],
            ),
        ),
        (
            "a shape other than the config's",
            safetensors(
                r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
                &[0; 16],
            ),
        ),
        ("an empty file", Vec::new()),
    ] {
        refused(case, || load(bytes));
    }

    // An index whose shards lie outside the folder.
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    for shard in ["/dev/zero", "../../etc/passwd", "sub/x.safetensors"] {
        let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": shard}});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let err = refused(shard, || Weights::from_safetensors_dir(dir.path(), &config));
        assert!(err.contains("beside the index"), "{err}");
    }
}

/// Whole files through the loader the services use: errors, never a panic.
#[test]
fn the_loader_refuses_crafted_files_with_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.gguf");
    for (case, bytes) in [
        ("not GGUF", b"GGML\0\0\0\0".to_vec()),
        ("version 99", {
            let mut g = Gguf::header(0, 0);
            g.bytes[4..8].copy_from_slice(&99u32.to_le_bytes());
            g.bytes
        }),
        ("no architecture", Gguf::header(0, 0).bytes),
    ] {
        std::fs::write(&file, bytes).unwrap();
        refused(case, || LoadedModel::open(&file).map(|m| m.source.clone()));
    }
    assert!(LoadedModel::open(Path::new("/no/such/model")).is_err());
}

/// GGUF metadata follows llama.cpp: a key it requires is required (the RMSNorm epsilon),
/// a key it defaults gets its default (rope.freq_base 10,000), and a RoPE scaling ARL
/// does not implement is refused by name.
#[test]
fn gguf_configs_default_only_what_llama_cpp_defaults() {
    let gguf = |eps: Option<f32>, scaling: Option<&str>| {
        let kvs = 7 + u64::from(eps.is_some()) + u64::from(scaling.is_some());
        let mut g = Gguf::header(0, kvs);
        g.string("general.architecture").u32(8).string("llama");
        for (key, v) in [
            ("llama.vocab_size", 64),
            ("llama.embedding_length", 16),
            ("llama.feed_forward_length", 32),
            ("llama.block_count", 1),
            ("llama.attention.head_count", 2),
            ("llama.context_length", 128),
        ] {
            g.kv_u32(key, v);
        }
        if let Some(eps) = eps {
            g.string("llama.attention.layer_norm_rms_epsilon")
                .u32(6)
                .bytes
                .extend(eps.to_le_bytes());
        }
        if let Some(kind) = scaling {
            g.string("llama.rope.scaling.type").u32(8).string(kind);
        }
        ModelConfig::from_gguf(&g.parse().unwrap())
    };
    let config = gguf(Some(1e-5), None).unwrap();
    assert_eq!(config.rope_theta, 10_000.0);
    assert_eq!(config.rope_scaling, None);
    let e = gguf(None, None).unwrap_err().to_string();
    assert!(e.contains("llama.attention.layer_norm_rms_epsilon"), "{e}");
    let e = gguf(Some(1e-5), Some("llama3")).unwrap_err().to_string();
    assert!(e.contains("llama.rope.scaling.factor"), "{e}");
    let e = gguf(Some(1e-5), Some("yarn")).unwrap_err().to_string();
    assert!(e.contains("rope.scaling.type") && e.contains("yarn"), "{e}");
}
