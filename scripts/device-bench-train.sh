#!/usr/bin/env bash
# The training benchmark on a GPU machine without Rust: one GRPO step of ARL's CUDA backend
# on Qwen2.5-0.5B shapes, then the same step in PyTorch eager and torch.compile, in this one
# run (arl-bench-train, built by `make gpu-test-bundle` into .device/bin).
#
#   scripts/device-bench-train.sh [ARGS...]    (extra arguments go to arl-bench-train)
#
# The table goes to stdout and, when $OUT is set, to $OUT/bench-train.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=$(scripts/device-unpack.sh) || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
PYTHONUNBUFFERED=1 "$bin"/arl-bench-train --device cuda --torch-python "${ARL_TORCH_PYTHON:-python3}" "$@" \
    2>&1 | tee "${OUT:-/tmp}/bench-train.txt"
exit "${PIPESTATUS[0]}"
