#!/usr/bin/env bash
# Builds the GPU test binaries and the training and engine benchmarks here (no CUDA needed: cudarc loads
# it at run time) and puts them, stripped and xz-compressed (~15 MB in all, so that one device
# call carries them with the first part of SmolLM2), with nats-server into .device/bin —
# scripts/device-gpu-tests.sh and scripts/device-bench-train.sh unpack and run them there;
# the README has the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device/bin
rm -rf "$out" && mkdir -p "$out"
# name=package:test target
tests=(model-cuda=arl-model:cuda trainer-learning=arl-trainer:learning trainer-service=arl-trainer:service
       inference-gpu=arl-inference:gpu)
args=()
for t in "${tests[@]}"; do
    spec=${t#*=}
    args+=(-p "${spec%%:*}" --test "${spec#*:}")
done
cargo test --no-run --message-format=json "${args[@]}" > /tmp/arl-gpu-bundle.json
for t in "${tests[@]}"; do
    name=${t%%=*} spec=${t#*=}
    exe=$(python3 - "${spec%%:*}" "${spec#*:}" /tmp/arl-gpu-bundle.json <<'EOF'
import json, sys
package, target, messages = sys.argv[1], sys.argv[2], sys.argv[3]
for line in open(messages):
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["target"]["name"] == target and f"#{package}@" in m["package_id"]):
        print(m["executable"])
EOF
)
    [ -n "$exe" ] || { echo "no executable for $spec"; exit 1; }
    strip -o "$out/test-$name" "$exe"
    xz -T0 -6 "$out/test-$name"
done
cargo build --release --quiet -p arl-trainer --bin arl-bench-train -p arl-inference --bin arl-bench-engine
for bench in arl-bench-train arl-bench-engine; do
    strip -o "$out/$bench" "${CARGO_TARGET_DIR:-target}/release/$bench"
    xz -T0 -6 "$out/$bench"
done
xz -T0 -6 -c "${ARL_NATS_SERVER:-$HOME/.cache/arl/tools/bin/nats-server}" > "$out/nats-server.xz"
du -sh "$out"/*
