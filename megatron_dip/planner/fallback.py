"""The plan of an iteration the planner process has none ready for, in milliseconds.

Rank 0 makes it once and shares it with every rank (`service.PlanClient`): Megatron's order on
the run's placement (built once, with no recomputation's durations placing its messages) under
the cheapest uniform memory setting whose activations fit the memory limit: Megatron's recompute
settings, and with `--dip-offload-activations` also offload of K layers per chunk, alone and after
block recomputation of one layer (Megatron-Core's fine-grained offloading, `stock_configs`), whose
offloaded bytes must fit the host limit too. Whether a setting fits is read off the plan's
instruction order (the activations a rank holds after each forward
and backward depend on that order alone, as `simulator` counts them), so no simulation runs;
the cheapest setting is the one adding the least recompute time by the cost model. Where
Megatron's order does not apply to the batch (e.g. fewer microbatches than its order needs) or
no setting fits, one list schedule of the batch (`DipPlanner.plan_replica(quick=True)`).
Deterministic: a function of the batch and the cost model alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..batching import BatchLayout
from ..schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    Forward,
    MemoryPolicy,
    Plan,
    Recompute,
)
from ..schedule.validate import validate_plan
from .candidates import megatron_candidate, merge_submicrobatches
from .simulator import activation_peaks
from .stock_configs import max_chunk_layers, with_recompute


def offload_peaks(plan: Plan, cost_model) -> list[float]:
    """Per rank, the most offloaded bytes `plan` keeps in host memory at once (from each
    offloading forward to its backward, in program order)."""
    cost = functools.cache(
        lambda stage, mode: (
            cost_model.offloaded_bytes(
                plan.placement.module(stage.module).chunks[stage.chunk],
                plan.submicrobatch(stage.work),
                mode,
            )
            if mode.offload
            else 0
        )
    )
    return _peaks(plan, cost)


def _peaks(plan: Plan, cost) -> list[float]:
    """Per rank, the most of `cost(stage, mode)` held at once from forwards to backwards."""
    backward = {i.stage for p in plan.programs for i in p.instructions if isinstance(i, Backward)}
    peaks = []
    for program in plan.programs:
        held = peak = 0.0
        kept: dict = {}
        for ins in program.instructions:
            if isinstance(ins, Forward) and ins.stage in backward:
                kept[ins.stage] = cost(ins.stage, ins.memory)
                held += kept[ins.stage]
                peak = max(peak, held)
            elif isinstance(ins, Backward) and ins.stage in kept:
                held -= kept.pop(ins.stage)
        peaks.append(peak)
    return peaks


def _added_time(plan: Plan, cost_model, mode: MemoryPolicy) -> float:
    """Seconds of recomputation `mode` adds to `plan`'s stages (all ranks)."""
    total = 0.0
    for program in plan.programs:
        for ins in program.instructions:
            if isinstance(ins, Forward):
                chunk = plan.placement.module(ins.stage.module).chunks[ins.stage.chunk]
                sub = plan.submicrobatch(ins.stage.work)
                base = cost_model.stage_cost(chunk, sub)
                with_mode = cost_model.stage_cost(chunk, sub, mode)
                total += (with_mode.forward + with_mode.backward) - (base.forward + base.backward)
    return total


def cheapest_fitting_mode(
    plan: Plan,
    cost_model,
    limits: Sequence[float],
    *,
    layers: int,
    host_limits: Sequence[float] | None = None,
) -> Plan | None:
    """`plan` under the uniform memory setting (none, block N, selective, uniform, full; with
    `host_limits` also offload of K layers, alone and after block 1, within those host limits)
    that fits `limits` and adds the least time; None when none fits."""

    def fits(mode: MemoryPolicy) -> bool:
        candidate = with_recompute(plan, mode)
        peaks = activation_peaks(candidate, cost_model)
        if any(p > lim for p, lim in zip(peaks, limits)):
            return False
        if host_limits is None or not mode.offload:
            return True
        return all(p <= lim for p, lim in zip(offload_peaks(candidate, cost_model), host_limits))

    if fits(NO_RECOMPUTE):
        return with_recompute(plan, NO_RECOMPUTE)
    # A larger N (or K) holds less and costs more: the smallest that fits.
    families = [lambda n: MemoryPolicy(Recompute.BLOCK, n)]
    if host_limits is not None and layers > 0:
        families.append(lambda k: MemoryPolicy(Recompute.NONE, 0, k))
        families.append(lambda k: MemoryPolicy(Recompute.BLOCK, 1, k))
    candidates = [m for family in families if (m := _smallest_fitting(family, layers, fits))]
    for mode in (
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.UNIFORM, layers),
        MemoryPolicy(Recompute.FULL, 0),
    ):
        if fits(mode):
            candidates.append(mode)
    if not candidates:
        return None
    best = min(candidates, key=lambda m: _added_time(plan, cost_model, m))
    return with_recompute(plan, best)


def _smallest_fitting(family, layers: int, fits) -> MemoryPolicy | None:
    """`family(n)` for the smallest n in [1, layers] that fits (bisection: holding less as n
    grows); None when even `family(layers)` does not."""
    lo, hi = 1, layers
    if hi < 1 or not fits(family(hi)):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(family(mid)) else (mid + 1, hi)
    return family(lo)


def fallback_plan(planner, layout: BatchLayout, replica: int) -> Plan:
    """The late plan of one replica of `layout` (module docstring); `planner`: the run's
    `DipPlanner`."""
    works = layout.replicas[replica].works
    merged = merge_submicrobatches(planner.model, works)
    order = megatron_candidate(
        planner,
        merged,
        NO_RECOMPUTE,
        totals=layout.totals,
        iteration=layout.iteration,
        replica=replica,
    )
    if order is not None:
        limits = planner.device_limits_or_infinite
        found = cheapest_fitting_mode(
            order,
            planner.cost_model,
            limits,
            layers=max_chunk_layers(planner.placement),
            host_limits=planner.host_limits(),
        )
        if found is not None:
            validate_plan(found)
            return found
    return planner.plan_replica(
        works, iteration=layout.iteration, replica=replica, totals=layout.totals, quick=True
    ).plan


__all__ = ["cheapest_fitting_mode", "fallback_plan", "offload_peaks"]
