"""Greedy continuations, per-token log-probabilities and timings from llama.cpp (PyPI
xllamacpp) for token-id prompts: the reference the model core is checked and benchmarked
against.

usage: llamacpp_reference.py MODEL.gguf MAX_TOKENS THREADS < prompts.json > answers.json
prompts.json: [[token ids], ...]; answers: [{"tokens", "logprobs", "timings"}, ...]
"""
import json
import os
import sys

import xllamacpp as xlc


def main() -> None:
    model, max_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prompts = json.load(sys.stdin)
    params = xlc.CommonParams()
    params.model.path = model
    params.n_ctx = 4096
    params.n_batch = 2048
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.sampling.temp = 0
    params.warmup = True
    server = xlc.Server(params)
    answers = []
    for prompt in prompts:
        result = server.handle_completions(
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "cache_prompt": False,
                "ignore_eos": True,
            }
        )
        content = result["choices"][0]["logprobs"]["content"]
        answers.append(
            {
                "tokens": [c["id"] for c in content],
                "logprobs": [c["logprob"] for c in content],
                "timings": result.get("timings", {}),
            }
        )
    sys.stdout.write(json.dumps(answers))
    sys.stdout.flush()
    # The embedded server's threads do not stop on their own.
    os._exit(0)


if __name__ == "__main__":
    main()
