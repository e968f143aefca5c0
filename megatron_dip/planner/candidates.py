"""Megatron's own interleaved order on DIP's placement, as a candidate plan.

Where a batch has nothing to balance (text only, one busy module), Megatron's interleaved 1F1B
order is hard to beat; the planner builds it on its own placement (each module's segments
become virtual stages, producers before consumers) and keeps whichever of the two plans
simulates faster, so DIP never loses to the stock schedule on such batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..batching import MicrobatchWork
from ..batching.split import with_input_tokens
from ..modelspec import MultimodalSpec
from ..schedule.baselines import build_megatron_plan
from ..schedule.ir import BatchTotals, Dependency, Placement, Plan, WorkId
from ..schedule.passes import ComputeTimeFn, TensorFn


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
