"""Time and activation memory of a chunk on a sub-microbatch: analytic, calibratable from profiles.

Analytic model. Each layer is a list of operators (GEMMs, the attention core, memory-bound
element-wise ops), each priced by a roofline, latency = max(flops / (peak * eff), bytes / HBM).
A GEMM's efficiency grows with its row count m as cap * m / (m + gemm_half_rows): small
sub-microbatches starve the tensor cores, which is the curve DIP picks sub-microbatch sizes from.
Attention cores run at `attention_efficiency` of that cap, degraded the same way by short segments.
Backward is twice the forward (input and weight gradients). Tensor parallelism divides FLOPs and
weight bytes by TP and adds one NVLink all-reduce (or all-gather + reduce-scatter under sequence
parallelism: the same bytes) per parallel block in forward and again in backward.

Activation memory follows Korthikanti et al. (Reducing Activation Recomputation in Large
Transformer Models): per layer s*b*h bytes times a per-module count of stored tensors, without
dropout masks, and with flash attention storing only its log-sum-exp instead of the s^2 scores.

Profiles (`load_profile`) replace the analytic per-layer times where they cover a module.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from ..modelspec import ModuleKind, ModuleSpec, MultimodalSpec
from ..schedule.ir import ChunkSpec, Recompute, SubMicrobatch
from .devices import CostProfile, DeviceSpec, load_profile

__all__ = ["CostModel", "CostProfile", "StageCost", "load_profile"]

_LSE_BYTES = 4  # flash attention keeps one fp32 log-sum-exp per head and token
_LOGIT_BYTES = 4  # the vocab-parallel cross-entropy keeps fp32 logits
_CACHE_LIMIT = 200_000


@dataclass(frozen=True)
class StageCost:
    """Seconds of forward and backward (recomputation included) of one chunk on one
    sub-microbatch, and the activation bytes held from the end of its forward to the end of its
    backward."""

    forward: float
    backward: float
    activation_bytes: int


class _Kind(enum.Enum):
    GEMM = "gemm"
    ATTN = "attn"
    MEM = "mem"


@dataclass(frozen=True)
class _Op:
    flops: float
    nbytes: float
    kind: _Kind
    rows: float = 1.0  # GEMM row count or attention segment length: drives efficiency
    core: bool = False  # part of the attention core (what selective recompute redoes)


@dataclass(frozen=True)
class _Work:
    """What a layer computes on: tokens, instances, sum of squared attention segment lengths."""

    tokens: int
    instances: int
    pairs: float

    @property
    def seg(self) -> float:
        return self.pairs / max(1, self.tokens)


@dataclass(frozen=True)
class _Ctx:
    tp: int
    sp: bool
    dt: int
    caption: int
    flash: bool

    @property
    def rep(self) -> int:
        """Divisor of tensors replicated across TP ranks unless sequence parallelism shards them."""
        return self.tp if self.sp else 1


def _gemm(m: float, k: int, n: int, c: _Ctx, *, shard_in: bool) -> _Op:
    """[m, k] x [k, n] split over TP: column-parallel (full input) or row-parallel (full output)."""
    act = m * (k / c.tp + n) if shard_in else m * (k + n / c.tp)
    return _Op(2 * m * k * n / c.tp, c.dt * (k * n / c.tp + act), _Kind.GEMM, rows=m)


def _mem(elements: float, passes: float, c: _Ctx) -> _Op:
    return _Op(passes * elements, passes * elements * c.dt, _Kind.MEM)


def _core(pairs: float, seg: float, spec: ModuleSpec, c: _Ctx, *, causal: bool) -> _Op:
    """Attention core: QK^T and PV (4 * pairs * h FLOPs; half of that when causal)."""
    lay = spec.layer
    flops = (2 if causal else 4) * pairs * lay.hidden / c.tp
    tokens = pairs / max(seg, 1.0)
    kv = 2 * lay.kv_groups * lay.head_dim
    return _Op(flops, c.dt * tokens * (2 * lay.hidden + kv) / c.tp, _Kind.ATTN, rows=seg, core=True)


def _self_attention(spec: ModuleSpec, w: _Work, c: _Ctx, *, causal: bool) -> list[_Op]:
    h, t = spec.layer.hidden, w.tokens
    kv = 2 * spec.layer.kv_groups * spec.layer.head_dim
    return [
        _mem(t * h / c.rep, 2, c),  # norm
        _gemm(t, h, h + kv, c, shard_in=False),
        _core(w.pairs, w.seg, spec, c, causal=causal),
        _gemm(t, h, h, c, shard_in=True),
        _mem(t * h / c.rep, 3, c),  # residual add
    ]


def _mlp(spec: ModuleSpec, w: _Work, c: _Ctx) -> list[_Op]:
    h, f, t = spec.layer.hidden, spec.layer.ffn, w.tokens
    up = 2 * f if spec.layer.gated_mlp else f
    return [
        _mem(t * h / c.rep, 2, c),
        _gemm(t, h, up, c, shard_in=False),
        _mem(t * f / c.tp, 3 if spec.layer.gated_mlp else 2, c),  # SwiGLU / GELU
        _gemm(t, f, h, c, shard_in=True),
        _mem(t * h / c.rep, 3, c),
    ]


def _cross_attention(spec: ModuleSpec, w: _Work, c: _Ctx) -> list[_Op]:
    """DiT cross-attention: latent tokens attend to their own clip's `caption` text tokens."""
    h, t, text = spec.layer.hidden, w.tokens, w.instances * c.caption
    return [
        _mem(t * h / c.rep, 2, c),
        _gemm(t, h, h, c, shard_in=False),
        _gemm(text, h, 2 * h, c, shard_in=False),
        _core(t * c.caption, c.caption, spec, c, causal=False),
        _gemm(t, h, h, c, shard_in=True),
        _mem(t * h / c.rep, 3, c),
    ]


