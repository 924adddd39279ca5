"""Hugging Face `generate()` for `arl-bench-engine`'s same-run comparison on a GPU (the
device machine has torch and transformers; nothing is downloaded).

The model's shapes with random weights, bf16, eager with sdpa attention (transformers'
default; `torch.compile` with a static cache crashed in transformers 5.17 there), greedy,
exactly --new-tokens per sequence after --prompt-len random prompt tokens. Prints one JSON
line per batch size: {"batch", "tok_s", "ms_per_token"} (the best of two timed runs after a
warm-up; prefill included, a 32-token prompt's share is small).
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

from bench_train_torch import config as qwen25_config


def model(name):
    if name == "smollm2":
        config = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(config)
    # Qwen2.5's config as the training benchmark builds it, with the model's own depth.
    layers = {"qwen2.5-0.5b": 24, "qwen2.5-1.5b": 28}[name]
    return Qwen2ForCausalLM(qwen25_config(name, layers))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()

    torch.manual_seed(0)
    net = model(args.model).to(device="cuda", dtype=torch.bfloat16).eval()
    vocab = min(net.config.vocab_size, 49152)
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(0, vocab, (batch, args.prompt_len), device="cuda")
        mask = torch.ones_like(ids)

        def generate(new_tokens):
            with torch.no_grad():
                net.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            torch.cuda.synchronize()

        generate(4)  # warm-up
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            generate(args.new_tokens)
            best = min(best, time.perf_counter() - started)
        print(
            json.dumps(
                {
                    "batch": batch,
                    "tok_s": batch * args.new_tokens / best,
                    "ms_per_token": best / args.new_tokens * 1e3,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
