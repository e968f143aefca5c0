"""What a layer keeps for its backward, in the units the modality files count in (torch-free).

The counting follows Korthikanti et al. (Reducing Activation Recomputation in Large Transformer
Models): per layer, tokens x hidden x bytes per element times a count of stored tensors, split
by how tensor and sequence parallelism divide them; no dropout masks (the models use none).
The counts are those of the layers as they run here, measured with autograd's saved-tensor
hooks (`megatron_dip.memory_probe`, `tests/test_memory_model.py`), not the paper's rounded ones:

* a norm keeps its input and one (RMSNorm) or two (LayerNorm) fp32 statistics per token; torch's
  composite RMSNorm (the CPU's) its input upcast to fp32 and its normalised output instead
  (`Kernels.fused_rms_norm`);
* the QKV projection's output stays whole (V is a view of it); with rotary embeddings Q and K
  are new tensors, and the cos / sin tables of both (per token, head_dim wide) are kept;
* the attention core keeps a log-sum-exp per head and token; the "segments" kernel also each
  segment's output (`Kernels.attention`); the out-projection keeps its input;
* the MLP keeps its input and fc1's output, and the input of fc2 (GELU); Megatron's SwiGLU also
  the activation's output and its linear half plus the GLU offset: 5 x FFN in all;
* a first layer that converts float32 input data to a 16-bit dtype keeps the copy.

Selective recomputation drops the attention cores' share (`Stored.core`). Cheap module
recomputation (`MemoryPolicy.modules`, `recompute_saved`) drops what a norm or the MLP's
activation keeps beyond its input, and its output, which the next GEMM keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import CostContext, Work

DATA_BYTES = 4  # sub-microbatch data arrive as float32


@dataclass(frozen=True)
class Stored:
    """Tensors one layer keeps for backward. In units of tokens x hidden elements: `replicated`
    ones (split over TP only under sequence parallelism), `sharded` ones (split by heads / FFN
    over TP), `whole` ones (never split: rotary tables, gathered sequences). In bytes: `core`,
    the attention cores' own (dropped under selective recompute), and `fixed`, bytes that do
    not scale with the tokens (per instance, per context token)."""

    replicated: float = 0.0
    sharded: float = 0.0
    whole: float = 0.0
    core: float = 0.0
    fixed: float = 0.0

    def __add__(self, other: Stored) -> Stored:
        return Stored(
            self.replicated + other.replicated,
            self.sharded + other.sharded,
            self.whole + other.whole,
            self.core + other.core,
            self.fixed + other.fixed,
        )

    def nbytes(self, hidden: int, w: Work, c: CostContext, *, keep_core: bool = True) -> float:
        """Bytes of these tensors for `w` under `c`; the attention cores only when `keep_core`."""
        units = self.replicated / c.rep + self.sharded / c.tp + self.whole
        core = self.core if keep_core else 0.0
        return c.dt * w.tokens * hidden * units + core + self.fixed


def stat_bytes(c: CostContext) -> int:
    """Bytes of one per-token statistic (norm mean / rstd, log-sum-exp): at least fp32."""
    return max(4, c.dt)


def norm_stored(hidden: int, c: CostContext, *, rms: bool) -> Stored:
    """One norm: its input and statistics; torch's composite RMSNorm keeps its input, upcast to
    at least fp32, and its normalised output instead."""
    keeps = 2.0 * stat_bytes(c) / c.dt if rms and not c.kernels.fused_rms_norm else 1.0
    stats = (1 if rms else 2) * stat_bytes(c) / (c.dt * hidden)
    return Stored(replicated=keeps + stats)


def data_copy_bytes(elements: float, c: CostContext) -> float:
    """Bytes of the input data (float32 arrays: patches, mel frames, latents) converted to the
    compute dtype for the first layer, which keeps it: none when that is float32 itself."""
    return 0.0 if c.dt == DATA_BYTES else c.dt * elements


def attention_core_stored(layer, tokens: int, c: CostContext) -> Stored:
    """An attention core over `tokens` queries: the log-sum-exp, and for the "segments"
    kernel each segment's output (sharded, one hidden width)."""
    lse = stat_bytes(c) * layer.heads * tokens / c.tp
    width = layer.attention_width
    outputs = c.dt * tokens * width / c.tp if c.kernels.attention == "segments" else 0.0
    return Stored(core=lse + outputs)


def self_attention_stored(layer, w: Work, c: CostContext, *, rotary: bool) -> Stored:
    """QKV input, QKV output, rotary Q / K and tables, the core, the out-projection input (Q
    and the attention output are heads x head size wide: `LayerShape.attention_width`)."""
    kv = 2 * layer.kv_groups * layer.head_dim / layer.hidden
    q = layer.attention_width / layer.hidden
    out = Stored(replicated=1.0, sharded=(q + kv) + q) + attention_core_stored(layer, w.tokens, c)
    if rotary:
        out += Stored(sharded=q + kv / 2, whole=4 * layer.head_dim / layer.hidden)
    return out


def mlp_stored(layer) -> Stored:
    """fc1 input (replicated), fc1 output and fc2 input (SwiGLU: 5 FFN widths, GELU: 2)."""
    return Stored(replicated=1.0, sharded=(5 if layer.gated_mlp else 2) * layer.ffn / layer.hidden)


def transformer_layer_stored(layer, w: Work, c: CostContext, *, rms: bool, rotary: bool) -> Stored:
    """A standard pre-norm transformer layer (Megatron's GPT layer): two norms, self-attention
    (with rotary embeddings when `rotary`), MLP."""
    norm = norm_stored(layer.hidden, c, rms=rms)
    return norm + self_attention_stored(layer, w, c, rotary=rotary) + norm + mlp_stored(layer)


def recompute_saved(layer, c: CostContext, module: str, *, rms: bool) -> Stored:
    """What one standard layer keeps less when `module` is recomputed in backward
    (`schedule.ir.RECOMPUTE_MODULES`). "layernorm": each of the two pre-norms keeps only its
    input (the residual stream, which it keeps anyway) instead of its own saved tensors, and its
    output (linear_qkv's / linear_fc1's saved input) is recomputed: `norm_stored` per norm. For
    the composite RMSNorm that holds too: the fp32 input copy and the normalised output it keeps
    stand for the output and the statistics. "mlp_act": the activation keeps only fc1's output
    (its input: 2 FFN widths for SwiGLU, 1 for GELU) of the `mlp_stored` FFN widths, so the rest
    (GELU: fc2's input; SwiGLU: the SiLU output, the offset linear half and fc2's input) goes."""
    if module == "layernorm":
        norm = norm_stored(layer.hidden, c, rms=rms)
        return norm + norm
    if module == "mlp_act":
        return Stored(sharded=(3 if layer.gated_mlp else 1) * layer.ffn / layer.hidden)
    raise ValueError(f"unknown recompute module {module!r}")
