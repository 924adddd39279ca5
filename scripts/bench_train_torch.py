"""The GRPO step of `arl-bench-train` in PyTorch, eager and `torch.compile`, for the same-run
comparison on a GPU (the device machine has torch and transformers; nothing is downloaded).

Qwen2ForCausalLM from Qwen2.5-0.5B's config with random weights and sdpa attention; fp32
master weights under bf16 autocast, a bf16 copy as the reference model. Per step: old and
reference log-probabilities of the completion tokens without gradients, then the policy's
log-probabilities (logits of the completion only), PPO clip 0.2, k3 KL at 0.04, token mean,
grad-norm clip 1.0 and fused AdamW. Prints one JSON line per mode:
{"mode", "logprobs_s", "train_s", "peak_bytes"} (medians of the timed steps; peak is
torch's max_memory_allocated over them).
"""

import argparse
import copy
import json
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


SHAPES = {  # hidden, intermediate, heads
    "qwen2.5-0.5b": (896, 4864, 14),
    "qwen2.5-1.5b": (1536, 8960, 12),
}


def config(model, layers):
    hidden, intermediate, heads = SHAPES[model]
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def completion_logprobs(model, ids, completion):
    """log p(token) of the last `completion` tokens of every row, in f32."""
    logits = model(input_ids=ids, logits_to_keep=completion + 1).logits[:, :-1].float()
    targets = ids[:, -completion:]
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def run(mode, args, ids, advantages):
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(config(args.model, args.layers)).cuda()
    reference = copy.deepcopy(policy).to(torch.bfloat16).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)
    if mode == "compile":
        policy = torch.compile(policy)
        reference = torch.compile(reference)
    completion = args.seq_len - args.prompt_len
    timings = []
    warmup = 2 if mode == "compile" else 1
    for step in range(warmup + args.steps):
        if step == warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            old = completion_logprobs(policy, ids, completion)
            ref = completion_logprobs(reference, ids, completion)
        torch.cuda.synchronize()
        middle = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp = completion_logprobs(policy, ids, completion)
        ratio = torch.exp(logp - old)
        a = advantages.unsqueeze(-1)
        pg = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        delta = ref - logp
        kl = torch.clamp(torch.exp(delta) - delta - 1, -10, 10)
        loss = (pg + 0.04 * kl).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        end = time.perf_counter()
        if step >= warmup:
            timings.append((middle - start, end - middle))
        print(f"{mode} step {step}: {middle - start:.3f} s + {end - middle:.3f} s", file=sys.stderr)
    row = {
        "mode": mode,
        "logprobs_s": statistics.median(t[0] for t in timings),
        "train_s": statistics.median(t[1] for t in timings),
        "peak_bytes": torch.cuda.max_memory_allocated(),
    }
    del policy, reference, optimizer
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default="eager,compile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train_torch.py: no CUDA device for torch")
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 151936, (args.sequences, args.seq_len), generator=generator).cuda()
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5][i % 4] for i in range(args.sequences)]).cuda()
    for mode in args.modes.split(","):
        print(json.dumps(run(mode, args, ids, advantages)), flush=True)


if __name__ == "__main__":
    main()
