#!/usr/bin/env bash
# run-local.sh SPEC — start a private nats-server and the ARL services built so far,
# submit SPEC, follow the run, and stop everything on exit.
#
# With NATS_URL set, the services use that server instead of starting one.
set -euo pipefail
spec="${1:-examples/smoke.toml}"
bin="${CARGO_TARGET_DIR:?}/debug"
work="$(mktemp -d -t arl-run-XXXXXX)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT INT TERM

if [ -z "${NATS_URL:-}" ]; then
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    "${ARL_NATS_SERVER:?}" -js -a 127.0.0.1 -p "$port" -sd "$work/jetstream" 2>"$work/nats.log" &
    pids+=($!)
    export NATS_URL="nats://127.0.0.1:$port"
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null && break; sleep 0.1; done
    echo "nats-server (JetStream) on $NATS_URL, store in $work"
fi

for service in controller dataset evaluator; do
    "$bin/arl-$service" 2>"$work/$service.log" &
    pids+=($!)
done

run_id="$("$bin/arl" run submit "$spec" --wait)"
# The dataset service registers the run's tasks a moment after admission.
for _ in $(seq 50); do
    "$bin/arl" run status "$run_id" | grep -q '^registered' && break
    sleep 0.2
done
"$bin/arl" run status "$run_id" || true
cat <<MSG

The controller admitted run $run_id and the dataset service registered its tasks and
published its first batch. The rollout service is not built yet (see ARCHITECTURE.md);
once it is, this script starts it with the sandbox, proxy, engine, reward and trainer
services and follows the run to the end with \`arl run watch $run_id\`.
MSG
