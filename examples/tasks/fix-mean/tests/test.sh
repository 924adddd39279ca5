#!/usr/bin/env bash
# Hidden from the agent. Runs the task's checks against the work tree and writes the
# reward (1 = solved, 0 = not) where Harbor's verifier reads it.
set -u
app="${APP_DIR:-/app}"
logs="${LOGS_DIR:-/logs}"
mkdir -p "$logs/verifier"
if cd "$app" && PYTHONPATH="$app" python3 "$(dirname "$0")/test_outputs.py"; then
    echo 1 > "$logs/verifier/reward.txt"
else
    echo 0 > "$logs/verifier/reward.txt"
fi