def _layer_ops(spec: ModuleSpec, w: _Work, c: _Ctx) -> list[_Op]:
    """Forward operators of one transformer layer of `spec` on `w`."""
    causal = spec.kind in (ModuleKind.LLM, ModuleKind.TEXT_ENCODER)
    ops = _self_attention(spec, w, c, causal=causal) + _mlp(spec, w, c)
    if spec.kind is ModuleKind.DIT:
        h = spec.layer.hidden
        ops.append(_gemm(w.instances, h, 6 * h, c, shard_in=False))  # adaLN modulation
        ops.append(_mem(w.tokens * h / c.rep, 8, c))  # shift/scale and gates of both blocks
        ops += _cross_attention(spec, w, c)
    return ops


def _input_ops(spec: ModuleSpec, w: _Work, c: _Ctx) -> list[_Op]:
    """Embedding-side layers, charged to the module's first chunk."""
    h, t = spec.layer.hidden, w.tokens
    patch = spec.patch_size**2 * spec.in_channels
    if spec.kind is ModuleKind.VIT:
        return [_gemm(t, patch, h, c, shard_in=False), _mem(t * h, 3, c)]
    if spec.kind is ModuleKind.DIT:
        return [
            _gemm(t, patch, h, c, shard_in=False),
            _gemm(w.instances, 256, h, c, shard_in=False),  # timestep embedding MLP
            _gemm(w.instances, h, h, c, shard_in=True),
            _gemm(w.instances * c.caption, spec.cond_hidden, h, c, shard_in=False),
        ]
    # Token embedding: a gather forward; its backward scatter-adds into the vocab gradient.
    return [_mem(t * h, 2, c), _mem(spec.vocab_size * h / c.tp, 1, c)]


