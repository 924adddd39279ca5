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

"$bin/arl-controller" 2>"$work/controller.log" &
pids+=($!)

run_id="$("$bin/arl" run submit "$spec" --wait)"
cat <<MSG

The controller admitted run $run_id. The rollout, reward, trainer and evaluator
services are not built yet (see ARCHITECTURE.md); once they are, this script follows
the run to the end with \`arl run watch $run_id\`.
MSG
