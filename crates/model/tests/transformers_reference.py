"""Reference models and log-probabilities from transformers (PyTorch, float32).

    python transformers_reference.py make OUT
        Saves tiny random models with save_pretrained, one folder per case under OUT, each
        with reference.json: {"tokens": [...], "logprobs": [...]} where logprobs[t] is
        log p(tokens[t+1] | tokens[..=t]). RoPE settings are given as transformers 5's
        `rope_parameters`, so config.json carries them nested.

    python transformers_reference.py logprobs DIR...
        Loads each folder with AutoModelForCausalLM (a checkpoint ARL wrote) and prints a
        JSON list of the same log-probabilities, one list per folder.

crates/model/tests/transformers.rs runs it with the python of `make vllm`; the fixtures are
cached under a folder keyed by this file's contents.
"""

import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

VOCAB = 97
TOKENS = [3, 17, 42, 5, 88, 9, 61, 23, 4, 70, 12, 35, 96, 1, 50, 27, 8, 44, 77, 19, 2, 66, 31, 58]

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
)

CASES = {
    "qwen2": lambda: Qwen2Config(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "llama-llama3": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama-linear": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "llama-yarn": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # head_dim 16 with 4 heads in a 32-wide model: q is 64 wide.
    "qwen3": lambda: Qwen3Config(
        **COMMON,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3-yarn": lambda: Qwen3Config(
        **COMMON,
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 8.0,
            "beta_slow": 2.0,
        },
    ),
}


def logprobs(model):
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[t, TOKENS[t + 1]].item() for t in range(len(TOKENS) - 1)]


def make(out):
    for seed, (name, config) in enumerate(CASES.items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config(), dtype=torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                # Large enough that every op matters; norms away from 1 (q/k norms too).
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                else:
                    p.copy_(0.2 * torch.randn_like(p))
        folder = os.path.join(out, name)
        model.save_pretrained(folder)
        with open(os.path.join(folder, "reference.json"), "w") as f:
            json.dump(
                {
                    "tokens": TOKENS,
                    "logprobs": logprobs(model),
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                },
                f,
            )


def main():
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "logprobs":
        results = []
        for folder in sys.argv[2:]:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            results.append(logprobs(model))
        print(json.dumps(results))
    else:
        sys.exit(f"unknown mode {sys.argv[1]!r}: make OUT | logprobs DIR...")


if __name__ == "__main__":
    main()
