"""Scoring placement candidates at start-up: greedy DIP plans of calibration batches, simulated.

`planner.placement.choose_dip_placement` picks the candidate with the smallest score among DIP's
segment counts and the static Megatron placements (`static_candidates`); both the simulation
study (`compare.Comparison`) and the training entry point (`training.layout`) score with
`greedy_score`, so a static placement with Megatron's order (which the planner tries as a
candidate plan) is always in the running and the choice never loses to it on those batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..data.sample import BatchMeta
from ..schedule.engine import ChannelFn, per_peer_channel
from .dip import DipPlanner
from .placement import PlacementCandidate
from .simulator import simulate
from .static_baselines import StaticPipeline
from .stock_configs import fits


def static_candidates(static: Sequence[StaticPipeline]) -> list[PlacementCandidate]:
    """The static placements as candidates, with their virtual stages (for Megatron's order)."""
    return [
        PlacementCandidate(f"static {q.name} v{q.num_model_chunks}", q.placement, q.stage_units)
        for q in static
    ]


def greedy_score(
    planner: DipPlanner,
    batches: Sequence[BatchMeta],
    *,
    limits: Sequence[float] | None,
    channel: ChannelFn = per_peer_channel,
) -> float:
    """Mean simulated iteration time of the first replica's greedy plans of `batches` (Megatron's
    order with its recompute settings among the planner's candidates); a plan whose activations
    exceed `limits` counts double."""
    times = []
    for b in batches:
        plan = planner.plan_layout(planner.layout(b), 0).plan
        sim = simulate(plan, planner.cost_model, channel=channel)
        over = limits is not None and not fits(sim, limits)
        times.append(sim.iteration_time * (2 if over else 1))
    return sum(times) / len(times)


__all__ = ["greedy_score", "static_candidates"]
