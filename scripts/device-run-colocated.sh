#!/usr/bin/env bash
# A whole training run through the real services in ONE `arl serve` process — controller,
# dataset, reward, rollout, evaluator, the proxy, the trainer and the engine — on a machine
# with a GPU and no Rust: the engine on the GPU (`--device cuda`) behind the unchanged proxy
# and rollout, and (with trainer.device = cuda) the trainer handing each version to the
# engine in device memory. Math tasks need no sandbox, so the sandbox service is left out.
#
#   scripts/device-run-colocated.sh ARL NATS_SERVER [SPEC] [--set KEY=VALUE]...
#
# ARL and NATS_SERVER are the binaries (xz-compressed ones are unpacked first); the
# model the spec names must be installed under $ARL_MODEL_DIR. ARL_ENGINE_DEVICE (cuda)
# and ARL_TRAINER_GPU (0, or none) choose the devices; ARL_CONCURRENCY (64) is both the
# rollout's trials at once and the engine's batch; ARL_RUN_TIMEOUT_S (480) bounds the
# run. The run's status, the engine's metrics and the log lines about versions go to
# stdout and, when $OUT is set, to $OUT/run-colocated.txt, with the run's state
# (status.json), its reward curve (reward-curve.svg) and the whole log (serve.log.xz).
set -uo pipefail
cd "$(dirname "$0")/.."
arl=$1 nats=$2
shift 2
spec=examples/arithmetic.toml
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then spec=$1; shift; fi
state=$(mktemp -d -t arl-colocated-XXXXXX)
unpack() {
    case "$1" in
        *.xz) xz -dc "$1" > "$state/$2" && chmod +x "$state/$2" && echo "$state/$2" ;;
        *) echo "$1" ;;
    esac
}
arl=$(unpack "$arl" arl) nats=$(unpack "$nats" nats-server)
report=${OUT:-$state}/run-colocated.txt
exec > >(tee "$report") 2>&1
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
nats_port=$(port) engine=$(port) proxy=$(port)
"$nats" -js -a 127.0.0.1 -p "$nats_port" -sd "$state/jetstream" > "$state/nats.log" 2>&1 &
nats_pid=$! serve_pid=
# arl serve first (its drain still talks to NATS), then nats-server; each is given 30 s.
stop() {
    local pid=$1 name=$2 waited=0
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid"
    while kill -0 "$pid" 2>/dev/null && [ $waited -lt 300 ]; do sleep 0.1; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
        echo "$name did not stop within 30 s of SIGTERM: killed"; kill -9 "$pid"
    else
        echo "$name stopped $((waited / 10)).$((waited % 10)) s after SIGTERM"
    fi
}
trap 'stop "$serve_pid" "arl serve"; stop "$nats_pid" nats-server' EXIT
export NATS_URL=nats://127.0.0.1:$nats_port RUST_LOG=${RUST_LOG:-info}
device=${ARL_ENGINE_DEVICE:-cuda}
model=$(python3 - "$spec" <<'PY'
import re, sys
try:
    import tomllib
    print(tomllib.load(open(sys.argv[1], "rb")).get("model", {}).get("path", "smollm2-135m-instruct"))
except ModuleNotFoundError:  # Python before 3.11
    found = re.search(r'^\[model\][^\[]*?^path\s*=\s*"([^"]+)"', open(sys.argv[1]).read(), re.M | re.S)
    print(found.group(1) if found else "smollm2-135m-instruct")
PY
)
engine_args=(--device "$device" --model "$model" --listen "127.0.0.1:$engine" --weights-dir "$state/runs"
             --max-batch "${ARL_CONCURRENCY:-64}")
[ "$device" = cuda ] && engine_args+=(--kv-cache-memory 4)
started=$(date +%s)
"$arl" serve controller --tensorboard-dir "$state/tensorboard" \
    + dataset + reward + rollout --concurrency "${ARL_CONCURRENCY:-64}" + evaluator \
    + proxy --backend "arl=http://127.0.0.1:$engine" --listen "127.0.0.1:$proxy" \
    + trainer --runs-dir "$state/runs" --gpu "${ARL_TRAINER_GPU:-0}" \
    + inference "${engine_args[@]}" > "$state/serve.log" 2>&1 &
serve_pid=$!
ready() { python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; }
for _ in $(seq 600); do
    ready "http://127.0.0.1:$engine/v1/models" && ready "http://127.0.0.1:$proxy/health" && break
    kill -0 "$serve_pid" 2>/dev/null || { echo "arl serve exited:"; tail -40 "$state/serve.log"; exit 1; }
    sleep 0.2
done
echo "arl serve ready in $(( $(date +%s) - started )) s (engine --device $device, trainer --gpu ${ARL_TRAINER_GPU:-0})"
run=$("$arl" run submit "$spec" "$@") || { tail -40 "$state/serve.log"; exit 1; }
echo "run $run submitted: $spec $*"
status=0
"$arl" run watch "$run" --timeout-s "${ARL_RUN_TIMEOUT_S:-480}" || status=$?
echo
"$arl" run status "$run" || true
echo "took $(( $(date +%s) - started )) s in all"
if [ -n "${OUT:-}" ]; then
    "$arl" run status "$run" --json > "$OUT/status.json" || true
    "$arl" run plot "$run" --out "$OUT/reward-curve.svg" || true
fi
echo "--- steps and versions (serve.log)"
grep -E "handed over|serving new weights|weights swapped in|step trained" "$state/serve.log" | cut -c1-400 | tail -${ARL_LOG_LINES:-30}
if grep -q "math answer" "$state/serve.log"; then
    # With RUST_LOG=info,arl_reward::grader=debug the reward service logs each math
    # answer's form: per evaluation and per training step, how many kept the asked-for
    # `#### N`, and how many of those were right.
    echo "--- answers by form (reward service, debug log): v = validation, s = training"
    python3 - "$state/serve.log" <<'PY'
import collections, re, sys
forms = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r'trial=run-[0-9a-f]+-([vs])(\d+)-t\d+-k\d+.*math answer.*form="?(\w+)"? resolved=(\w+)', line)
    if m:
        forms[(m.group(1), int(m.group(2)))][(m.group(3), m.group(4))] += 1
for (kind, step), counts in sorted(forms.items()):
    total = sum(counts.values())
    by_form = collections.Counter()
    for (form, resolved), n in counts.items():
        by_form[form] += n
    right = {form: sum(n for (f, r), n in counts.items() if f == form and r == "true") for form in by_form}
    print(f"{kind}{step}: {total} answers; " + ", ".join(
        f"{form} {n} ({right[form]} right)" for form, n in sorted(by_form.items())))
PY
fi
echo "--- the engine's metrics"
python3 - "http://127.0.0.1:$engine/metrics" <<'PY' || true
import sys, urllib.request
for line in urllib.request.urlopen(sys.argv[1]).read().decode().splitlines():
    if line.startswith(("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total",
                        "arl_engine_")) and not line.startswith("#"):
        print(line)
PY
if [ "$status" -ne 0 ]; then echo "--- serve.log tail"; tail -60 "$state/serve.log"; fi
[ -n "${OUT:-}" ] && xz -3 < "$state/serve.log" > "$OUT/serve.log.xz"
exit "$status"
