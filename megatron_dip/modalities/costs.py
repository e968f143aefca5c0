"""The operator vocabulary the cost model prices, shared by the modality files (torch-free).

A modality describes one transformer layer (and its input and output layers) as a list of `Op`s:
GEMMs, the attention core and memory-bound element-wise work, each with its FLOPs, bytes and the
row count (GEMM rows, attention segment length) that drives its efficiency. The cost model
(`planner.cost_model`) prices them with a roofline. What a layer keeps for backward is counted
in `stored.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

LOGIT_BYTES = 4  # the vocab-parallel cross-entropy keeps fp32 logits
ATTENTION_KERNELS = ("flash", "segments")


class OpKind(enum.Enum):
    GEMM = "gemm"
    ATTN = "attn"
    MEM = "mem"


@dataclass(frozen=True)
class Op:
    """One operator: FLOPs, bytes moved, kind, and what drives its efficiency."""

    flops: float
    nbytes: float
    kind: OpKind
    rows: float = 1.0  # GEMM row count or attention segment length: drives efficiency
    core: bool = False  # part of the attention core (what selective recompute redoes)
    w_held: float = 0.0  # a weight GEMM: bytes its deferred weight gradient holds (`gemm`)


@dataclass(frozen=True)
class Work:
    """What a layer computes on: tokens, instances, sum of squared attention segment lengths;
    the tokens its instances cross-attend to and the cross-attention's instance x context pairs;
    the rows its first chunk receives from producers (`SubMicrobatch.context_tokens` ...)."""

    tokens: int
    instances: int
    pairs: float
    context_tokens: int = 0
    context_pairs: float = 0.0
    input_tokens: int = 0

    @property
    def seg(self) -> float:
        """Mean attention segment length (tokens weighted)."""
        return self.pairs / max(1, self.tokens)


@dataclass(frozen=True)
class Kernels:
    """Which kernels run, as far as what they keep for backward differs.

    `attention`: "flash" (Transformer Engine's THD attention, torch's FlashAttention varlen
    kernel: the output, which is the out-projection's input, and a log-sum-exp per head and
    token) or "segments" (torch's SDPA on each segment in turn, `models.attention`: also each
    segment's own output, concatenated into a new tensor). `fused_rms_norm`: RMSNorm keeps its
    input and statistics only (Transformer Engine, torch's CUDA kernel), else also its
    normalised output (torch's composite RMSNorm on the CPU). `models.kernels.resolve_kernels`
    says which run.
    """

    attention: str = "flash"
    fused_rms_norm: bool = True
    # Transformer Engine's linears queue their weight GEMMs for a split backward's W
    # (`delay_wgrad_compute`, `runtime/delayed_wgrad.py`): every linear's, row-parallel too,
    # each holding the input and output gradient it was given in B (`gemm`).
    te_delayed_wgrad: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"attention kernel must be one of {ATTENTION_KERNELS}, got {self.attention!r}"
            )


@dataclass(frozen=True)
class CostContext:
    """How one pipeline rank runs a layer: tensor-parallel size, sequence parallelism, bytes per
    element, and the kernels (`Kernels`)."""

    tp: int
    sp: bool
    dt: int
    kernels: Kernels = Kernels()

    @property
    def rep(self) -> int:
        """Divisor of tensors replicated across TP ranks unless sequence parallelism shards them."""
        return self.tp if self.sp else 1


def gemm(m: float, k: int, n: int, c: CostContext, *, shard_in: bool) -> Op:
    """[m, k] x [k, n] split over TP: column-parallel (full input) or row-parallel (full output).
    `w_held`: what its weight gradient, deferred to a split backward's W, needs. Our split
    (`runtime/backward_split.py`) defers only a column-parallel GEMM's: the saved input (under
    sequence parallelism the sequence shard, Megatron gathers it again) and the output gradient
    (TP-sharded); a row-parallel one's output gradient is full width on every TP rank, so
    holding it for W would cost about as much memory as the stage's activations; it is done in
    B (0 here). Transformer Engine's queue (`Kernels.te_delayed_wgrad`) defers every GEMM's,
    each with the tensors its weight GEMM reads: the gathered input and the sharded output
    gradient of a column-parallel one, the sharded input and the gathered (full-width) output
    gradient of a row-parallel one."""
    act = m * (k / c.tp + n) if shard_in else m * (k + n / c.tp)
    if c.kernels.te_delayed_wgrad:
        held = m * (k / c.tp + n) if shard_in else m * (k + n / c.tp)
    else:
        held = 0.0 if shard_in else m * (k / c.rep + n / c.tp)
    return Op(
        2 * m * k * n / c.tp, c.dt * (k * n / c.tp + act), OpKind.GEMM, rows=m, w_held=c.dt * held
    )


def mem(elements: float, passes: float, c: CostContext) -> Op:
    """A memory-bound element-wise pass over `elements`, `passes` reads/writes each."""
    return Op(passes * elements, passes * elements * c.dt, OpKind.MEM)


def attention_core(layer, pairs: float, seg: float, c: CostContext, *, causal: bool) -> Op:
    """Attention core of a `LayerShape`: QK^T and PV (4 * pairs * heads * head size FLOPs; half
    when causal)."""
    width = layer.attention_width
    flops = (2 if causal else 4) * pairs * width / c.tp
    tokens = pairs / max(seg, 1.0)
    kv = 2 * layer.kv_groups * layer.head_dim
    return Op(flops, c.dt * tokens * (2 * width + kv) / c.tp, OpKind.ATTN, rows=seg, core=True)


def norm_op(layer, w: Work, c: CostContext) -> Op:
    """One pre-norm over the layer's hidden states (read and write once)."""
    return mem(w.tokens * layer.hidden / c.rep, 2, c)


def activation_op(layer, w: Work, c: CostContext) -> Op:
    """The MLP's activation function over fc1's output (SwiGLU: read both halves, write one)."""
    return mem(w.tokens * layer.ffn / c.tp, 3 if layer.gated_mlp else 2, c)


def self_attention_ops(layer, w: Work, c: CostContext, *, causal: bool) -> list[Op]:
    """Norm, QKV projection, attention core, output projection and residual of one layer."""
    h, t, q = layer.hidden, w.tokens, layer.attention_width
    kv = 2 * layer.kv_groups * layer.head_dim
    return [
        norm_op(layer, w, c),
        gemm(t, h, q + kv, c, shard_in=False),
        attention_core(layer, w.pairs, w.seg, c, causal=causal),
        gemm(t, q, h, c, shard_in=True),
        mem(t * h / c.rep, 3, c),  # residual add
    ]


def mlp_ops(layer, w: Work, c: CostContext) -> list[Op]:
    """Norm, up projection (two for SwiGLU), activation, down projection and residual."""
    h, f, t = layer.hidden, layer.ffn, w.tokens
    up = 2 * f if layer.gated_mlp else f
    return [
        norm_op(layer, w, c),
        gemm(t, h, up, c, shard_in=False),
        activation_op(layer, w, c),  # SwiGLU / GELU
        gemm(t, f, h, c, shard_in=True),
        mem(t * h / c.rep, 3, c),
    ]


def cross_attention_ops(layer, w: Work, c: CostContext) -> list[Op]:
    """Cross-attention of every token to its own instance's context tokens (`w.context_*`)."""
    h, t, text = layer.hidden, w.tokens, w.context_tokens
    kv = 2 * layer.kv_groups * layer.head_dim
    return [
        mem(t * h / c.rep, 2, c),
        gemm(t, h, h, c, shard_in=False),
        gemm(text, h, kv, c, shard_in=False),
        attention_core(layer, w.context_pairs, w.context_pairs / max(1, t), c, causal=False),
        gemm(t, h, h, c, shard_in=True),
        mem(t * h / c.rep, 3, c),
    ]