def _output_ops(spec: ModuleSpec, w: _Work, c: _Ctx) -> list[_Op]:
    """Projector / final norm / output head and loss, charged to the module's last chunk."""
    h, t = spec.layer.hidden, w.tokens
    ops = [_mem(t * h / c.rep, 2, c)]  # final norm
    if spec.kind is ModuleKind.VIT:
        merged = _vit_llm_tokens(spec, w)
        width = spec.merge**2 * h
        ops += [
            _gemm(merged, width, spec.out_hidden, c, shard_in=False),
            _gemm(merged, spec.out_hidden, spec.out_hidden, c, shard_in=True),
        ]
    elif spec.kind is ModuleKind.LLM:
        ops.append(_gemm(t, h, spec.vocab_size, c, shard_in=False))
        ops.append(
            _Op(
                5 * t * spec.vocab_size / c.tp,
                3 * t * spec.vocab_size / c.tp * _LOGIT_BYTES,
                _Kind.MEM,
            )
        )
    elif spec.kind is ModuleKind.DIT:
        out = spec.patch_size**2 * spec.in_channels
        ops += [_gemm(w.instances, h, 2 * h, c, shard_in=False), _gemm(t, h, out, c, shard_in=True)]
    return ops


def _vit_llm_tokens(spec: ModuleSpec, w: _Work) -> int:
    return w.instances * spec.llm_tokens_per_image(w.tokens // max(1, w.instances))


def _layer_activation(spec: ModuleSpec, w: _Work, c: _Ctx, *, keep_core: bool) -> float:
    """Bytes one layer stores for backward; `keep_core` False under selective recompute."""
    lay, t = spec.layer, w.tokens
    units_rep = 4.0  # both norm inputs, QKV input, fc1 input: replicated without SP
    kv = 2 * lay.kv_groups * lay.head_dim / lay.hidden
    units_sh = 1 + kv + 1  # Q, K, V and the out-projection input, split by heads
    units_sh += (3 if lay.gated_mlp else 2) * lay.ffn / lay.hidden  # fc1 output(s), act output
    core = _core_bytes(w.pairs, t, lay.heads, c)
    if spec.kind is ModuleKind.DIT:
        units_rep += 2 + 2  # modulated norm outputs; cross-attention norm and Q-projection inputs
        units_sh += 2  # cross-attention Q and out-projection input
        units_sh += 2 * w.instances * c.caption / max(1, t)  # cross-attention K, V
        core += _core_bytes(t * c.caption, t, lay.heads, c)
    stored = c.dt * t * lay.hidden * (units_rep / c.rep + units_sh / c.tp)
    return stored + (core if keep_core else 0.0)


def _core_bytes(pairs: float, tokens: int, heads: int, c: _Ctx) -> float:
    if c.flash:
        return _LSE_BYTES * heads * tokens / c.tp
    return c.dt * heads * pairs / c.tp  # softmax output; no dropout in these models


def _output_activation(spec: ModuleSpec, w: _Work, c: _Ctx) -> float:
    h, t = spec.layer.hidden, w.tokens
    base = 2 * c.dt * t * h / c.rep  # final-norm and head/projector inputs
    if spec.kind is ModuleKind.LLM:
        return base + _LOGIT_BYTES * t * spec.vocab_size / c.tp
    if spec.kind is ModuleKind.VIT:
        return base + 2 * c.dt * _vit_llm_tokens(spec, w) * spec.out_hidden / c.tp
    return base


def _bounded_put(cache: dict, key: tuple, value: object) -> None:
    """Memoise, forgetting everything past `_CACHE_LIMIT` entries: the planner runs for the whole
    training, and every batch brings new token counts."""
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


class CostModel:
    """Per-stage time and activation memory of a multimodal model on one device type.

    `tensor_parallel` / `sequence_parallel` describe one pipeline rank's TP group. `caption_tokens`
    is the text length a DiT cross-attends to per clip. `profile` supplies measured per-layer
    times that are preferred over the analytic ones for the modules it covers.
    """

    def __init__(
        self,
        model: MultimodalSpec,
        device: DeviceSpec,
        *,
        tensor_parallel: int = 1,
        sequence_parallel: bool = False,
        dtype_bytes: int = 2,
        profile: CostProfile | None = None,
        caption_tokens: int = 256,
        flash_attention: bool = True,
        gemm_half_rows: int = 512,
        attention_efficiency: float = 0.75,
        p2p_bandwidth: float | None = None,
    ) -> None:
        if tensor_parallel < 1 or dtype_bytes < 1 or caption_tokens < 1 or gemm_half_rows < 0:
            raise ValueError(
                "tensor_parallel, dtype_bytes and caption_tokens must be >= 1, gemm_half_rows >= 0"
            )
        if not 0 < attention_efficiency <= 1:
            raise ValueError("attention_efficiency must lie in (0, 1]")
        if profile is not None:
            profile.check_compatible(tensor_parallel=tensor_parallel)
        self.model = model
        self.device = device
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = sequence_parallel
        self.profile = profile
        self.gemm_half_rows = gemm_half_rows
        self.attention_efficiency = attention_efficiency
        self.p2p_bandwidth = p2p_bandwidth or device.ib_bandwidth
        self._ctx = _Ctx(
            tensor_parallel, sequence_parallel, dtype_bytes, caption_tokens, flash_attention
        )
        self._scale: dict[str, float] = {}
        self._layer_cache: dict[tuple, tuple[float, float, float]] = {}
        self._stage_cache: dict[tuple, StageCost] = {}  # unscaled

    # -- calibration ---------------------------------------------------------------------------

    def calibrated(self, scale_by_module: Mapping[str, float]) -> CostModel:
        """A copy whose stage times of each named module are multiplied by its measured factor."""
        for name, factor in scale_by_module.items():
            self.model.module(name)  # KeyError names the unknown module
            if not factor > 0:
                raise ValueError(f"calibration factor of module {name!r} must be > 0, got {factor}")
        copy = CostModel.__new__(CostModel)
        copy.__dict__.update(self.__dict__)
        copy._scale = {**self._scale, **{k: float(v) for k, v in scale_by_module.items()}}
        # Cached times are unscaled, so the caches can be shared.
        copy._layer_cache, copy._stage_cache = self._layer_cache, self._stage_cache
        return copy

    # -- operator pricing --------------------------------------------------------------------

    def _op_time(self, op: _Op) -> float:
        d = self.device
        if op.flops <= 0:  # an empty sub-microbatch: nothing to compute, weights still read
            return op.nbytes / d.hbm_bandwidth
        eff = d.max_efficiency
        if op.kind is not _Kind.MEM:
            eff *= op.rows / (op.rows + self.gemm_half_rows)
        if op.kind is _Kind.ATTN:
            eff *= self.attention_efficiency
        return max(op.flops / (d.peak_flops * eff), op.nbytes / d.hbm_bandwidth)

    def _tp_comm(self, spec: ModuleSpec, tokens: int) -> float:
        """One direction's TP collectives of one layer: a ring all-reduce per parallel block."""
        tp = self.tensor_parallel
        if tp == 1:
            return 0.0
        blocks = 3 if spec.kind is ModuleKind.DIT else 2
        nbytes = self._ctx.dt * tokens * spec.layer.hidden
        ring = 2 * (tp - 1) / tp * nbytes / self.device.nvlink_unidirectional
        return blocks * (self.device.p2p_latency + ring)

    def _work(self, sub: SubMicrobatch) -> _Work:
        tokens = max(sub.tokens, sub.padded_tokens)
        n = max(1, sub.num_instances)
        pairs = sub.attention_pairs if sub.attention_pairs > 0 else tokens * tokens / n
        return _Work(tokens, n, float(pairs))

    def _analytic_layer(self, spec: ModuleSpec, w: _Work) -> tuple[float, float, float]:
        """(forward, backward, attention-core forward) seconds of one layer, from the roofline."""
        ops = _layer_ops(spec, w, self._ctx)
        fwd = sum(self._op_time(o) for o in ops)
        core = sum(self._op_time(o) for o in ops if o.core)
        comm = self._tp_comm(spec, w.tokens)
        return fwd + comm, 2 * fwd + comm, core

    def _layer(self, spec: ModuleSpec, w: _Work) -> tuple[float, float, float]:
        """`_analytic_layer`, replaced by the profile's measurement where it covers `spec`."""
        key = (spec.name, w)
        times = self._layer_cache.get(key)
        if times is None:
            times = self._analytic_layer(spec, w)
            measured = self._measured(spec, w)
            if measured is not None:
                # A profile of one TP rank's shard timed alone lacks the TP all-reduces: add
                # the model's term. Scale the analytic core by how far the measurement is from
                # the analytic layer.
                comm = 0.0 if self.profile.tp_comm_included else self._tp_comm(spec, w.tokens)
                fwd, bwd = measured[0] + comm, measured[1] + comm
                times = (fwd, bwd, times[2] * fwd / times[0])
            _bounded_put(self._layer_cache, key, times)
        return times

    def _measured(self, spec: ModuleSpec, w: _Work) -> tuple[float, float] | None:
        points = self.profile.points_for(spec.name, spec.kind.value) if self.profile else None
        if not points:
            return None

        def analytic(tokens_per_instance: float) -> float:
            t = max(1, round(tokens_per_instance))
            return self._analytic_layer(spec, _Work(t, 1, float(t * t)))[0]

        return self.profile.layer_times(
            points,
            tokens_per_instance=w.tokens / w.instances,
            instances=w.instances,
            analytic=analytic,
        )

    def _extras(self, spec: ModuleSpec, chunk: ChunkSpec, w: _Work) -> float:
        """Forward seconds of the input/output layers this chunk holds."""
        ops: list[_Op] = []
        if chunk.layer_start == 0:
            ops += _input_ops(spec, w, self._ctx)
        if chunk.layer_end == spec.num_layers:
            ops += _output_ops(spec, w, self._ctx)
        return sum(self._op_time(o) for o in ops)

    # -- the planner's interface -------------------------------------------------------------

    def stage_cost(
        self, chunk: ChunkSpec, sub: SubMicrobatch, recompute: Recompute = Recompute.NONE
    ) -> StageCost:
        """Time and activation memory of `chunk` on `sub` under `recompute`."""
        w = self._work(sub)
        key = (chunk.module, chunk.layer_start, chunk.layer_end, w, recompute)
        cost = self._stage_cache.get(key)
        if cost is None:
            cost = self._stage_cost(chunk, sub, w, recompute)
            _bounded_put(self._stage_cache, key, cost)
        scale = self._scale.get(chunk.module, 1.0)
        if scale == 1.0:
            return cost
        return StageCost(cost.forward * scale, cost.backward * scale, cost.activation_bytes)

    def _stage_cost(
        self, chunk: ChunkSpec, sub: SubMicrobatch, w: _Work, recompute: Recompute
    ) -> StageCost:
        spec = self.model.module(chunk.module)
        fwd_l, bwd_l, core_l = self._layer(spec, w)
        extra = self._extras(spec, chunk, w)
        fwd = chunk.num_layers * fwd_l + extra
        bwd = chunk.num_layers * bwd_l + 2 * extra
        if recompute is Recompute.SELECTIVE:
            bwd += chunk.num_layers * core_l
        elif recompute is Recompute.FULL:
            bwd += fwd
        return StageCost(fwd, bwd, self.chunk_activation_bytes(chunk, sub, recompute))

    def chunk_activation_bytes(
        self, chunk: ChunkSpec, sub: SubMicrobatch, recompute: Recompute = Recompute.NONE
    ) -> int:
        """Bytes `chunk` holds for `sub` from the end of its forward to the end of its backward.

        FULL keeps the chunk input only (plus the DiT conditioning it passes on); the output
        head's logits are kept under every strategy, as Megatron recomputes transformer layers only.
        """
        spec = self.model.module(chunk.module)
        w, c = self._work(sub), self._ctx
        if recompute is Recompute.FULL:
            total = c.dt * w.tokens * spec.layer.hidden / c.rep
            if spec.kind is ModuleKind.DIT:
                total += c.dt * w.instances * c.caption * spec.layer.hidden / c.rep
        else:
            keep = recompute is Recompute.NONE
            total = chunk.num_layers * _layer_activation(spec, w, c, keep_core=keep)
        if chunk.layer_end == spec.num_layers:
            total += _output_activation(spec, w, c)
        return int(total)

    def transfer_time(self, nbytes: int) -> float:
        """Seconds of one point-to-point message of `nbytes` between pipeline ranks."""
        return self.device.p2p_latency + nbytes / self.p2p_bandwidth

    def module_time(self, module: str, *, instances: int, tokens: int) -> float:
        """Forward (+ backward when the module needs one) seconds of the whole module on
        `instances` instances holding `tokens` tokens, input and output layers included."""
        spec = self.model.module(module)
        sub = SubMicrobatch(module, 0, 0, 0, max(1, instances), tokens, tokens)
        c = self.stage_cost(ChunkSpec(module, 0, 0, 0, spec.num_layers), sub)
        return c.forward + (c.backward if self._needs_backward(spec) else 0.0)

    def efficiency(self, module: str, *, instances: int, tokens_per_instance: int) -> float:
        """Achieved / peak FLOP/s of one layer of `module` (forward + backward) in (0, 1]."""
        spec = self.model.module(module)
        n = max(1, instances)
        tokens = n * tokens_per_instance
        w = _Work(tokens, n, float(n * tokens_per_instance**2))
        flops = 3 * sum(o.flops for o in _layer_ops(spec, w, self._ctx))
        fwd, bwd, _ = self._layer(spec, w)
        return min(1.0, flops / ((fwd + bwd) * self.device.peak_flops))

    def layer_params(self, module: str) -> int:
        """Parameters of one transformer layer of `module` (all TP ranks together)."""
        spec = self.model.module(module)
        lay = spec.layer
        h, kv = lay.hidden, 2 * lay.kv_groups * lay.head_dim
        attn = h * (h + kv) + h * h
        mlp = h * lay.ffn * (3 if lay.gated_mlp else 2)
        params = attn + mlp + 2 * h
        if spec.kind is ModuleKind.DIT:
            params += 6 * h * h + 4 * h * h + h  # adaLN modulation, cross-attention, its norm
        return params

    def chunk_params(self, chunk: ChunkSpec) -> int:
        """Parameters of `chunk`, its input and output layers included (all TP ranks)."""
        spec = self.model.module(chunk.module)
        h = spec.layer.hidden
        total = chunk.num_layers * self.layer_params(chunk.module)
        patch = spec.patch_size**2 * spec.in_channels
        if chunk.layer_start == 0:
            total += {
                ModuleKind.VIT: patch * h,
                ModuleKind.DIT: patch * h + 256 * h + h * h + spec.cond_hidden * h,
            }.get(spec.kind, spec.vocab_size * h)
        if chunk.layer_end == spec.num_layers:
            total += {
                ModuleKind.VIT: spec.merge**2 * h * spec.out_hidden + spec.out_hidden**2,
                ModuleKind.LLM: spec.vocab_size * h,
                ModuleKind.DIT: 2 * h * h + h * patch,
            }.get(spec.kind, 0) + h
        return total

    def _needs_backward(self, spec: ModuleSpec) -> bool:
        if spec.trainable:
            return True
        return any(self._needs_backward(p) for p in self.model.producers_of(spec.name))
