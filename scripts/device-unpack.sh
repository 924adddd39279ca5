#!/usr/bin/env bash
# Unpacks what `make gpu-test-bundle` put in .device/bin (xz-compressed binaries) into
# /tmp/arl-bin on the device machine, once per machine, and prints that folder. Later calls
# of the same lease find it there even when they no longer carry .device/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
out=/tmp/arl-bin
mkdir -p "$out"
if [ -d .device/bin ]; then
    for packed in .device/bin/*.xz; do
        name=$(basename "$packed" .xz)
        if [ ! -x "$out/$name" ] || [ "$packed" -nt "$out/$name" ]; then
            xz -dc "$packed" > "$out/$name.tmp" && chmod +x "$out/$name.tmp" && mv "$out/$name.tmp" "$out/$name"
        fi
    done
fi
ls "$out"/test-* > /dev/null 2>&1 || { echo "no test binaries: run make gpu-test-bundle here and carry .device/bin" >&2; exit 2; }
echo "$out"
