#!/usr/bin/env bash
# Quick start on CPU: train a tiny VLM (8-layer ViT + 8-layer LLM, hidden 32) with DIP on
# 4 processes (pipeline 2 x data parallel 2, gloo), 30 iterations, in about a minute.
# Nothing is downloaded: a tiny LLaVA-style dataset (coloured shapes + captions) is generated.
#
#   scripts/quickstart_cpu.sh [OUT_DIR] [extra flags, e.g. --dip-schedule 1f1b]
#
# Writes OUT_DIR/llava (data), OUT_DIR/checkpoints, OUT_DIR/traces (open in ui.perfetto.dev).
# Run again with the same OUT_DIR, it resumes from OUT_DIR/checkpoints (nothing left to train
# after 30 iterations: raise --train-iters).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d -t dip-quickstart-XXXX)}
shift || true

python scripts/make_tiny_llava_sample.py "$OUT/llava" --num-samples 64
# One intra-op thread per process: 4 processes share the machine's cores.
OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 pretrain_vlm_dip.py \
    --model tiny-vlm \
    --pipeline-model-parallel-size 2 \
    --global-batch-size 4 \
    --dip-data "llava:$OUT/llava/data.json" --dip-image-size 32 \
    --train-iters 30 --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine \
    --log-interval 5 --eval-interval 15 --eval-iters 2 \
    --dip-lookahead 2 --dip-search-time-ms 200 \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 15 \
    --dip-trace-dir "$OUT/traces" --dip-trace-interval 10 \
    "$@"
echo "outputs in $OUT"
