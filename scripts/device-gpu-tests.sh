#!/usr/bin/env bash
# Runs the GPU tests on a machine with an NVIDIA GPU and no Rust toolchain: the test
# binaries `make gpu-test-bundle` built, stripped and compressed into .device/bin,
# nats-server, and SmolLM2's GGUF (sent in parts over several calls, .device/smol.part*,
# kept and assembled under /tmp/arl-models).
#
#   scripts/device-gpu-tests.sh [TEST_FILTER]
#
# Every GPU test runs with ARL_REQUIRE_GPU=1, so a missing or broken GPU fails instead of
# skipping. Output goes to stdout and, when $OUT is set, to $OUT/gpu-tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
models=/tmp/arl-models
mkdir -p "$models"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# Parts may arrive over several calls: keep each one seen, assemble once all are there.
for part in .device/smol.part*; do
    [ -f "$part" ] && cp -n "$part" "$models/"
done
if [ ! -f "$model" ] || [ "$(sha256sum "$model" | cut -c1-64)" != "$want" ]; then
    cat "$models"/smol.part* > "$model"
fi
if [ "$(sha256sum "$model" | cut -c1-64)" != "$want" ]; then
    echo "SmolLM2 parts incomplete ($(ls "$models")); send every .device/smol.part* first"
    exit 2
fi
bin=$(scripts/device-unpack.sh) || exit 2
export ARL_MODEL_DIR=$models ARL_NATS_SERVER=$bin/nats-server ARL_REQUIRE_GPU=1 RUST_BACKTRACE=1
log=${OUT:-/tmp}/gpu-tests.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
status=0
for test in "$bin"/test-*; do
    echo "== $test" | tee -a "$log"
    "$test" --test-threads=1 --nocapture ${1:+"$1"} 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
echo "gpu tests: exit $status" | tee -a "$log"
exit $status
