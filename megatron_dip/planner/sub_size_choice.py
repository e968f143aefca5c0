"""Sub-microbatch size as a planned choice: each batch planned at the configured sizes and at
coarser ones, the plan that simulates fastest within memory kept.

The configured sizes (`submicrobatch.choose_sub_size`: the smallest at 95% of peak efficiency)
cost the split modules' smaller GEMMs (the gap decomposition's granularity, `planner.gap`); a
coarser size runs larger GEMMs but makes coarser units and holds more activations per stage.
Which wins depends on the batch and on how much memory the plan has, so the planner tries both:
`PlannerConfig.sub_size_scales` multiplies every split module's size, the batch's microbatches
are cut again with those sizes (`batching.split_microbatches`, the one definition of the split)
and planned whole (search, memory pass, candidates), and the plan that fits the memory limit
with the shortest simulated iteration wins (the configured sizes on ties). The runtime runs
whatever split the plan holds (each sub-microbatch's instance range), so nothing else changes.

The same way, with offload, the plans whose memory pass offers only offloads whose copy out
ends within the forward (`PlannerConfig.drained_offload_candidate`) compete with the others.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..batching import BatchLayout, split_microbatches
from ..schedule.engine import per_peer_channel
from .simulator import simulate
from .stock_configs import fits


def scaled_sizes(sizes: Mapping[str, int], scales: Sequence[float]) -> list[dict[str, int]]:
    """The sizes `sizes` times each of `scales` (every module's alike, rounded up), in order,
    without repeats or the sizes themselves."""
    out: list[dict[str, int]] = []
    for scale in scales:
        scaled = {m: max(1, math.ceil(n * scale - 1e-9)) for m, n in sizes.items()}
        if scaled != dict(sizes) and scaled not in out:
            out.append(scaled)
    return out


def plan_with_sizes(
    planner,
    layout: BatchLayout,
    replica: int,
    *,
    forward_only: bool = False,
    search: bool | None = None,
):
    """The `ReplicaPlan` of one replica of `layout` (cut at the configured sizes of `planner`,
    the run's `DipPlanner`) or of the same microbatches cut at each of
    `config.sub_size_scales`' sizes, whichever fits the memory limit and simulates fastest
    (module docstring); with `planner.drained_planner()` (`PlannerConfig.
    drained_offload_candidate`), also that planner's plan of the same, where it fits and
    simulates faster. Its `planning_seconds` are all of them."""
    best = _plan_with_sizes(planner, layout, replica, forward_only=forward_only, search=search)
    drained = None if forward_only else planner.drained_planner()
    if drained is None:
        return best
    found = _plan_with_sizes(drained, layout, replica, search=search)
    spent = best.planning_seconds + found.planning_seconds
    if _key(drained, found) < _key(planner, best):
        best = found
    return replace(best, planning_seconds=spent)


def _plan_with_sizes(
    planner,
    layout: BatchLayout,
    replica: int,
    *,
    forward_only: bool = False,
    search: bool | None = None,
):
    """`plan_with_sizes` with `planner` alone."""
    mine = layout.replicas[replica]
    plan_of = functools.partial(
        planner.plan_replica,
        iteration=layout.iteration,
        replica=replica,
        totals=layout.totals,
        forward_only=forward_only,
        search=search,
    )
    best = plan_of(mine.works)
    scales = () if forward_only else planner.config.sub_size_scales
    others = scaled_sizes(planner.config.sub_sizes, scales)
    if not others:
        return best
    spent, best_key = best.planning_seconds, _key(planner, best)
    seen = [mine.works]
    for sizes in others:
        config = replace(planner.layout_config, sub_sizes=sizes)
        works = split_microbatches(planner.model, mine.microbatches, config)
        if works in seen:  # the same cut (no microbatch has that many instances)
            continue
        seen.append(works)
        found = plan_of(works)
        spent += found.planning_seconds
        key = _key(planner, found)
        if key < best_key:
            best, best_key = found, key
    return replace(best, planning_seconds=spent)


def _key(planner, found) -> tuple[bool, float]:
    """(over the memory limit, simulated iteration): the lower the better."""
    sim = simulate(found.plan, planner.cost_model, channel=per_peer_channel)
    limits = planner._memory_limits()
    over = found.overcommitted or (limits is not None and not fits(sim, limits))
    return over, sim.iteration_time
