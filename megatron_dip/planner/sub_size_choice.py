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

The same way, with offload, the plans of each of the memory pass's other offload offers
(`PlannerConfig.offload_offer_candidates`) compete with the others, where that offer differs on
some stage of the batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..batching import BatchLayout, split_microbatches
from ..schedule.engine import per_peer_channel
from .memory import MemoryLimitError
from .simulator import simulate
from .stock_configs import fits


def scaled_sizes(sizes: Mapping[str, int], scales: Sequence[float]) -> list[dict[str, int]]:
    """The sizes `sizes` times each of `scales` above 1 (every module's alike, rounded up), by
    increasing scale, each a coarser cut than the one before it: where rounding up gives a
    module no more instances than the scale before did (1 instance times 1.5 and times 2 both
    round to 2), it takes one more, so that every scale plans a cut of its own (T2V-S's DiT at
    1 clip: 2 and 3 clips, not 2 twice)."""
    out: list[dict[str, int]] = []
    before = dict(sizes)
    for scale in sorted({s for s in scales if s > 1}):
        scaled = {m: max(math.ceil(n * scale - 1e-9), before[m] + 1) for m, n in sizes.items()}
        out.append(scaled)
        before = scaled
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
    (module docstring); each cut also planned by `planner.offer_planners()` where their offers
    differ (`PlannerConfig.offload_offer_candidates`). Its `planning_seconds` are all of them."""
    mine = layout.replicas[replica]
    plan_of = functools.partial(
        _plan_offers,
        planner,
        iteration=layout.iteration,
        replica=replica,
        totals=layout.totals,
        forward_only=forward_only,
        search=search,
    )
    best, best_key = plan_of(mine.works)
    scales = () if forward_only else planner.config.sub_size_scales
    others = scaled_sizes(planner.config.sub_sizes, scales)
    if not others:
        return best
    best_key = _key(planner, best) if best_key is None else best_key
    spent = best.planning_seconds
    seen = [mine.works]
    for sizes in others:
        config = replace(planner.layout_config, sub_sizes=sizes)
        works = split_microbatches(planner.model, mine.microbatches, config)
        if works in seen:  # the same cut (no microbatch has that many instances)
            continue
        seen.append(works)
        found, key = plan_of(works)
        spent += found.planning_seconds
        key = _key(planner, found) if key is None else key
        if key < best_key:
            best, best_key = found, key
    return replace(best, planning_seconds=spent)


def _plan_offers(planner, works, *, forward_only: bool, **kw) -> tuple:
    """(`ReplicaPlan`, its `_key` or None where nothing was compared) of `works` planned by
    `planner` or, where faster and fitting, by one of `planner.offer_planners()`; one whose
    offers equal those of a planner already planned on every stage is skipped (the same
    plan), as is one that cannot fit (`MemoryLimitError`), and a forward-only plan offers
    nothing. Its `planning_seconds` are all of them (but those of a plan that raised)."""
    best = planner.plan_replica(works, forward_only=forward_only, **kw)
    planned, key = [planner], None
    spent = best.planning_seconds
    for other in [] if forward_only else planner.offer_planners():
        if not all(p.offers_differ(other, works) for p in planned):
            continue
        planned.append(other)
        try:
            found = other.plan_replica(works, forward_only=forward_only, **kw)
        except MemoryLimitError:  # this offer cannot fit where the planner's own does
            continue
        spent += found.planning_seconds
        key = _key(planner, best) if key is None else key
        found_key = _key(planner, found)
        if found_key < key:
            best, key = found, found_key
    return replace(best, planning_seconds=spent), key


def _key(planner, found) -> tuple[bool, float]:
    """(over the memory limit, simulated iteration): the lower the better."""
    sim = simulate(found.plan, planner.cost_model, channel=per_peer_channel)
    limits = planner.device_limits
    over = found.overcommitted or (limits is not None and not fits(sim, limits))
    return over, sim.iteration_time
