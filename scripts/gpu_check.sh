#!/usr/bin/env bash
# The prepared check of what only a GPU can show, on ONE GPU, in well under 10 minutes:
#
#   scripts/gpu_check.sh WHEEL_DIR [OUT_DIR] [PROFILE_BUDGET_S]
#
# For a machine with Python 3.12, its own torch (with CUDA), no megatron-core and no network.
# WHEEL_DIR holds the megatron-core 0.16.1 wheel for that Python, fetched beforehand with
#
#   pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 -d WHEEL_DIR
#
# (and numpy / packaging wheels, used only when those do not import). It installs that wheel and
# this repository, both without dependencies and offline, then:
#   1. runs the layer profile of scripts/profile_gpu.sh (VLM-S layers at TP4, bf16), with
#      PROFILE_BUDGET_S seconds of timing per attention implementation (default 45);
#   2. runs `python -m megatron_dip.gpu_check` (see its docstring): tiny-vlm and tiny-t2v trained
#      a few iterations in bf16 on one rank with the GPU attention (Transformer Engine's THD
#      attention when it imports, else torch's FlashAttention varlen kernel) and with our CPU
#      attention (SDPA per segment), losses within 2%; peak torch.cuda.max_memory_allocated and
#      the allocator's growth next to the memory model, per chunk; the executor's
#      per-instruction overhead (CUDA-event timeline vs host time); activation offload: the
#      memory rows of its policies (off1, block1+off1) and its copies' host-link bandwidth and
#      overlap with compute (CUDA events); the profile next to the analytic cost model; tiny-vlm
#      in fp32 with split backwards (B/W; Transformer Engine >= 2.3: its delayed weight GEMMs)
#      against fused ones, losses and gradient norms within 1e-4. It prints one table and writes
#      OUT_DIR/gpu_check.json;
#   3. runs the entry point as a user starts it: `torchrun pretrain_vlm_dip.py` tiny-vlm on the
#      GPU (NCCL, bf16, the planner process), 12 iterations with a save and an evaluation, then
#      resumed from that checkpoint to 14 (logs: OUT_DIR/entry-12.log, entry-14.log).
# OUT_DIR defaults to $OUT when set (the device tool's result folder), else ./gpu-check.
# Exit status: 0 all held; 1 a part failed or a check did not hold; 2 bad arguments; 3 no GPU
# or the installation failed.
set -uo pipefail

usage() {
    echo "usage: scripts/gpu_check.sh WHEEL_DIR [OUT_DIR] [PROFILE_BUDGET_S]" >&2
    exit 2
}
[ $# -ge 1 ] && [ $# -le 3 ] || usage
WHEELS=$1
DEST=${2:-${OUT:-gpu-check}}
BUDGET_S=${3:-45}
if [ ! -d "$WHEELS" ]; then
    echo "gpu_check.sh: WHEEL_DIR '$WHEELS' is not a directory" >&2
    exit 2
fi
shopt -s nullglob
wheel=("$WHEELS"/megatron_core-0.16.1-*.whl)
if [ ${#wheel[@]} -eq 0 ]; then
    echo "gpu_check.sh: WHEEL_DIR '$WHEELS' holds no megatron_core-0.16.1-*.whl; fetch it with:" >&2
    echo "  pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 -d $WHEELS" >&2
    exit 2
fi
if ! [[ "$BUDGET_S" =~ ^[0-9]+$ ]] || [ "$BUDGET_S" -lt 10 ]; then
    echo "gpu_check.sh: PROFILE_BUDGET_S must be a whole number of seconds >= 10, got '$BUDGET_S'" >&2
    exit 2
fi
WHEELS=$(cd "$WHEELS" && pwd)
cd "$(dirname "$0")/.."
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

python -c "import numpy, packaging" 2>/dev/null ||
    python -m pip install -q --no-deps --no-index --find-links "$WHEELS" numpy packaging || exit 3
python -c "import importlib.metadata as m; assert m.version('megatron-core') == '0.16.1'" 2>/dev/null ||
    python -m pip install -q --no-deps --no-index "${wheel[0]}" || exit 3
# The repository itself, without dependencies (PYTHONPATH covers an environment without
# setuptools, where an offline editable install cannot build).
python -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>/dev/null ||
    echo "gpu_check.sh: repository not pip-installed (no setuptools?); running from PYTHONPATH"
python - <<'EOF' || exit 3
import torch, megatron.core
assert torch.cuda.is_available(), "no CUDA device visible: this check needs a GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(),
      "| megatron-core", megatron.core.__version__, flush=True)
EOF

status=0
scripts/profile_gpu.sh "$WHEELS" "$DEST/profiles" "$BUDGET_S" > "$DEST/profile.log" 2>&1 || status=1
echo "gpu_check.sh: layer profile exit $status after $(($(date +%s) - start)) s (log: $DEST/profile.log)"
timeout 300 python -m megatron_dip.gpu_check --out "$DEST" --profiles "$DEST/profiles" \
    2>&1 | grep -v "Warning\|warnings.warn" | tee "$DEST/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check.sh: checks exit $rc after $(($(date +%s) - start)) s"
[ "$rc" -eq 0 ] || status=1

# 3. The entry point as a user starts it (torchrun, NCCL, the planner process, bf16): train,
# save, evaluate, then resume from the checkpoint for two more iterations.
run_dir=$(mktemp -d -t dip-gpu-entry-XXXX)
python scripts/make_tiny_llava_sample.py "$run_dir/llava" --num-samples 32 > /dev/null
entry=(torchrun --standalone --nproc-per-node 1 pretrain_vlm_dip.py --model tiny-vlm
    --global-batch-size 4 --dip-data "llava:$run_dir/llava/data.json" --dip-image-size 32
    --lr 3e-3 --log-interval 2 --eval-interval 6 --eval-iters 1 --dip-lookahead 2
    --dip-search-time-ms 200 --save "$run_dir/ckpt" --load "$run_dir/ckpt" --save-interval 6
    --bf16)
# The resumed run's longer schedule replaces the checkpoint's (as a user extending a run does).
for iters in 12 14; do
    more=()
    [ "$iters" -eq 12 ] || more=(--override-opt_param-scheduler)
    timeout 180 "${entry[@]}" --train-iters "$iters" ${more[@]+"${more[@]}"} 2>&1 |
        grep -v "Warning\|warnings.warn" > "$DEST/entry-$iters.log"
    rc=${PIPESTATUS[0]}
    tail -4 "$DEST/entry-$iters.log"
    echo "gpu_check.sh: torchrun pretrain_vlm_dip.py --train-iters $iters: exit $rc"
    [ "$rc" -eq 0 ] || status=1
done
exit "$status"
