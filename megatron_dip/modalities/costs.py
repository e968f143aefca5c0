"""The operator vocabulary the cost model prices, shared by the modality files (torch-free).

A modality describes one transformer layer (and its input and output layers) as a list of `Op`s:
GEMMs, the attention core and memory-bound element-wise work, each with its FLOPs, bytes and the
row count (GEMM rows, attention segment length) that drives its efficiency. The cost model
(`planner.cost_model`) prices them with a roofline; the activation rules below follow
Korthikanti et al. (Reducing Activation Recomputation in Large Transformer Models): per layer
s*b*h bytes times a count of stored tensors, no dropout masks, and with flash attention storing
only its log-sum-exp instead of the s^2 scores.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

LSE_BYTES = 4  # flash attention keeps one fp32 log-sum-exp per head and token
LOGIT_BYTES = 4  # the vocab-parallel cross-entropy keeps fp32 logits


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


@dataclass(frozen=True)
class Work:
    """What a layer computes on: tokens, instances, sum of squared attention segment lengths."""

    tokens: int
    instances: int
    pairs: float

    @property
    def seg(self) -> float:
        """Mean attention segment length (tokens weighted)."""
        return self.pairs / max(1, self.tokens)


@dataclass(frozen=True)
class CostContext:
    """How one pipeline rank runs a layer: tensor-parallel size, sequence parallelism, bytes per
    element, caption tokens a DiT clip cross-attends to, and whether attention is flash."""

    tp: int
    sp: bool
    dt: int
    caption: int
    flash: bool

    @property
    def rep(self) -> int:
        """Divisor of tensors replicated across TP ranks unless sequence parallelism shards them."""
        return self.tp if self.sp else 1


def gemm(m: float, k: int, n: int, c: CostContext, *, shard_in: bool) -> Op:
    """[m, k] x [k, n] split over TP: column-parallel (full input) or row-parallel (full output)."""
    act = m * (k / c.tp + n) if shard_in else m * (k + n / c.tp)
    return Op(2 * m * k * n / c.tp, c.dt * (k * n / c.tp + act), OpKind.GEMM, rows=m)


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


def self_attention_ops(layer, w: Work, c: CostContext, *, causal: bool) -> list[Op]:
    """Norm, QKV projection, attention core, output projection and residual of one layer."""
    h, t, q = layer.hidden, w.tokens, layer.attention_width
    kv = 2 * layer.kv_groups * layer.head_dim
    return [
        mem(t * h / c.rep, 2, c),  # norm
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
        mem(t * h / c.rep, 2, c),
        gemm(t, h, up, c, shard_in=False),
        mem(t * f / c.tp, 3 if layer.gated_mlp else 2, c),  # SwiGLU / GELU
        gemm(t, f, h, c, shard_in=True),
        mem(t * h / c.rep, 3, c),
    ]


def cross_attention_ops(layer, w: Work, c: CostContext) -> list[Op]:
    """Cross-attention of every token to its own instance's `c.caption` context tokens."""
    h, t, text = layer.hidden, w.tokens, w.instances * c.caption
    return [
        mem(t * h / c.rep, 2, c),
        gemm(t, h, h, c, shard_in=False),
        gemm(text, h, 2 * h, c, shard_in=False),
        attention_core(layer, t * c.caption, c.caption, c, causal=False),
        gemm(t, h, h, c, shard_in=True),
        mem(t * h / c.rep, 3, c),
    ]


def core_bytes(pairs: float, tokens: int, heads: int, c: CostContext) -> float:
    """Bytes the attention core keeps for backward: the flash log-sum-exp, else the softmax."""
    if c.flash:
        return LSE_BYTES * heads * tokens / c.tp
    return c.dt * heads * pairs / c.tp  # softmax output; no dropout in these models


@dataclass(frozen=True)
class Stored:
    """Tensors one layer keeps for backward, in units of tokens x hidden: `replicated` ones
    (split over TP only under sequence parallelism), `sharded` ones (split by heads / FFN), and
    `core` bytes of attention cores (dropped under selective recompute)."""

    replicated: float
    sharded: float
    core: float

    def __add__(self, other: Stored) -> Stored:
        return Stored(
            self.replicated + other.replicated, self.sharded + other.sharded, self.core + other.core
        )


def transformer_layer_stored(layer, w: Work, c: CostContext) -> Stored:
    """What a standard pre-norm transformer layer stores (self-attention + MLP)."""
    kv = 2 * layer.kv_groups * layer.head_dim / layer.hidden
    q = layer.attention_width / layer.hidden
    sharded = q + kv + q  # Q, K, V and the out-projection input, split by heads
    sharded += (3 if layer.gated_mlp else 2) * layer.ffn / layer.hidden  # fc1 output(s), act
    # both norm inputs, QKV input, fc1 input: replicated without SP
    return Stored(4.0, sharded, core_bytes(w.pairs, w.tokens, layer.heads, c))


def stored_bytes(stored: Stored, layer, w: Work, c: CostContext, *, keep_core: bool) -> float:
    """Bytes of `stored` for one layer; the attention cores only when `keep_core`."""
    units = stored.replicated / c.rep + stored.sharded / c.tp
    return c.dt * w.tokens * layer.hidden * units + (stored.core if keep_core else 0.0)
