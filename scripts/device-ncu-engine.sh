#!/usr/bin/env bash
# One decode step of the engine under Nsight Compute, kernel by kernel, on a GPU machine
# without Rust (after scripts/device-unpack.sh has unpacked `make gpu-test-bundle`'s
# binaries): each launch's grid, duration, DRAM bytes read and DRAM throughput against the
# device's peak — what the event-timed ARL_CUDA_PROFILE=1 cannot tell apart (one line per
# kernel name there, here one per launch, so the vocabulary head is not averaged in with the
# layers' products).
#
#   scripts/device-ncu-engine.sh [KERNEL_REGEX] [BATCH] [SKIP] [COUNT]
#
# Defaults: every kernel, batch 1, the launches of one step after the warm-up. ncu needs a
# Firecracker machine (KINDS.md) and runs with the clocks left alone. The table goes to
# stdout and, when $OUT is set, the raw CSV to $OUT/ncu-engine.csv.
set -uo pipefail
cd "$(dirname "$0")/.."
regex=${1:-.} batch=${2:-1} skip=${3:-3000} count=${4:-240}
bin=/tmp/arl-bin
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 2; }
csv=${OUT:-/tmp}/ncu-engine.csv
"$ncu" --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread \
    "$bin"/arl-bench-engine --device cuda --model qwen2.5-0.5b --batches "$batch" --new-tokens 64 \
    > "$csv" 2> "${csv%.csv}.log"
python3 - "$csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
names, units = rows[head], rows[head + 1]
col = {n: names.index(n) for n in names}
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "byte": 1e-6, "Kbyte": 1e-3,
         "Mbyte": 1.0, "Gbyte": 1e3}
def value(r, metric):
    return float(r[col[metric]].replace(",", "") or 0) * scale.get(units[col[metric]], 1.0)
total = 0.0
print(f"{'kernel':<28} {'grid':>7} {'regs':>5} {'µs':>8} {'MB read':>9} {'DRAM %':>7}")
for r in rows[head + 2:]:
    try:
        us = value(r, "gpu__time_duration.sum")
    except (ValueError, IndexError):
        continue
    total += us
    mb = value(r, "dram__bytes_read.sum")
    print(f"{r[col['Kernel Name']][:28]:<28} {r[col['launch__grid_size']]:>7} "
          f"{r[col['launch__registers_per_thread']]:>5} {us:8.1f} {mb:9.2f} "
          f"{r[col['dram__throughput.avg.pct_of_peak_sustained_elapsed']]:>7}")
print(f"sum of kernel time: {total:.0f} µs")
PY
