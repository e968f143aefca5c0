"""Time and activation memory of a chunk on a sub-microbatch: analytic, calibratable from profiles.

Analytic model. Each layer is a list of operators (GEMMs, the attention core, memory-bound
element-wise ops), each priced by a roofline, latency = max(flops / (peak * eff), bytes / HBM).
A GEMM's efficiency grows with its row count m as cap * m / (m + gemm_half_rows): small
sub-microbatches starve the tensor cores, which is the curve DIP picks sub-microbatch sizes from.
Attention cores run at `attention_efficiency` of that cap, degraded the same way by short segments.
Backward is twice the forward (input and weight gradients); of it, the weight-gradient half of a
split backward (`StageCost.weight`) is one more pass of the layers' weight GEMMs (and of the
input / output layers), the rest (input-gradient GEMMs, the attention backward, norms and
element-wise ops, TP collectives, recomputation) is the input-gradient half. A frozen module has
no weight-gradient half: its backward (where it runs one, to pass gradients to a trainable
module upstream) is the input-gradient half alone. Tensor parallelism divides FLOPs and
weight bytes by TP and adds one NVLink all-reduce (or all-gather + reduce-scatter under sequence
parallelism: the same bytes) per parallel block in forward and again in backward.

Activation memory follows Korthikanti et al. (Reducing Activation Recomputation in Large
Transformer Models): per layer s*b*h bytes times a per-module count of stored tensors, without
dropout masks, counted as the layers really keep them for the kernels that run (`Kernels`:
flash attention or SDPA per segment, fused or composite RMSNorm; `modalities.stored`, checked
against autograd's saved tensors by `tests/test_memory_model.py`). What a layer of each kind
computes and stores is its modality's (`Modality.layer_ops`, `layer_stored`, `input_ops`,
`output_ops`, ...; the operator vocabulary is `modalities.costs`); this module prices it.

Activation offload (`MemoryPolicy.offload`): the bytes it moves and keeps are priced here, its
copies' timing against the chunk's compute in `offload_copies`.

Profiles (`load_profile`) replace the analytic per-layer times where they cover a module.

Host overheads (`overheads.HostOverheads`: per compute instruction, per posted batch of messages,
per message) ride along in `CostModel.overheads`; `stage_cost` stays compute only, and the
planner's stage graph and the simulator add the host time to their instruction durations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..modalities import check_model, modality_of
from ..modalities.costs import CostContext, Kernels, Op, OpKind, Work
from ..modelspec import ModuleSpec, MultimodalSpec
from ..parallel.shape import ONE_PROCESS, ParallelShape
from ..schedule.ir import NO_RECOMPUTE, ChunkSpec, MemoryPolicy, Recompute, SubMicrobatch
from .devices import CostProfile, DeviceSpec, load_profile
from .offload_copies import NO_COPIES, OffloadCopies, offload_copies
from .overheads import NO_OVERHEADS, HostOverheads

__all__ = [
    "CPU_KERNELS",
    "GPU_KERNELS",
    "CostModel",
    "CostProfile",
    "HostOverheads",
    "Kernels",
    "OFFLOAD_OFFERS",
    "StageCost",
    "load_profile",
]

_CACHE_LIMIT = 200_000
# Which offloads `CostModel.hidden_offload_layers` counts as hidden (its docstring); the
# planner plans a batch with each as a candidate (`PlannerConfig.offload_offer`).
OFFLOAD_OFFERS = ("paced", "drained", "chained")
GPU_KERNELS = Kernels()  # Transformer Engine / FlashAttention, fused norms
CPU_KERNELS = Kernels(attention="segments", fused_rms_norm=False)  # SDPA per segment, torch norms


@dataclass(frozen=True)
class StageCost:
    """Seconds of forward and backward (recomputation included) of one chunk on one
    sub-microbatch, and the activation bytes held from the end of its forward to the end of its
    backward. `weight`: the seconds of `backward` that are weight gradients (a split backward's
    `BackwardWeight`; the `BackwardInput` takes `backward - weight`); 0 for frozen modules.
    `weight_bytes`: the bytes held from a split backward's B to its W instead of
    `activation_bytes` (`CostModel.weight_bytes`); None: the activations (a cost without the
    split's memory model).

    Activation offload (`offload_copies`): `copy_out` link seconds of the copy out, starting
    `copy_lead` seconds into the forward (it delays nothing: the compute stream never waits for
    it); `reload` link seconds of the first reload the backward waits for, `reload_window`
    seconds into it; `reload_stall` the seconds of `backward` that are the chunk-local estimate
    of that wait (a timing of the rank's copy channels replaces it with its own); `copy_bytes`
    the offloaded bytes (what the copy out moves), `copy_residual` those of them the cost model
    expects the copy out not to have moved when the forward ends (in `activation_bytes`)."""

    forward: float
    backward: float
    activation_bytes: int
    weight: float = 0.0
    weight_bytes: int | None = None
    copy_out: float = 0.0
    copy_lead: float = 0.0
    reload: float = 0.0
    reload_window: float = 0.0
    reload_stall: float = 0.0
    copy_bytes: int = 0
    copy_residual: int = 0

    @property
    def pending_weight_bytes(self) -> int:
        """Bytes held from a split backward's B to its W."""
        return self.activation_bytes if self.weight_bytes is None else self.weight_bytes

    def scaled(self, compute: float, link: float = 1.0) -> StageCost:
        """This cost with its compute seconds (and the offsets into them) times `compute` and
        its host-link seconds (`copy_out`, `reload`) times `link`; bytes unchanged."""
        return dataclasses.replace(
            self,
            forward=self.forward * compute,
            backward=self.backward * compute,
            weight=self.weight * compute,
            copy_out=self.copy_out * link,
            copy_lead=self.copy_lead * compute,
            reload=self.reload * link,
            reload_window=self.reload_window * compute,
            reload_stall=self.reload_stall * compute,
        )

    @property
    def backward_input(self) -> float:
        """Seconds of the input-gradient half of a split backward."""
        return self.backward - self.weight


def _bounded_put(cache: dict, key: tuple, value: object) -> None:
    """Memoise, forgetting everything past `_CACHE_LIMIT` entries: the planner runs for the whole
    training, and every batch brings new token counts."""
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


class CostModel:
    """Per-stage time and activation memory of a multimodal model on one device type.

    `shape`: the run's parallel shape (`parallel.ParallelShape`); the model prices one rank of
    its tensor-parallel group (TP, and whether sequence parallelism is in effect). `kernels`:
    which attention and norm kernels the chunks run (what they keep for backward differs).
    A DiT sub-microbatch cross-attends to its own clips' captions
    (`SubMicrobatch.context_tokens`); `caption_tokens` per clip stands in only where a
    sub-microbatch does not carry them (per-module estimates of placement and sizing).
    `profile` supplies measured per-layer times that are preferred over the analytic ones for
    the modules it covers. `overheads`: the runtime's host time per instruction, batch and
    message (`overheads.py`; not part of `stage_cost`).
    """

    def __init__(
        self,
        model: MultimodalSpec,
        device: DeviceSpec,
        *,
        shape: ParallelShape = ONE_PROCESS,
        dtype_bytes: int = 2,
        profile: CostProfile | None = None,
        caption_tokens: int = 256,
        kernels: Kernels = GPU_KERNELS,
        gemm_half_rows: int = 512,
        attention_efficiency: float = 0.75,
        p2p_bandwidth: float | None = None,
        overheads: HostOverheads = NO_OVERHEADS,
    ) -> None:
        if dtype_bytes < 1 or caption_tokens < 1 or gemm_half_rows < 0:
            raise ValueError("dtype_bytes and caption_tokens must be >= 1, gemm_half_rows >= 0")
        if not 0 < attention_efficiency <= 1:
            raise ValueError("attention_efficiency must lie in (0, 1]")
        if profile is not None:
            profile.check_compatible(shape)
        self.model = check_model(model)
        self.device = device
        self.shape = shape
        self.profile = profile
        self.gemm_half_rows = gemm_half_rows
        self.attention_efficiency = attention_efficiency
        self.p2p_bandwidth = p2p_bandwidth or device.ib_bandwidth
        self.caption_tokens = caption_tokens
        self.kernels = kernels
        self.overheads = overheads
        self._ctx = CostContext(shape.tp, shape.sequence_parallel, dtype_bytes, kernels)
        self._scale: dict[str, float] = {}
        self._layer_cache: dict[tuple, tuple[float, float, float]] = {}
        self._weight_cache: dict[tuple, float] = {}  # weight-gradient share of a backward
        self._stored_cache: dict[tuple, float] = {}  # a whole layer's stored bytes
        self._stage_cache: dict[tuple, StageCost] = {}  # unscaled

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel size priced (`shape.tp`)."""
        return self.shape.tp

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
        copy._weight_cache = self._weight_cache
        copy._stored_cache = self._stored_cache
        return copy

    def with_overheads(self, overheads: HostOverheads) -> CostModel:
        """A copy charging `overheads` (host time per instruction, batch and message)."""
        copy = CostModel.__new__(CostModel)
        copy.__dict__.update(self.__dict__)
        copy.overheads = overheads
        return copy

    # -- operator pricing --------------------------------------------------------------------

    def _op_time(self, op: Op) -> float:
        d = self.device
        if op.flops <= 0:  # an empty sub-microbatch: nothing to compute, weights still read
            return op.nbytes / d.hbm_bandwidth
        eff = d.max_efficiency
        if op.kind is not OpKind.MEM:
            eff *= op.rows / (op.rows + self.gemm_half_rows)
        if op.kind is OpKind.ATTN:
            eff *= self.attention_efficiency
        return max(op.flops / (d.peak_flops * eff), op.nbytes / d.hbm_bandwidth)

    def _tp_comm(self, spec: ModuleSpec, tokens: int) -> float:
        """One direction's TP collectives of one layer: a ring all-reduce per parallel block."""
        tp = self.tensor_parallel
        if tp == 1:
            return 0.0
        blocks = modality_of(spec).tp_blocks
        nbytes = self._ctx.dt * tokens * spec.layer.hidden
        ring = 2 * (tp - 1) / tp * nbytes / self.device.nvlink_unidirectional
        return blocks * (self.device.p2p_latency + ring)

    def _work(self, sub: SubMicrobatch) -> Work:
        tokens = max(sub.tokens, sub.padded_tokens)
        n = max(1, sub.num_instances)
        pairs = sub.attention_pairs if sub.attention_pairs > 0 else tokens * tokens / n
        context, context_pairs = sub.context_tokens, float(sub.context_pairs)
        cross = modality_of(self.model.module(sub.module)).cross_attends
        if cross and context <= 0:  # a sub-microbatch that does not say (module_time, ...)
            context, context_pairs = n * self.caption_tokens, float(tokens * self.caption_tokens)
        if context_pairs <= 0:
            context_pairs = float(tokens * context / n)
        return Work(tokens, n, float(pairs), context, context_pairs, sub.input_tokens)

    def _analytic_layer(self, spec: ModuleSpec, w: Work) -> tuple[float, float, float]:
        """(forward, backward, attention-core forward) seconds of one layer, from the roofline."""
        ops = modality_of(spec).layer_ops(spec, w, self._ctx)
        fwd = sum(self._op_time(o) for o in ops)
        core = sum(self._op_time(o) for o in ops if o.core)
        comm = self._tp_comm(spec, w.tokens)
        return fwd + comm, 2 * fwd + comm, core

    def _layer(self, spec: ModuleSpec, w: Work) -> tuple[float, float, float]:
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

    def _measured(self, spec: ModuleSpec, w: Work) -> tuple[float, float] | None:
        points = self.profile.points_for(spec.name, spec.kind) if self.profile else None
        if not points:
            return None

        def analytic(tokens_per_instance: float) -> float:
            t = max(1, round(tokens_per_instance))
            return self._analytic_layer(
                spec, self._work(SubMicrobatch(spec.name, 0, 0, 0, 1, t, t, t * t))
            )[0]

        return self.profile.layer_times(
            points,
            tokens_per_instance=w.tokens / w.instances,
            instances=w.instances,
            analytic=analytic,
        )

    def _extras(self, spec: ModuleSpec, chunk: ChunkSpec, w: Work) -> float:
        """Forward seconds of the input/output layers this chunk holds."""
        modality, ops = modality_of(spec), []
        if chunk.layer_start == 0:
            ops += modality.input_ops(spec, w, self._ctx)
        if chunk.layer_end == spec.num_layers:
            ops += modality.output_ops(spec, w, self._ctx)
        return sum(self._op_time(o) for o in ops)

    # -- the planner's interface -------------------------------------------------------------

    def stage_cost(
        self,
        chunk: ChunkSpec,
        sub: SubMicrobatch,
        memory: MemoryPolicy = NO_RECOMPUTE,
    ) -> StageCost:
        """Time and activation memory of `chunk` on `sub` under the memory policy `memory`
        (recomputation, see `Recompute`, offload and cheap module recomputation): the plan's
        one pricing of a policy."""
        w = self._work(sub)
        key = (chunk.module, chunk.layer_start, chunk.layer_end, w, memory)
        cost = self._stage_cache.get(key)
        if cost is None:
            cost = self._stage_cost(chunk, sub, w, memory)
            _bounded_put(self._stage_cache, key, cost)
        scale = self._scale.get(chunk.module, 1.0)
        # Calibration measures compute: the host link's seconds stay as priced.
        return cost if scale == 1.0 else cost.scaled(scale)

    def _stage_cost(
        self, chunk: ChunkSpec, sub: SubMicrobatch, w: Work, policy: MemoryPolicy
    ) -> StageCost:
        recompute, layers = policy.method, policy.layers
        spec = self.model.module(chunk.module)
        fwd_l, bwd_l, core_l = self._layer(spec, w)
        extra = self._extras(spec, chunk, w)
        n = chunk.num_layers
        fwd = n * fwd_l + extra
        bwd = n * bwd_l + 2 * extra
        # What the backward recomputes: attention cores, the whole chunk, its first N layers
        # (block), or every layer (uniform); Megatron never recomputes input/output layers.
        bwd += {
            Recompute.SELECTIVE: n * core_l,
            Recompute.FULL: fwd,
            Recompute.BLOCK: min(layers, n) * fwd_l,
            Recompute.UNIFORM: n * fwd_l,
        }.get(recompute, 0.0)
        bwd += self._plain_layers(n, policy) * self._modules_time(spec, w, policy.modules)
        nbytes = self.chunk_activation_bytes(chunk, sub, policy)
        copies = NO_COPIES
        if policy.offload:
            copies = self._offload_copies(spec, chunk, w, policy, fwd_l, bwd_l)
            bwd += copies.reload_stall + copies.later_stall
            nbytes += int(copies.residual)
        # The weight GEMMs once more; the input / output layers' own.
        weight = n * self._weight_share(spec, w) * bwd_l + extra
        if not spec.trainable:  # no weight gradients: the backward is its input half alone
            cost = StageCost(fwd, bwd - weight, nbytes, 0.0)
        elif not self.inputs_need_gradients(chunk, sub):
            # Nothing upstream waits for an input gradient: the runtime's split backward runs
            # the whole backward in W (`runtime/backward_split.py`), and B frees nothing.
            cost = StageCost(fwd, bwd, nbytes, bwd, nbytes)
        else:
            cost = StageCost(fwd, bwd, nbytes, weight, self.weight_bytes(chunk, sub, policy))
        return _carrying(cost, copies) if policy.offload else cost

    def inputs_need_gradients(self, chunk: ChunkSpec, sub: SubMicrobatch) -> bool:
        """Whether `chunk`'s inputs on `sub` need gradients: a later chunk's of a trainable
        module, or any chunk's whose module receives hand-overs (`sub.input_tokens`) from a
        module whose output needs gradients. A first chunk fed by data alone (a ViT's patches,
        a sub-microbatch of text without images, a frozen encoder's output) has none."""
        model = self.model
        producers = model.producers_of(chunk.module)
        handed = sub.input_tokens > 0 and any(
            model.output_needs_gradients(p.name) for p in producers
        )
        return handed or (chunk.index > 0 and model.module(chunk.module).trainable)

    @staticmethod
    def _plain_layers(n: int, policy: MemoryPolicy) -> int:
        """How many of a chunk's `n` layers keep their activations under `policy` (where its
        cheap module recomputation applies)."""
        if policy.method in (Recompute.FULL, Recompute.UNIFORM):
            return 0
        return n - (min(policy.layers, n) if policy.method is Recompute.BLOCK else 0)

    def _modules_time(self, spec: ModuleSpec, w: Work, modules: tuple[str, ...]) -> float:
        """Seconds one layer's backward adds to recompute `modules` (their forward operators,
        `Modality.recompute_ops`: memory-bound passes priced at the device's HBM bandwidth)."""
        modality = modality_of(spec)
        ops = [op for m in modules for op in modality.recompute_ops(spec, w, self._ctx, m)]
        return sum(self._op_time(o) for o in ops)

    def _modules_saved(self, spec: ModuleSpec, w: Work, modules: tuple[str, ...]) -> float:
        """Bytes one layer keeps less when `modules` are recomputed (`Modality.recompute_saved`)."""
        c, modality = self._ctx, modality_of(spec)
        return sum(
            modality.recompute_saved(spec, w, c, m).nbytes(spec.layer.hidden, w, c) for m in modules
        )

    def _weight_share(self, spec: ModuleSpec, w: Work) -> float:
        """The weight-gradient share of a layer's analytic backward: its weight GEMMs (as long
        as in forward) over the whole backward. Applied to measured layers too."""
        key = (spec.name, w)
        share = self._weight_cache.get(key)
        if share is None:
            ops = modality_of(spec).layer_ops(spec, w, self._ctx)
            gemms = sum(self._op_time(o) for o in ops if _deferred_gemm(o))
            _, bwd, _ = self._analytic_layer(spec, w)
            share = gemms / bwd if bwd > 0 else 0.0
            _bounded_put(self._weight_cache, key, share)
        return share

    def grad_reduce_time(self, chunk: ChunkSpec, data_parallel: int) -> float:
        """Seconds of `chunk`'s data-parallel gradient reduction: a ring all-reduce (or the
        distributed optimizer's reduce-scatter, half the bytes; priced as the all-reduce) of
        its fp32 gradients, one TP rank's shard, over the inter-node bandwidth. 0 without data
        parallelism or for a frozen module."""
        spec = self.model.module(chunk.module)
        if data_parallel <= 1 or not spec.trainable:
            return 0.0
        nbytes = 4 * self.chunk_params(chunk) / self.tensor_parallel
        ring = 2 * (data_parallel - 1) / data_parallel * nbytes / self.device.ib_bandwidth
        return self.device.p2p_latency + ring

    def offloaded_bytes(self, chunk: ChunkSpec, sub: SubMicrobatch, policy: MemoryPolicy) -> int:
        """Bytes `policy` moves to host memory (and back) for `chunk` on `sub`."""
        spec = self.model.module(chunk.module)
        return int(self._offloaded(spec, chunk, self._work(sub), policy))

    def _offloaded(self, spec, chunk: ChunkSpec, w, policy: MemoryPolicy) -> float:
        """Stored bytes of the offloaded layers, less a received hidden state the runtime holds
        anyway (the first offloaded layer's input when it is the chunk's first layer)."""
        k = min(policy.offload, chunk.num_layers - policy.offload_start)
        if k <= 0:
            return 0.0
        c = self._ctx
        whole = self._layer_stored_bytes(spec, w)
        held = 0.0
        if policy.offload_start == 0 and chunk.layer_start > 0:  # the received hidden state
            held = c.dt * w.tokens * spec.layer.hidden / c.rep
        return k * whole - held

    def _layer_stored_bytes(self, spec, w) -> float:
        """Bytes one whole layer of `spec` stores for `w` (memoized: offload asks per policy)."""
        key = (spec.name, w)
        found = self._stored_cache.get(key)
        if found is None:
            c = self._ctx
            found = modality_of(spec).layer_stored(spec, w, c).nbytes(spec.layer.hidden, w, c)
            _bounded_put(self._stored_cache, key, found)
        return found

    def _offload_copies(
        self,
        spec,
        chunk: ChunkSpec,
        w,
        policy: MemoryPolicy,
        fwd_l: float,
        bwd_l: float,
        *,
        paced: bool = True,
    ) -> OffloadCopies:
        """The copies of `policy`'s offload for `chunk` on `w` (`offload_copies`), beside the
        chunk's pipeline message, at the GPU's share of the host link (`paced=False`: the
        reloads chained one layer ahead, for `hidden_offload_layers`' "chained" offer only)."""
        c = self._ctx
        share = self.device.host_link_share
        message = c.dt * w.tokens * spec.layer.hidden / c.rep / share + self.device.p2p_latency
        return offload_copies(
            layers=chunk.num_layers,
            start=policy.offload_start,
            offloaded=min(policy.offload, chunk.num_layers - policy.offload_start),
            moved=self._offloaded(spec, chunk, w, policy),
            message=message,
            link=share,
            fwd_layer=fwd_l,
            bwd_layer=bwd_l,
            paced=paced,
        )

    def hidden_offload_layers(
        self,
        chunk: ChunkSpec,
        sub: SubMicrobatch,
        recompute: MemoryPolicy = NO_RECOMPUTE,
        *,
        offer: str = "paced",
    ) -> int:
        """The most layers `chunk` can offload on `sub` after `recompute`'s recomputation (NONE
        or BLOCK N) that `offer` (`OFFLOAD_OFFERS`) counts as hidden; 0 where not even one is:
        the offload worth offering beside recomputation. "paced": the reloads hide behind the
        backward as the runtime paces them (no wait) and the copy out leaves at most one layer's
        bytes on the device when the forward ends (more would move no more bytes off the device
        at the forward's end, only load the copy channel). "drained": the same, but the copy out
        ends within the forward (it never queues behind the previous forward's on the rank's
        copy channel, which the memory pass does not see). "chained": as "paced", but the reloads
        hide even chained one layer ahead (each behind one layer's backward, issue 24g's offer):
        fewer layers where a reload outlasts a layer's backward, whose plans the paced runtime
        runs the same or faster."""
        if offer not in OFFLOAD_OFFERS:
            raise ValueError(f"offload offer {offer!r}: one of {OFFLOAD_OFFERS}")
        spec, w = self.model.module(chunk.module), self._work(sub)
        fwd_l, bwd_l, _ = self._layer(spec, w)
        best = 0
        # more layers: more link, less overlap
        for k in range(1, chunk.num_layers - recompute.offload_start + 1):
            policy = recompute.with_offload(k)
            paced = offer != "chained"
            copies = self._offload_copies(spec, chunk, w, policy, fwd_l, bwd_l, paced=paced)
            left = 0.0 if offer == "drained" else copies.layer_bytes
            if copies.reload_stall or copies.later_stall or copies.residual > left:
                break
            best = k
        return best

    def chunk_activation_bytes(
        self,
        chunk: ChunkSpec,
        sub: SubMicrobatch,
        memory: MemoryPolicy = NO_RECOMPUTE,
    ) -> int:
        """Bytes `chunk` holds for `sub` under `memory` from the end of its forward to the end
        of its backward on the device (offloaded layers' saved tensors live in host memory;
        modules recomputed in the layers that keep their activations keep less).

        Every chunk keeps the messages it received (the producers' hand-overs, or the previous
        chunk's output) until its backward; FULL keeps nothing else (the runtime recomputes the
        whole chunk call, output layers included). Otherwise the layers' stored tensors (less
        the attention cores' under SELECTIVE; BLOCK N and UNIFORM N: `_layers_stored`), what all
        its layers share, and the input / output layers' own; a received hidden state is the
        first layer's input, counted once. The chunk's own output is not counted: sent to another
        rank, its data is freed once the send completed (the runtime keeps only its autograd
        node, as Megatron's `deallocate_output_tensor` does); handed over on the rank, it is the
        next chunk's received message.
        """
        spec = self.model.module(chunk.module)
        modality, w, c = modality_of(spec), self._work(sub), self._ctx
        first, last = chunk.layer_start == 0, chunk.layer_end == spec.num_layers
        received = modality.received_bytes(spec, w, c, first=first)
        recompute, layers = memory.method, memory.layers
        if recompute is Recompute.FULL:
            return int(received)
        total = self._layers_stored(spec, chunk.num_layers, w, recompute, layers, memory.modules)
        if first:
            total += (
                received + modality.chunk_stored(spec, w, c) + modality.input_stored(spec, w, c)
            )
        elif chunk.num_layers:  # the received hidden state (and conditioning) are the layers'
            total += received - modality.received_bytes(spec, w, c, first=False)
            total += modality.chunk_stored(spec, w, c)
        else:
            total += received
        if last:
            total += modality.output_stored(spec, w, c)
        if memory.offload:
            total -= self._offloaded(spec, chunk, w, memory)
        return int(total)

    def weight_bytes(
        self,
        chunk: ChunkSpec,
        sub: SubMicrobatch,
        memory: MemoryPolicy = NO_RECOMPUTE,
    ) -> int:
        """Bytes a pending W of `chunk` on `sub` under `memory` holds from its `BackwardInput` to its
        `BackwardWeight` (`runtime/backward_split.py`): every deferred (column-parallel) weight
        GEMM's activation input and recorded output gradient, in every layer (a recomputed
        layer's inputs are recomputed in W, but the W's peak has them); what recomputation keeps
        (checkpoint inputs); the received messages and the input / output layers' stored
        tensors, with their deferred GEMMs' inputs and output gradients. What only B needs
        (attention core, activation functions, rotary, norms and row-parallel GEMMs: their
        weight gradients are done in B, `modalities.costs.gemm`) is freed after B. 0 for a
        frozen module (no W)."""
        spec = self.model.module(chunk.module)
        if not spec.trainable:
            return 0
        if not self.inputs_need_gradients(chunk, sub):  # B frees nothing: W keeps it all
            return self.chunk_activation_bytes(chunk, sub, memory)
        w, c = self._work(sub), self._ctx
        modality = modality_of(spec)
        n, recompute = chunk.num_layers, memory.method
        plain = self._plain_layers(n, memory)
        total = self.chunk_activation_bytes(chunk, sub, memory)
        if recompute is not Recompute.FULL:
            keep = recompute if recompute is Recompute.SELECTIVE else Recompute.NONE
            total -= self._layers_stored(spec, plain, w, keep, 0, memory.modules)
        total += n * _weight_gemm_bytes(modality.layer_ops(spec, w, c))
        if chunk.layer_start == 0:
            total += _weight_gemm_bytes(modality.input_ops(spec, w, c))
        if chunk.layer_end == spec.num_layers:
            total += _weight_gemm_bytes(modality.output_ops(spec, w, c))
        return int(total)

    def _layers_stored(
        self, spec, n: int, w, recompute: Recompute, layers: int, modules: tuple[str, ...] = ()
    ) -> float:
        """Bytes the chunk's `n` transformer layers keep: all their stored tensors (less the
        attention cores' under SELECTIVE), except for Megatron's partial recomputation: BLOCK N
        checkpoints the first N layers one by one (each keeps its input hidden state), UNIFORM N
        checkpoints groups of N layers (each group keeps its input). The layers that keep their
        activations keep less by the recomputed `modules`' share."""
        c = self._ctx
        stored = modality_of(spec).layer_stored(spec, w, c)
        whole = stored.nbytes(
            spec.layer.hidden, w, c, keep_core=recompute is not Recompute.SELECTIVE
        )
        if modules and recompute not in (Recompute.FULL, Recompute.UNIFORM):
            whole -= self._modules_saved(spec, w, tuple(modules))
        hidden = c.dt * w.tokens * spec.layer.hidden / c.rep  # a checkpoint's input
        if recompute is Recompute.BLOCK:
            k = min(layers, n)
            return k * hidden + (n - k) * whole
        if recompute is Recompute.UNIFORM:
            return -(-n // layers) * hidden
        return n * whole

    def transfer_time(self, nbytes: int) -> float:
        """Seconds of one point-to-point message of `nbytes` between pipeline ranks."""
        return self.device.p2p_latency + nbytes / self.p2p_bandwidth

    def module_time(
        self, module: str, *, instances: int, tokens: int, context_tokens: int = 0
    ) -> float:
        """Forward (+ backward when the module needs one) seconds of the whole module on
        `instances` instances holding `tokens` tokens (cross-attending to `context_tokens`;
        0: `caption_tokens` per instance), input and output layers included."""
        spec = self.model.module(module)
        sub = SubMicrobatch(
            module, 0, 0, 0, max(1, instances), tokens, tokens, context_tokens=context_tokens
        )
        c = self.stage_cost(ChunkSpec(module, 0, 0, 0, spec.num_layers), sub)
        return c.forward + (c.backward if self.needs_backward(module) else 0.0)

    def efficiency(
        self, module: str, *, instances: int, tokens_per_instance: int, host_seconds: float = 0.0
    ) -> float:
        """Achieved / peak FLOP/s of one layer of `module` (forward + backward) in (0, 1];
        `host_seconds` per layer count as time that computes nothing (the runtime's share of
        host overhead the layer carries)."""
        spec = self.model.module(module)
        n = max(1, instances)
        tokens = n * tokens_per_instance
        w = self._work(
            SubMicrobatch(module, 0, 0, 0, n, tokens, tokens, n * tokens_per_instance**2)
        )
        flops = 3 * sum(o.flops for o in modality_of(spec).layer_ops(spec, w, self._ctx))
        fwd, bwd, _ = self._layer(spec, w)
        return min(1.0, flops / ((fwd + bwd + host_seconds) * self.device.peak_flops))

    def layer_params(self, module: str) -> int:
        """Parameters of one transformer layer of `module` (all TP ranks together)."""
        spec = self.model.module(module)
        return modality_of(spec).layer_params(spec)

    def chunk_params(self, chunk: ChunkSpec) -> int:
        """Parameters of `chunk`, its input and output layers included (all TP ranks)."""
        spec = self.model.module(chunk.module)
        modality = modality_of(spec)
        total = chunk.num_layers * modality.layer_params(spec)
        if chunk.layer_start == 0:
            total += modality.input_params(spec)
        if chunk.layer_end == spec.num_layers:
            total += modality.output_params(spec)
        return total

    def needs_backward(self, module: str) -> bool:
        """Whether `module` runs a backward: it is trainable, or a trainable module feeds it."""
        spec = self.model.module(module)
        if spec.trainable:
            return True
        return any(self.needs_backward(p.name) for p in self.model.producers_of(module))


def _weight_gemm_bytes(ops: list[Op]) -> float:
    """What the weight GEMMs among `ops` hold for a pending W (`Op.w_held`)."""
    return sum(op.w_held for op in ops if _deferred_gemm(op))


def _deferred_gemm(op: Op) -> bool:
    """Whether a split backward defers `op`'s weight gradient to W: a weight GEMM that holds
    something for it (`modalities.costs.gemm`: column-parallel ones, and row-parallel ones
    under Transformer Engine's queue)."""
    return op.kind is OpKind.GEMM and not op.core and op.w_held > 0


def _carrying(cost: StageCost, copies: OffloadCopies) -> StageCost:
    """`cost` carrying `copies` (its times and bytes already include them)."""
    return dataclasses.replace(
        cost,
        copy_out=copies.copy_out,
        copy_lead=copies.copy_lead,
        reload=copies.reload,
        reload_window=copies.reload_window,
        reload_stall=copies.reload_stall,
        copy_bytes=int(copies.moved),
        copy_residual=int(copies.residual),
    )
