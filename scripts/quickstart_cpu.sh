#!/usr/bin/env bash
# Quick start on CPU: train a tiny VLM (8-layer ViT + 8-layer LLM, hidden 32) with DIP on
# 4 processes (pipeline 2 x data parallel 2, gloo), 30 iterations, in about a minute.
# Nothing is downloaded: a tiny LLaVA-style dataset (coloured shapes + captions) is generated.
#
#   scripts/quickstart_cpu.sh [--energon] [--hf-tokenizer] [OUT_DIR] [extra flags, e.g. --dip-schedule 1f1b]
#
#   --energon       convert the dataset to a Megatron-Energon dataset (tools/llava_to_energon.py)
#                   and train on that (--dip-data energon:OUT_DIR/energon)
#   --hf-tokenizer  train a small BPE Hugging Face tokenizer on the captions and use it
#                   (--tokenizer-type HuggingFaceTokenizer; its ChatML chat template)
#
# Writes OUT_DIR/llava (data), OUT_DIR/checkpoints, OUT_DIR/traces (open in ui.perfetto.dev).
# Run again with the same OUT_DIR, it resumes from OUT_DIR/checkpoints (nothing left to train
# after 30 iterations: raise --train-iters).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=llava
TOKENIZER=byte
while [[ $# -gt 0 ]]; do
    case "$1" in
        --energon) DATA=energon; shift ;;
        --hf-tokenizer) TOKENIZER=hf; shift ;;
        *) break ;;
    esac
done
OUT=${1:-$(mktemp -d -t dip-quickstart-XXXX)}
shift || true

python scripts/make_tiny_llava_sample.py "$OUT/llava" --num-samples 64
DATA_FLAGS=(--dip-data "llava:$OUT/llava/data.json")
if [[ $DATA == energon ]]; then
    python tools/llava_to_energon.py --json "$OUT/llava/data.json" --out "$OUT/energon" \
        --samples-per-shard 16
    DATA_FLAGS=(--dip-data "energon:$OUT/energon")
fi
TOKENIZER_FLAGS=()
if [[ $TOKENIZER == hf ]]; then
    python scripts/make_tiny_tokenizer.py "$OUT/tokenizer" --llava "$OUT/llava/data.json"
    TOKENIZER_FLAGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/tokenizer")
fi
# One intra-op thread per process: 4 processes share the machine's cores.
OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 pretrain_vlm_dip.py \
    --model tiny-vlm \
    --pipeline-model-parallel-size 2 \
    --global-batch-size 4 \
    "${DATA_FLAGS[@]}" ${TOKENIZER_FLAGS[@]+"${TOKENIZER_FLAGS[@]}"} --dip-image-size 32 \
    --train-iters 30 --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine \
    --log-interval 5 --eval-interval 15 --eval-iters 2 \
    --dip-lookahead 2 --dip-search-time-ms 200 \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 15 \
    --dip-trace-dir "$OUT/traces" --dip-trace-interval 10 \
    "$@"
echo "outputs in $OUT"
