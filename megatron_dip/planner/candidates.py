"""Megatron's own interleaved order on DIP's placement, as a candidate plan.

Where a batch has nothing to balance (text only, one busy module), Megatron's interleaved 1F1B
order is hard to beat; the planner builds it on its own placement (each module's segments
become virtual stages, producers before consumers) and keeps whichever of the two plans
simulates faster, so DIP never loses to the stock schedule on such batches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..batching import MicrobatchWork
from ..batching.split import with_input_tokens
from ..modelspec import MultimodalSpec
from ..schedule.baselines import build_megatron_plan
from ..schedule.engine import per_peer_channel
from ..schedule.ir import (
    NO_RECOMPUTE,
    BatchTotals,
    Dependency,
    Forward,
    MemoryPolicy,
    Placement,
    Plan,
    WorkId,
)
from ..schedule.passes import ComputeTimeFn, TensorFn
from ..schedule.validate import validate_plan
from .overheads import host_overheads
from .simulator import activation_peaks, simulate
from .stock_configs import best_fitting_mode, max_chunk_layers, peaks_fit, with_recompute


def megatron_stage_units(placement: Placement) -> list[list[list[tuple[str, int]]]]:
    """Virtual stages of the placement in Megatron's numbering: all modules' chunks in model
    order form one list, global stage g on rank g mod P (chunk c of a module lies on c mod P)."""
    p = placement.num_ranks
    chain = [(m.name, c.index) for m in placement.modules for c in m.chunks]
    v = len(chain) // p
    return [[[chain[j * p + r]] for j in range(v)] for r in range(p)]


def megatron_order_plan(
    model: MultimodalSpec,
    placement: Placement,
    works: Sequence[MicrobatchWork],
    *,
    totals: BatchTotals,
    iteration: int,
    replica: int,
    tensors: TensorFn,
    compute_time: ComputeTimeFn,
    stage_units: list[list[list[tuple[str, int]]]] | None = None,
) -> Plan | None:
    """Megatron's interleaved (or 1F1B) order over `placement` for `works`, whose modules hold
    at most one sub-microbatch per microbatch; None where Megatron's order does not apply
    (e.g. fewer microbatches than pipeline ranks). `stage_units`: the placement's own virtual
    stages when it is a static Megatron placement (default: `megatron_stage_units`)."""
    if stage_units is not None:
        active, units = placement, stage_units
    else:
        # Modules without work in this batch (a ViT on text-only data) get no virtual stages:
        # Megatron's order over the busy modules alone, the plan still on the full placement.
        busy = {s.module for w in works for s in w.submicrobatches}
        mods = tuple(m for m in placement.modules if m.name in busy)
        active = Placement(placement.num_ranks, mods)
        if not active.modules or any(m.num_chunks % placement.num_ranks for m in mods):
            return None
        units = megatron_stage_units(active)
    try:
        plan = build_megatron_plan(
            placement=active,
            stage_units=units,
            submicrobatches=[s for w in works for s in w.submicrobatches],
            dependencies=[d for w in works for d in w.dependencies],
            microbatches=[w.info for w in works],
            totals=totals,
            num_model_chunks=len(units[0]),
            tensors=tensors,
            iteration=iteration,
            compute_time=compute_time,
            name="dip (megatron order)",
        )
    except ValueError:
        return None
    return replace(plan, placement=placement, replica=replica)


def merge_submicrobatches(
    model: MultimodalSpec, works: Sequence[MicrobatchWork]
) -> list[MicrobatchWork]:
    """The same microbatches with each module's sub-microbatches merged into one (Megatron runs
    a module's whole share of a microbatch at once)."""
    out = []
    for w in works:
        by_module: dict[str, list] = {}
        for s in w.submicrobatches:
            by_module.setdefault(s.module, []).append(s)
        merged = tuple(
            replace(
                subs[0],
                index=0,
                instance_start=min(s.instance_start for s in subs),
                instance_end=max(s.instance_end for s in subs),
                tokens=sum(s.tokens for s in subs),
                padded_tokens=sum(s.padded_tokens for s in subs),
                attention_pairs=sum(s.attention_pairs for s in subs),
                context_tokens=sum(s.context_tokens for s in subs),
                context_pairs=sum(s.context_pairs for s in subs),
            )
            for subs in by_module.values()
        )
        deps = tuple(
            sorted(
                {
                    Dependency(
                        WorkId(d.producer.module, d.producer.microbatch, 0),
                        WorkId(d.consumer.module, d.consumer.microbatch, 0),
                    )
                    for d in w.dependencies
                }
            )
        )
        out.append(MicrobatchWork(w.info, tuple(with_input_tokens(model, merged, deps)), deps))
    return out


