"""Split backwards for a finished plan: B on the critical path, W in the bubbles, within memory.

`split_into_bubbles` splits every backward of a plan into its input-gradient half (B) and its
weight-gradient half (W, none for frozen modules), moves the W into the waits where the
simulated pipeline idles (`schedule.zero_bubble`), adds each chunk's data-parallel reduction
after its last W, and keeps the result only if it simulates faster and every rank's activation
peak (a deferred W holds its stage's activations) stays within its limit: before a Forward that
would go over, the oldest deferred W run (ZB-H1's rule). So the split plan is never slower than
the plan it came from, and never over memory.

Used by the DIP planner (`PlannerConfig.split_backward`) and by the study's Zero-Bubble peer
(ZB-H1: Megatron's 1F1B order on a static placement, W deferred within 1F1B's own memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..schedule.backward_split import split_backwards
from ..schedule.engine import ChannelFn, ExecutionResult, single_channel
from ..schedule.ir import Plan, Program, StageId
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
    measures the split runtime: `PlannerConfig.split_always`)."""
    base = baseline or simulate(plan, cost_model, channel=channel)
    if plan.forward_only:
        return plan, base
    caps = list(limits) if limits is not None else [float("inf")] * plan.num_ranks
    split = dataclasses.replace(plan, programs=split_backwards(plan))
    costs, _ = stage_costs(plan, cost_model)

    def weight_bytes(stage: StageId) -> float:  # the fill's rule holds one amount F to W
        return float(max(costs[stage].activation_bytes, costs[stage].pending_weight_bytes))

    timing = PlanTiming(plan, cost_model, costs)

    def execute(programs: Sequence[Program]) -> ExecutionResult:
        return timing.run(programs, channel)

    # The memory rule of the fill keeps each rank within its limit, or within what the fused
    # plan holds where that is more (a plan that was over stays no worse).
    budget = [max(c, p) for c, p in zip(caps, base.peak_activation_bytes)]
    programs, result = fill_bubbles_with_weights(
        split.programs,
        placement=plan.placement,
        execute=execute,
        weight_bytes=weight_bytes,
        memory_limit=budget,
        rounds=rounds,
    )
    if require_faster and result.makespan >= base.iteration_time:
        return plan, base
    candidate = dataclasses.replace(plan, programs=programs, name=plan.name + "+bw")
    sim = simulate(candidate, cost_model, channel=channel)
    if all(p <= b * (1 + 1e-12) for p, b in zip(sim.peak_activation_bytes, budget)):
        return candidate, sim
    return plan, base
