#!/usr/bin/env bash
# Submit one of the paper's setups at its real size (docs/design.md, "Paper setups") with SLURM:
#
#   scripts/train_paper_setup.sh [--print] SETUP [flags...]     flags override the defaults
#
#   SETUP   GPUs  nodes x 8  TP x PP  model
#   vlm-s     16          2   4 x 4   ViT-5B + Llama3-8B
#   vlm-m     32          4   8 x 4   ViT-5B + Qwen2-32B
#   vlm-l     64          8   8 x 8   ViT-22B + Qwen2-72B
#   t2v-s     16          2   4 x 4   Llama3-8B (frozen) + DiT-5B
#   t2v-l     64          8   8 x 8   Qwen2-32B (frozen) + DiT-30B
#
# It runs `sbatch --nodes=N scripts/train_vlm_slurm.sbatch --model SETUP` (or the diffusion twin):
# the preset fixes TP, PP, the global batch (32 packed microbatches of 8192 tokens) and the
# synthetic data; add --dip-data for real data and --dip-schedule 1f1b|interleaved for the
# Megatron baselines on the same GPUs. --print shows the command instead of submitting it.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() {
    echo "usage: scripts/train_paper_setup.sh [--print] vlm-s|vlm-m|vlm-l|t2v-s|t2v-l [flags...]" >&2
    exit 2
}
PRINT=0
if [ "${1:-}" = "--print" ]; then
    PRINT=1
    shift
fi
[ $# -ge 1 ] || usage
SETUP=$1
shift
case "$SETUP" in
    vlm-s) NODES=2 SCRIPT=scripts/train_vlm_slurm.sbatch ;;
    vlm-m) NODES=4 SCRIPT=scripts/train_vlm_slurm.sbatch ;;
    vlm-l) NODES=8 SCRIPT=scripts/train_vlm_slurm.sbatch ;;
    t2v-s) NODES=2 SCRIPT=scripts/train_diffusion_slurm.sbatch ;;
    t2v-l) NODES=8 SCRIPT=scripts/train_diffusion_slurm.sbatch ;;
    *) echo "train_paper_setup.sh: unknown setup '$SETUP'" >&2; usage ;;
esac
command=(sbatch --nodes="$NODES" --gpus-per-node=8 --job-name="dip-$SETUP" "$SCRIPT" --model "$SETUP" "$@")
if [ "$PRINT" -eq 1 ]; then
    echo "${command[@]}"
else
    "${command[@]}"
fi
