"""The stock Megatron configurations an expert would tune, simulated on the same work as DIP.

A configuration is a static placement (`static_baselines`: the encoder on the first stage, one
layer list cut by parameters or by cost; one model chunk per rank = 1F1B, two = interleaved)
with Megatron's activation-recomputation flags, the same on every stage as Megatron's flags
impose: none, selective, full (the whole stage), `--recompute-method block` with N layers,
`--recompute-method uniform` with N-layer groups. The strongest configuration of a run is the
fastest whose activations fit the device on every batch (`strongest`): a Megatron user fixes the
placement and the flags for the whole run, so a configuration that overflows on one batch is
out, and the block method's N is the smallest that fits them all.

With `offload`, the grid also holds Megatron-Core's fine-grained activation offloading (the one
Megatron allows with pipeline parallelism; its layer-level `cpu_offloading` refuses PP): the same
offload on every stage, priced like DIP's on the shared host link. Megatron names modules of
every layer (`--offload-modules`); the grid offloads whole layers, K per chunk (the first K,
clamped to the chunk), which spans the same range of bytes moved per stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..schedule.baselines import build_megatron_plan, check_interleaved_args
from ..schedule.engine import ChannelFn, single_channel
from ..schedule.ir import (
    NO_RECOMPUTE,
    BatchTotals,
    Forward,
    MemoryPolicy,
    Placement,
    Plan,
    Program,
    Recompute,
)
from ..schedule.passes import TensorFn
from .overheads import host_overheads
from .simulator import SimResult, simulate
from .static_baselines import StaticPipeline

_BLOCK_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def mode_label(mode: MemoryPolicy) -> str:
    """ "none", "selective", "full", "block 8", "uniform 1" (Megatron's flag values), "offload 4"
    (fine-grained offload of 4 layers per chunk), "selective (core_attn, layernorm)"
    (Megatron's `--recompute-modules`)."""
    method, layers, offload, modules = mode.method, mode.layers, mode.offload, mode.modules
    label = f"{method.value} {layers}" if method.takes_layers else method.value
    if modules:
        names = ("core_attn",) if method is Recompute.SELECTIVE else ()
        label = f"selective ({', '.join(names + modules)})"
    if not offload:
        return label
    return f"offload {offload}" if method is Recompute.NONE else f"{label} + offload {offload}"


def max_chunk_layers(placement: Placement) -> int:
    """Layers of the placement's largest chunk (the largest N a recompute flag can act on)."""
    return max(c.num_layers for m in placement.modules for c in m.chunks)


def recompute_modes(placement: Placement, *, offload: bool = False) -> list[MemoryPolicy]:
    """Megatron's recompute settings worth trying on `placement`: none, selective, full, block N
    on a grid up to the largest chunk, uniform with 1-layer groups (Megatron's default) and with
    one group per chunk; with `offload` also fine-grained offload of K layers per chunk on the
    same grid, alone and after block recomputation of one layer (module docstring). Megatron's
    selective recomputation also takes `--recompute-modules layernorm` (its norms keep only
    their inputs; Megatron refuses it where Transformer Engine fuses the norm into linear_qkv,
    which the cost model's GPU kernels do not assume): with core_attn (Megatron's default
    module) and alone. Its dense MLP activation has no such switch (only experts' "moe_act")."""
    top = max_chunk_layers(placement)
    blocks = sorted({n for n in _BLOCK_GRID if n < top} | {top})
    modes: list[MemoryPolicy] = [
        NO_RECOMPUTE,
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.FULL, 0),
        *(MemoryPolicy(Recompute.BLOCK, n) for n in blocks),
        *dict.fromkeys([MemoryPolicy(Recompute.UNIFORM, 1), MemoryPolicy(Recompute.UNIFORM, top)]),
        MemoryPolicy(Recompute.SELECTIVE, 0, 0, ("layernorm",)),
        MemoryPolicy(Recompute.NONE, 0, 0, ("layernorm",)),
    ]
    if offload and top > 0:
        modes += [MemoryPolicy(Recompute.NONE, 0, k) for k in blocks]
        modes += [MemoryPolicy(Recompute.BLOCK, 1, k) for k in blocks if k < top]
    return modes


def with_recompute(plan: Plan, mode: MemoryPolicy) -> Plan:
    """`plan` with every forward using memory policy `mode`, its offload clamped to each
    chunk's layers."""

    def fitted(stage) -> dict:
        return {
            "memory": mode.fitted(
                plan.placement.module(stage.module).chunks[stage.chunk].num_layers
            )
        }

    programs = tuple(
        Program(
            p.rank,
            tuple(
                dataclasses.replace(i, **fitted(i.stage)) if isinstance(i, Forward) else i
                for i in p.instructions
            ),
        )
        for p in plan.programs
    )
    return dataclasses.replace(plan, programs=programs)


def schedule_name(num_model_chunks: int) -> str:
    """Megatron's schedule of a static placement with `num_model_chunks` per rank, as the study
    names it: "1f1b", "interleaved" (2 chunks, Megatron's usual virtual pipeline), "interleaved
    v3", ..."""
    if num_model_chunks == 1:
        return "1f1b"
    return "interleaved" if num_model_chunks == 2 else f"interleaved v{num_model_chunks}"


@dataclass(frozen=True)
class StockResult:
    """One stock configuration simulated on one batch (replica)."""

    pipeline: str  # the static placement's name
    schedule: str  # `schedule_name`, or "zb-h1"
    mode: MemoryPolicy
    sim: SimResult
    fits: bool

    @property
    def key(self) -> tuple[str, str, MemoryPolicy]:
        return self.pipeline, self.schedule, self.mode

    @property
    def label(self) -> str:
        """E.g. "megatron interleaved (cost-split), block 8"."""
        return f"megatron {self.schedule} ({self.pipeline}), {mode_label(self.mode)}"


@dataclass(frozen=True)
class StockWork:
    """What every stock configuration of one batch (replica) runs: the microbatches, each
    module in one sub-microbatch, and the batch's denominators."""

    submicrobatches: tuple
    dependencies: tuple
    microbatches: tuple
    totals: BatchTotals
    iteration: int


def megatron_plan(
    pipe: StaticPipeline, work: StockWork, mode: MemoryPolicy, *, cost_model, tensors: TensorFn
) -> Plan:
    """Megatron's order on `pipe` with `mode` on every stage; messages placed by that mode's
    stage durations."""
    sub_of = {s.work: s for s in work.submicrobatches}
    host = host_overheads(cost_model)

    def duration(rank: int, ins) -> float:
        chunk = pipe.placement.module(ins.stage.module).chunks[ins.stage.chunk]
        c = cost_model.stage_cost(chunk, sub_of[ins.stage.work], mode)
        fwd, bwd = host.instruction_times(c.forward, c.backward)
        return max(fwd if isinstance(ins, Forward) else bwd, 1e-12)

    plan = build_megatron_plan(
        placement=pipe.placement,
        stage_units=pipe.stage_units,
        submicrobatches=list(work.submicrobatches),
        dependencies=list(work.dependencies),
        microbatches=list(work.microbatches),
        totals=work.totals,
        num_model_chunks=pipe.num_model_chunks,
        tensors=tensors,
        iteration=work.iteration,
        compute_time=duration,
    )
    return with_recompute(plan, mode)


def fits(sim: SimResult, limits: Sequence[float]) -> bool:
    """Whether every rank's simulated activation peak stays within its limit."""
    return peaks_fit(sim.peak_activation_bytes, limits)


def peaks_fit(peaks: Sequence[float], limits: Sequence[float]) -> bool:
    """Whether every rank's activation peak stays within its limit."""
    return all(p <= lim for p, lim in zip(peaks, limits))


def evaluate_stock(
    pipe: StaticPipeline,
    work: StockWork,
    *,
    cost_model,
    tensors: TensorFn,
    limits: Sequence[float],
    modes: Sequence[MemoryPolicy] | None = None,
    channel: ChannelFn = single_channel,
    offload: bool = False,
) -> list[StockResult]:
    """Every recompute mode (default `recompute_modes`, with Megatron's offloading when
    `offload`) of `pipe` simulated on `work`; none
    when Megatron cannot run the schedule on it (interleaving needs at least as many
    microbatches as pipeline ranks, and a last group of 0 or at least PP microbatches)."""
    schedule = schedule_name(pipe.num_model_chunks)
    if pipe.num_model_chunks > 1:
        try:  # Megatron's group size is PP; it refuses some microbatch counts
            p = pipe.placement.num_ranks
            check_interleaved_args(
                num_ranks=p, num_microbatches=len(work.microbatches), microbatch_group_size=p
            )
        except ValueError:
            return []
    out = []
    for mode in modes if modes is not None else recompute_modes(pipe.placement, offload=offload):
        plan = megatron_plan(pipe, work, mode, cost_model=cost_model, tensors=tensors)
        sim = simulate(plan, cost_model, channel=channel)
        out.append(StockResult(pipe.name, schedule, mode, sim, fits(sim, limits)))
    return out


def fastest(results: Sequence[StockResult]) -> StockResult:
    """The fastest result that fits (the fastest of all when none fits)."""
    fitting = [r for r in results if r.fits]
    return min(fitting or results, key=lambda r: r.sim.iteration_time)


def strongest(per_batch: Sequence[Sequence[StockResult]]) -> tuple[str, str, MemoryPolicy] | None:
    """The configuration (pipeline, schedule, mode) that runs and fits on every batch with the
    least total simulated time; None when no configuration does."""
    totals: dict[tuple, float] = {}
    fitting: dict[tuple, int] = {}
    for results in per_batch:
        for r in results:
            totals[r.key] = totals.get(r.key, 0.0) + r.sim.iteration_time
            fitting[r.key] = fitting.get(r.key, 0) + r.fits
    candidates = [k for k in totals if fitting[k] == len(per_batch)]
    return min(candidates, key=lambda k: (totals[k], k[2].layers)) if candidates else None


def best_fitting_mode(
    plan_for: Callable[[MemoryPolicy], Plan],
    *,
    layers: int,
    cost_model,
    limits: Sequence[float],
    channel: ChannelFn,
    stage_times: Callable[[MemoryPolicy], Sequence[float]] | None = None,
    fits_of: Callable[[MemoryPolicy], bool] | None = None,
) -> tuple[Plan, SimResult] | None:
    """The fastest uniform recompute setting of a plan family that fits, searched cheaply: no
    recompute if it fits, else the smallest block N that fits (binary search: a larger N holds
    less and recomputes more) against selective, uniform (one group per chunk) and full.
    `fits_of(mode)`: whether the family's plan under `mode` fits, answered without simulating
    it (`simulator.activation_peaks`: the peaks depend on the order alone); then only the modes
    that fit are simulated. `stage_times(mode)`: the family's compute durations under `mode`,
    stage by stage in one fixed order; a mode no faster on any stage than another that fits is
    then not simulated (in a fixed order, longer durations never finish sooner)."""
    tried: dict[MemoryPolicy, tuple[Plan, SimResult]] = {}

    def run(mode: MemoryPolicy) -> tuple[Plan, SimResult]:
        if mode not in tried:
            plan = plan_for(mode)
            tried[mode] = plan, simulate(plan, cost_model, channel=channel)
        return tried[mode]

    def fit(mode: MemoryPolicy) -> bool:
        return fits_of(mode) if fits_of is not None else fits(run(mode)[1], limits)

    if fit(NO_RECOMPUTE):
        return run(NO_RECOMPUTE)
    fitting: list[MemoryPolicy] = []
    lo, hi = 1, layers
    if fit(MemoryPolicy(Recompute.BLOCK, hi)):
        while lo < hi:
            mid = (lo + hi) // 2
            if fit(MemoryPolicy(Recompute.BLOCK, mid)):
                hi = mid
            else:
                lo = mid + 1
        fitting.append(MemoryPolicy(Recompute.BLOCK, lo))
    for mode in (
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.UNIFORM, layers),
        MemoryPolicy(Recompute.FULL, 0),
    ):
        if fit(mode) and (stage_times is None or not _dominated(mode, fitting, stage_times)):
            fitting.append(mode)
    ok = [run(m) for m in fitting]
    ok = [(p, s) for p, s in ok if fits(s, limits)]  # as `fits_of` said, unless it was wrong
    return min(ok, key=lambda ps: ps[1].iteration_time) if ok else None


def _dominated(
    mode: MemoryPolicy,
    others: Sequence[MemoryPolicy],
    stage_times: Callable[[MemoryPolicy], Sequence[float]],
) -> bool:
    """Some mode of `others` is at least as fast as `mode` on every stage."""
    mine = stage_times(mode)
    return any(all(a <= b for a, b in zip(stage_times(m), mine)) for m in others)


__all__ = [
    "StockResult",
    "StockWork",
    "best_fitting_mode",
    "evaluate_stock",
    "fastest",
    "fits",
    "max_chunk_layers",
    "megatron_plan",
    "mode_label",
    "peaks_fit",
    "recompute_modes",
    "schedule_name",
    "strongest",
    "with_recompute",
]
