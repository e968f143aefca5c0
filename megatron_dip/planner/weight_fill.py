"""Split backwards for a finished plan: B on the critical path, W in the bubbles, within memory.

`split_into_bubbles` splits every backward of a plan into its input-gradient half (B) and its
weight-gradient half (W, none for frozen modules), moves the W into the waits where the
simulated pipeline idles (`schedule.zero_bubble`), adds each chunk's data-parallel reduction
after its last W, and keeps the result only if it simulates faster and every rank's activation
peak (a deferred W holds its stage's activations) stays within its limit: before a Forward that
would go over, the oldest deferred W run (ZB-H1's rule). Where even that is over (a W of a
recomputed stage holds the layers B rebuilt), those stages keep their fused backward. So the
split plan is never slower than the plan it came from, and never over memory.

Used by the DIP planner (`PlannerConfig.split_backward`) and by the study's Zero-Bubble peer
(ZB-H1: Megatron's 1F1B order on a static placement, W deferred within 1F1B's own memory).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from ..schedule.backward_split import split_backwards
from ..schedule.engine import ChannelFn, single_channel
from ..schedule.ir import Plan, StageId
from ..schedule.zero_bubble import fill_bubbles_with_weights
from .simulator import PlanTiming, SimResult, simulate, stage_costs


def split_into_bubbles(
    plan: Plan,
    cost_model,
    *,
    limits: Sequence[float] | None = None,
    channel: ChannelFn = single_channel,
    baseline: SimResult | None = None,
    rounds: int = 2,
    require_faster: bool = True,
) -> tuple[Plan, SimResult]:
    """`plan` with split backwards and W in its bubbles when that fits `limits` (per-rank
    activation bytes; None: no limit) and simulates faster than `plan`; else `plan` itself.
    Returns the plan and its simulation. `baseline`: `plan`'s simulation, if already known.
    `require_faster=False` keeps a fitting split plan also where it is not faster (a run that
    measures the split runtime: `PlannerConfig.split_always`).

    Every backward is split first. Where that plan does not fit, the stages whose pending W
    would hold more than their activations (recomputed or offloaded layers, rebuilt in B and
    kept for W) keep their fused backward and the rest is split and filled again: at its memory
    limit a plan still moves the W that cost no memory."""
    base = baseline or simulate(plan, cost_model, channel=channel)
    if plan.forward_only:
        return plan, base
    caps = list(limits) if limits is not None else [float("inf")] * plan.num_ranks
    # The memory rule of the fill keeps each rank within its limit, or within what the fused
    # plan holds where that is more (a plan that was over stays no worse).
    budget = [max(c, p) for c, p in zip(caps, base.peak_activation_bytes)]
    costs, _ = stage_costs(plan, cost_model)
    heavy = frozenset(s for s, c in costs.items() if c.pending_weight_bytes > c.activation_bytes)
    for fused in (frozenset(), heavy) if heavy else (frozenset(),):
        found = _filled(plan, cost_model, costs, fused, budget, channel, rounds)
        if found is None:
            continue
        if require_faster and found[1].iteration_time >= base.iteration_time:
            return plan, base
        return found
    return plan, base


def _filled(
    plan: Plan,
    cost_model,
    costs: dict,
    fused: frozenset[StageId],
    budget: Sequence[float],
    channel: ChannelFn,
    rounds: int,
) -> tuple[Plan, SimResult] | None:
    """`plan` with every backward but those of `fused` split and its W moved into the bubbles
    within `budget` (per-rank activation bytes), and its simulation; None when its simulated
    peaks go over `budget`."""
    split = dataclasses.replace(plan, programs=split_backwards(plan, fused))

    def weight_bytes(stage: StageId) -> float:  # the fill's rule holds one amount F to W
        return float(max(costs[stage].activation_bytes, costs[stage].pending_weight_bytes))

    timing = PlanTiming(plan, cost_model, costs)
    programs, _ = fill_bubbles_with_weights(
        split.programs,
        placement=plan.placement,
        execute=functools.partial(timing.run, channel=channel),
        weight_bytes=weight_bytes,
        memory_limit=budget,
        rounds=rounds,
    )
    candidate = dataclasses.replace(plan, programs=programs, name=plan.name + "+bw")
    sim = simulate(candidate, cost_model, channel=channel)
    if all(p <= b * (1 + 1e-12) for p, b in zip(sim.peak_activation_bytes, budget)):
        return candidate, sim
    return None
