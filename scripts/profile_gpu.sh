#!/usr/bin/env bash
# Profile the VLM-S component layers (ViT-5B, Llama3-8B) at the shapes one TP4 rank holds, on
# the local GPU, into the cost model's profile format (--dip-cost-profile). One command, designed
# to finish in well under 8 minutes on an H200:
#
#   scripts/profile_gpu.sh WHEEL_DIR [OUT_DIR] [BUDGET_S]
#
# WHEEL_DIR: a folder holding a megatron-core wheel for this Python (and numpy / packaging
# wheels, installed only if those do not import); megatron-core is installed from it with
# --no-deps when it does not import. OUT_DIR: where the profiles and logs go (default: $OUT if
# set, else tools/profiles). Writes vlm-s-tp4-<device>-<attention>.json (+ .log) for two
# attention implementations of the packed sequences: Transformer Engine's THD attention (when it
# imports) and torch's FlashAttention varlen kernel, or, without TE, varlen and our SDPA per
# segment (what the chunks fall back to). Each profile run has a
# time budget, BUDGET_S seconds of timing (points past it are skipped and listed in the profile),
# and a hard timeout: at most 2 x (BUDGET_S + 60 s) plus installation, 6.3 minutes by default.
set -uo pipefail

WHEELS=${1:?usage: scripts/profile_gpu.sh WHEEL_DIR [OUT_DIR] [BUDGET_S]}
DEST=${2:-${OUT:-tools/profiles}}
BUDGET_S=${3:-130}  # per profile run; the hard timeout adds start-up and slack
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$DEST"
start=$(date +%s)

python -c "import numpy, packaging" 2>/dev/null ||
    python -m pip install -q --no-deps --no-index --find-links "$WHEELS" numpy packaging
python -c "import megatron.core" 2>/dev/null ||
    python -m pip install -q --no-deps "$WHEELS"/megatron_core-*.whl || exit 1
python - <<'EOF' || exit 1
import torch, megatron.core
assert torch.cuda.is_available(), "no CUDA device visible"
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(),
      "| megatron-core", megatron.core.__version__)
EOF
device=$(python -c "import torch; from megatron_dip.planner.devices import match_device; \
print((match_device(torch.cuda.get_device_name()) or 'gpu').lower())")
if python -c "import transformer_engine.pytorch" 2>/dev/null; then
    attentions=(te varlen)  # varlen as well: what a TE-less deployment runs
else
    attentions=(varlen segments)  # FlashAttention varlen first, then the per-segment fallback
fi
# One rank, no collective: gloo only needs an interface, the loopback one is enough.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

# ViT: images of 16x16 .. 64x64 patches (2704 = the 52x52-patch image of 169 LLM tokens), up to
# 16 per sub-microbatch and 48k patches; LLM: one packed sequence (instances = 1) up to 8192.
status=0
for attention in "${attentions[@]}"; do
    out="$DEST/vlm-s-tp4-$device-$attention.json"
    timeout $((BUDGET_S + 60)) python tools/profile_costs.py --preset vlm-s --tensor-parallel 4 \
        --attention "$attention" --dtype bfloat16 --warmup 3 --iters 10 \
        --grid vit=256,676,1024,2704,4096@1,2,4,8,12,16 --max-tokens 49152 \
        --grid llm=1024,2048,4096,8192@1 --time-budget-s "$BUDGET_S" \
        --out "$out" 2>&1 | grep -v "Warning\|warnings.warn" | tee "${out%.json}.log"
    rc=${PIPESTATUS[0]}
    echo "profile_gpu.sh: $attention: exit $rc after $(($(date +%s) - start)) s"
    [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
