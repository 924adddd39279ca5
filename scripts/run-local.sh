#!/usr/bin/env bash
# run-local.sh SPEC — what `make run` does: `arl up` (every service, a private
# nats-server unless NATS_URL is set), submit SPEC, follow it to the end with a progress
# bar, print the summary, write the reward curve, and stop everything on exit.
set -euo pipefail
spec="${1:-examples/arithmetic.toml}"
# Release binaries: the CPU engine and trainer are what the run's minutes buy.
bin="${CARGO_TARGET_DIR:?}/release"
state="${ARL_STATE_DIR:-$(mktemp -d -t arl-run-XXXXXX)}"
# The engine must serve the spec's own model: its version 0 is the base every first trial
# samples from (the spec's `[model] path`, default SmolLM2, unless ARL_MODEL says otherwise).
model="${ARL_MODEL:-$(python3 - "$spec" <<'PY'
import json, sys, tomllib
path = sys.argv[1]
with open(path, "rb") as f:
    spec = json.load(f) if path.endswith(".json") else tomllib.load(f)
print(spec.get("model", {}).get("path", "smollm2-135m-instruct"))
PY
)}"
up_args=(--state-dir "$state" --model "$model")
if [ -n "${ARL_SWEBENCH_RECIPES:-}" ]; then up_args+=(--swebench-recipes "$ARL_SWEBENCH_RECIPES"); fi
if [ -n "${ARL_TRACES:-}" ]; then up_args+=(--traces); fi
"$bin/arl" up "${up_args[@]}" &
up=$!
trap 'kill "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true' EXIT INT TERM
# arl up writes nats-url once every service is ready (it prints what it waits for).
until [ -s "$state/nats-url" ]; do kill -0 "$up" 2>/dev/null || exit 1; sleep 0.2; done
export NATS_URL="$(cat "$state/nats-url")"

started=$(date +%s)
run_id="$("$bin/arl" run submit "$spec")"
echo "run $run_id submitted; logs in $state/logs"
status=0
"$bin/arl" run watch "$run_id" --timeout-s "${ARL_RUN_TIMEOUT_S:-1800}" || status=$?
echo
"$bin/arl" run status "$run_id" || true
"$bin/arl" run status "$run_id" --json > "$state/status.json" || true
"$bin/arl" run plot "$run_id" --out "$state/reward-curve.svg" || true
echo "took $(( $(date +%s) - started )) s; reward curve: $state/reward-curve.svg; state: $state/status.json"
echo "training curves: tensorboard --logdir $state/tensorboard"
if [ -n "${ARL_TRACES:-}" ]; then
    # The trace UI goes down with arl up: keep both for browsing until Ctrl-C.
    echo "traces: $(cat "$state/traces-url") (Phoenix) — Ctrl-C to stop"
    wait "$up" || true
fi
exit "$status"
