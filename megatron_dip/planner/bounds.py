"""What no schedule can beat: the balanced bound of a batch (docs/design.md, "Definitions we measure by").

The balanced bound of one data-parallel replica's work is the total compute of all its forward
and backward work WITHOUT recomputation, divided by the pipeline ranks: a perfectly balanced
pipeline with no bubbles, no stalls and no recomputation. It is priced on each module's whole
share of a microbatch (`batching` with whole modules, the largest and most efficient GEMMs), so a
schedule cutting the same work into sub-microbatches can only take longer. A plan's own "bound
efficiency" (busiest rank's compute / iteration) is a weaker figure: a placement that puts
everything on one rank scores 100% on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..schedule.ir import ChunkSpec, Placement, SubMicrobatch


def total_compute(cost_model, submicrobatches: Iterable[SubMicrobatch]) -> float:
    """Seconds of every forward (and backward, where the module needs one) of the whole modules
    on these sub-microbatches, without recomputation."""
    model, total = cost_model.model, 0.0
    for sub in submicrobatches:
        spec = model.module(sub.module)
        cost = cost_model.stage_cost(ChunkSpec(spec.name, 0, 0, 0, spec.num_layers), sub)
        total += cost.forward + (cost.backward if cost_model.needs_backward(spec.name) else 0.0)
    return total


def rank_loads(
    cost_model, placement: Placement, submicrobatches: Iterable[SubMicrobatch]
) -> list[float]:
    """Seconds of every forward (and backward, where the module needs one) each rank of
    `placement` computes on these sub-microbatches, without recomputation: every chunk of a
    sub-microbatch's module on its rank."""
    loads = [0.0] * placement.num_ranks
    for sub in submicrobatches:
        backward = cost_model.needs_backward(sub.module)
        for chunk in placement.module(sub.module).chunks:
            cost = cost_model.stage_cost(chunk, sub)
            loads[chunk.rank] += cost.forward + (cost.backward if backward else 0.0)
    return loads


def balanced_bound(
    cost_model, submicrobatches: Iterable[SubMicrobatch], *, num_ranks: int
) -> float:
    """`total_compute` / `num_ranks` (module docstring)."""
    return total_compute(cost_model, submicrobatches) / num_ranks


def module_bounds(
    cost_model, submicrobatches: Iterable[SubMicrobatch], *, num_ranks: int
) -> dict[str, float]:
    """Each module's share of `balanced_bound` (its `total_compute` / `num_ranks`)."""
    by_module: dict[str, list[SubMicrobatch]] = {}
    for sub in submicrobatches:
        by_module.setdefault(sub.module, []).append(sub)
    return {m: total_compute(cost_model, subs) / num_ranks for m, subs in by_module.items()}
