#!/usr/bin/env bash
# DIP vs Megatron-Core's stock 1F1B / interleaved 1F1B, measured in one run on an emulated cluster
# (CPU processes whose chunks sleep the cost model's time; see tools/bench_schedules.py).
#   scripts/benchmark.sh [OUT_DIR] [PRESET...]        e.g. scripts/benchmark.sh bench vlm-s t2v-s
# Each preset measures the machine's host overheads once (OUT_DIR/PRESET-overheads.json), then
# prints a table and writes OUT_DIR/PRESET-MIXTURE/{results.json,bench.png}.
# On GPUs (real compute): python tools/bench_schedules.py --real --torchrun-args "--nnodes ..."
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench}
shift || true
PRESETS=("$@")
[ ${#PRESETS[@]} -gt 0 ] || PRESETS=(vlm-s t2v-s vlm-l)
for preset in "${PRESETS[@]}"; do
    case "$preset" in
        vlm-*) mixtures=(mixed text-only) ;;
        *) mixtures=(t2v) ;;
    esac
    # This machine's host time per instruction, batch and message at this preset's ranks: the
    # planner trades its granularity against it and every prediction charges it.
    overheads="$OUT/$preset-overheads.json"
    [ -f "$overheads" ] || python tools/measure_overhead.py --preset "$preset" --out "$overheads"
    for mixture in "${mixtures[@]}"; do
        python tools/bench_schedules.py --preset "$preset" --mixture "$mixture" \
            --iterations 3 --warmup 1 --host-overheads "$overheads" --out "$OUT/$preset-$mixture"
    done
done
