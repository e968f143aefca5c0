"""The plan of an iteration the planner process has none ready for, in milliseconds.

Rank 0 makes it once and shares it with every rank (`service.PlanClient`): Megatron's order on
the run's placement (built once, with no recomputation's durations placing its messages) under
the cheapest uniform recompute setting whose activations fit the memory limit. Whether a setting
fits is read off the plan's instruction order (the activations a rank holds after each forward
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
from ..schedule.ir import NO_RECOMPUTE, Backward, Forward, Plan, Recompute, RecomputeMode
from ..schedule.validate import validate_plan
from .candidates import merge_submicrobatches
from .stock_configs import max_chunk_layers, with_recompute


def activation_peaks(plan: Plan, cost_model) -> list[float]:
    """Per rank, the most activation bytes `plan` holds at once (forwards of stages with a
    backward add theirs, backwards free them; program order is each rank's time order)."""
    cost = functools.cache(
        lambda stage, mode: (
            cost_model.stage_cost(
                plan.placement.module(stage.module).chunks[stage.chunk],
                plan.submicrobatch(stage.work),
                *mode,
            ).activation_bytes
        )
    )
    backward = {i.stage for p in plan.programs for i in p.instructions if isinstance(i, Backward)}
    peaks = []
    for program in plan.programs:
        held = peak = 0.0
        kept: dict = {}
        for ins in program.instructions:
            if isinstance(ins, Forward) and ins.stage in backward:
                kept[ins.stage] = cost(ins.stage, ins.mode)
                held += kept[ins.stage]
                peak = max(peak, held)
            elif isinstance(ins, Backward) and ins.stage in kept:
                held -= kept.pop(ins.stage)
        peaks.append(peak)
    return peaks


def _added_time(plan: Plan, cost_model, mode: RecomputeMode) -> float:
    """Seconds of recomputation `mode` adds to `plan`'s stages (all ranks)."""
    total = 0.0
    for program in plan.programs:
        for ins in program.instructions:
            if isinstance(ins, Forward):
                chunk = plan.placement.module(ins.stage.module).chunks[ins.stage.chunk]
                sub = plan.submicrobatch(ins.stage.work)
                base = cost_model.stage_cost(chunk, sub, *NO_RECOMPUTE)
                with_mode = cost_model.stage_cost(chunk, sub, *mode)
                total += (with_mode.forward + with_mode.backward) - (base.forward + base.backward)
    return total


def cheapest_fitting_mode(
    plan: Plan, cost_model, limits: Sequence[float], *, layers: int
) -> Plan | None:
    """`plan` under the uniform recompute setting (none, block N, selective, uniform, full) that
    fits `limits` and adds the least recompute time; None when none fits."""

    def fits(mode: RecomputeMode) -> bool:
        peaks = activation_peaks(with_recompute(plan, mode), cost_model)
        return all(p <= lim for p, lim in zip(peaks, limits))

    if fits(NO_RECOMPUTE):
        return with_recompute(plan, NO_RECOMPUTE)
    candidates = []
    lo, hi = 1, layers  # a larger N holds less and recomputes more: the smallest N that fits
    if fits((Recompute.BLOCK, hi)):
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits((Recompute.BLOCK, mid)) else (mid + 1, hi)
        candidates.append((Recompute.BLOCK, lo))
    for mode in ((Recompute.SELECTIVE, 0), (Recompute.UNIFORM, layers), (Recompute.FULL, 0)):
        if fits(mode):
            candidates.append(mode)
    if not candidates:
        return None
    best = min(candidates, key=lambda m: _added_time(plan, cost_model, m))
    return with_recompute(plan, best)


def fallback_plan(planner, layout: BatchLayout, replica: int) -> Plan:
    """The late plan of one replica of `layout` (module docstring); `planner`: the run's
    `DipPlanner`."""
    works = layout.replicas[replica].works
    merged = merge_submicrobatches(planner.model, works)
    order = planner._megatron_order(
        merged, NO_RECOMPUTE, totals=layout.totals, iteration=layout.iteration, replica=replica
    )
    if order is not None:
        limits = planner._memory_limits() or [float("inf")] * planner.placement.num_ranks
        found = cheapest_fitting_mode(
            order, planner.cost_model, limits, layers=max_chunk_layers(planner.placement)
        )
        if found is not None:
            validate_plan(found)
            return found
    return planner.plan_replica(
        works, iteration=layout.iteration, replica=replica, totals=layout.totals, quick=True
    ).plan


__all__ = ["activation_peaks", "cheapest_fitting_mode", "fallback_plan"]
