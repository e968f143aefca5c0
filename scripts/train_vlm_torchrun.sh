#!/usr/bin/env bash
# One node, N GPUs: a vision-language model with DIP (or the Megatron baseline).
#
#   scripts/train_vlm_torchrun.sh GPUS [flags...]          flags override the defaults below
#
# Examples (paper presets, docs/design.md, "Paper setups"; a preset fixes model, batch, sequence, data):
#   scripts/train_vlm_torchrun.sh 8 --model vlm-s --pipeline-model-parallel-size 2
#   scripts/train_vlm_torchrun.sh 8 --model vlm-s --pipeline-model-parallel-size 2 --dip-schedule interleaved
#   scripts/train_vlm_torchrun.sh 8 --model vlm-s --dip-data llava:/data/LLaVA-Pretrain/blip_laion_cc_sbu_558k.json
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS=${1:?usage: $0 GPUS [flags...]}
shift
RUN=${RUN:-runs/vlm-$(date +%Y%m%d-%H%M%S)}

torchrun --standalone --nproc-per-node "$GPUS" pretrain_vlm_dip.py \
    --model vlm-s --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \
    --bf16 \
    --train-iters 2000 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 100 \
    --weight-decay 0.1 --clip-grad 1.0 \
    --log-interval 10 --eval-interval 500 --eval-iters 10 \
    --save "$RUN/checkpoints" --load "$RUN/checkpoints" --save-interval 500 \
    --tensorboard-dir "$RUN/tensorboard" \
    --dip-lookahead 2 --dip-search-time-ms 2000 --dip-planner-workers 4 \
    "$@"