def megatron_candidate(
    planner: Any,
    merged: Sequence[MicrobatchWork],
    mode: MemoryPolicy,
    *,
    totals: BatchTotals,
    iteration: int,
    replica: int,
) -> Plan | None:
    """Megatron's order on `planner`'s placement (a `DipPlanner`, not imported: it imports
    this module) for `merged` (`merge_submicrobatches`), with `mode` on every stage and
    messages placed by that mode's durations; None where Megatron's order does not apply."""
    sub_of = {s.work: s for w in merged for s in w.submicrobatches}
    cost_model, placement = planner.cost_model, planner.placement
    host = host_overheads(cost_model)

    def duration(rank: int, ins) -> float:
        chunk = placement.module(ins.stage.module).chunks[ins.stage.chunk]
        c = cost_model.stage_cost(chunk, sub_of[ins.stage.work], mode)
        fwd, bwd = host.instruction_times(c.forward, c.backward)
        return max(fwd if isinstance(ins, Forward) else bwd, 1e-12)

    alt = megatron_order_plan(
        planner.model,
        placement,
        merged,
        totals=totals,
        iteration=iteration,
        replica=replica,
        tensors=functools.partial(planner.message_tensors, sub_of),
        compute_time=duration,
        stage_units=planner.stage_units,
    )
    return None if alt is None else with_recompute(alt, mode)


def best_of_megatron(
    planner: Any,
    plan: Plan,
    works: Sequence[MicrobatchWork],
    *,
    totals: BatchTotals,
    replica: int,
    over: bool,
) -> tuple[Plan, float]:
    """`plan` or Megatron's order on the same placement under the fastest uniform recompute
    setting that fits (Megatron's flags: none, selective, block N, uniform, full), whichever
    simulates faster within the memory limit (per-peer channels: the runtime's
    communicators); Megatron's whenever it fits and `plan` does not (`over`). With the
    simulated iteration time of the one returned."""
    cost_model = planner.cost_model
    merged = merge_submicrobatches(planner.model, works)
    megatron_order = functools.cache(
        functools.partial(
            megatron_candidate,
            planner,
            merged,
            totals=totals,
            iteration=plan.iteration,
            replica=replica,
        )
    )
    ours = simulate(plan, cost_model, channel=per_peer_channel).iteration_time
    plain = megatron_order(NO_RECOMPUTE)
    if plain is None:
        return plan, ours
    # Recomputation only lengthens Megatron's fixed order: when `plan` fits and is no slower
    # than that order without any, no recompute setting of it can win.
    if not over and ours <= simulate(plain, cost_model, channel=per_peer_channel).iteration_time:
        return plan, ours
    limits = planner.device_limits_or_infinite
    found = best_fitting_mode(
        megatron_order,
        layers=max_chunk_layers(planner.placement),
        cost_model=cost_model,
        limits=limits,
        channel=per_peer_channel,
        stage_times=functools.cache(functools.partial(_stage_times, planner, merged)),
        fits_of=functools.partial(_fits_in_order, cost_model, plain, limits),
    )
    if found is not None and (over or found[1].iteration_time < ours):
        if planner.config.validate_plans:
            validate_plan(found[0])
        return found[0], found[1].iteration_time
    return plan, ours


def _stage_times(planner: Any, merged: Sequence[MicrobatchWork], mode: MemoryPolicy) -> list:
    """Forward and backward compute of every (chunk, sub-microbatch) of `merged` under `mode`
    on every stage, in one fixed order (what Megatron's order runs)."""
    times = []
    for sub in (s for w in merged for s in w.submicrobatches):
        for chunk in planner.placement.module(sub.module).chunks:
            c = planner.cost_model.stage_cost(chunk, sub, mode)
            times += (c.forward, c.backward)
    return times


def _fits_in_order(cost_model, plan: Plan, limits: Sequence[float], mode: MemoryPolicy) -> bool:
    """Whether `plan` (Megatron's order) holds no more than `limits` under `mode` on every
    stage: its activation peaks, which the order alone decides."""
    return peaks_fit(activation_peaks(with_recompute(plan, mode), cost_model), limits)
