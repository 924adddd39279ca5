#!/usr/bin/env bash
# The engine benchmark on a GPU machine without Rust: the batching engine on the CUDA
# backend (arl-bench-engine, built by `make gpu-test-bundle` into .device/bin), decode at
# several batch sizes and prefill, then Hugging Face generate() with the same shapes and
# batch sizes on the same GPU, in this one run.
#
#   scripts/device-bench-engine.sh [ARGS...]    (extra arguments go to arl-bench-engine)
#
# SmolLM2 (--model smollm2, the default) needs its GGUF where scripts/device-gpu-tests.sh
# assembles it (/tmp/arl-models); --model qwen2.5-0.5b serves random weights.
# The table goes to stdout and, when $OUT is set, to $OUT/bench-engine.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=$(scripts/device-unpack.sh) || exit 2
export ARL_MODEL_DIR=${ARL_MODEL_DIR:-/tmp/arl-models}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
PYTHONUNBUFFERED=1 "$bin"/arl-bench-engine --device cuda --torch-python "${ARL_TORCH_PYTHON:-python3}" "$@" \
    2>&1 | tee "${OUT:-/tmp}/bench-engine.txt"
exit "${PIPESTATUS[0]}"
