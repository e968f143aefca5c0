#!/usr/bin/env bash
# One node, N GPUs: a text-to-video diffusion model (text encoder + DiT) with DIP.
#
#   scripts/train_diffusion_torchrun.sh GPUS [flags...]    flags override the defaults below
#
# Examples:
#   scripts/train_diffusion_torchrun.sh 8 --model t2v-s --pipeline-model-parallel-size 2
#   scripts/train_diffusion_torchrun.sh 8 --model t2v-s --pipeline-model-parallel-size 2 --dip-schedule 1f1b
#   scripts/train_diffusion_torchrun.sh 8 --model t2v-s --dip-data latents:/data/latents
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS=${1:?usage: $0 GPUS [flags...]}
shift
RUN=${RUN:-runs/t2v-$(date +%Y%m%d-%H%M%S)}

torchrun --standalone --nproc-per-node "$GPUS" pretrain_diffusion_dip.py \
    --model t2v-s --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \
    --bf16 \
    --train-iters 2000 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 100 \
    --weight-decay 0.0 --clip-grad 1.0 \
    --log-interval 10 --eval-interval 500 --eval-iters 10 \
    --save "$RUN/checkpoints" --load "$RUN/checkpoints" --save-interval 500 \
    --tensorboard-dir "$RUN/tensorboard" \
    --dip-lookahead 2 --dip-search-time-ms 2000 --dip-planner-workers 4 \
    "$@"
