"""The start-up placement search: placement candidates scored by DIP plans of calibration
batches, simulated.

`search_placement` runs its three steps for both the simulation study (`compare.Comparison`)
and the training entry point (`training.config.layout`): `planner.placement.choose_dip_placement`
picks the candidate with the smallest greedy score among DIP's segment counts and the static
Megatron placements (`static_candidates`), `placement_climb` moves a winning one-list cut a layer
at a time while that scores lower (where no one-list cut wins, the cost rule's cut over one chunk
per rank instead, `placement_climb.second_start`), and `placement_ties` plans the near-ties (and
the cut the climb started from) as the run does. Scores are `simulated_score`s, so a static
placement with Megatron's order (which the planner tries as a candidate plan) is always in the
running and the choice never loses to it on those batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..data.sample import BatchMeta
from ..modelspec import MultimodalSpec
from ..schedule.engine import ChannelFn, per_peer_channel
from .bounds import rank_loads
from .candidates import merge_submicrobatches
from .dip import DipPlanner
from .placement import PlacementCandidate, choose_dip_placement
from .placement_climb import climb_cut, second_start
from .placement_ties import settle_near_ties
from .simulator import simulate
from .static_baselines import StaticPipeline
from .stock_configs import fits


def static_candidates(static: Sequence[StaticPipeline]) -> list[PlacementCandidate]:
    """The static placements as candidates, with their virtual stages (for Megatron's order)."""
    return [
        PlacementCandidate(
            f"static {q.name} v{q.num_model_chunks}", q.placement, q.stage_units, family=q.name
        )
        for q in static
    ]


def search_placement(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    workload: Mapping,
    unit_instances: Mapping[str, int],
    static: Sequence[StaticPipeline],
    score: Callable[[PlacementCandidate], float],
    plan_score: Callable[[PlacementCandidate], float],
    bound: Callable[[PlacementCandidate], float],
    workers: int = 1,
) -> tuple[PlacementCandidate, dict[str, float], dict[str, float]]:
    """The start-up search's placement (module docstring): (the choice, every candidate's
    greedy `score` by name, the finalists' `plan_score` by name, empty where none was planned).
    `bound(c)` is a lower bound on `score(c)`; `workers` processes score (the same choice for
    any count)."""
    scored: dict[str, PlacementCandidate] = {}
    chosen, scores = choose_dip_placement(
        model,
        cost_model,
        num_ranks=num_ranks,
        workload=workload,
        unit_instances=unit_instances,
        evaluate=score,
        extra=static_candidates(static),
        bound=bound,
        workers=workers,
        scored=scored,
    )
    climbed, start = _climbed(
        model, chosen, scores, scored, score=score, bound=bound, workers=workers
    )
    settled, planned = settle_near_ties(
        climbed,
        scores,
        scored,
        evaluate=plan_score,
        bound=bound,
        workers=workers,
        start=start,
    )
    return settled, scores, planned


def _climbed(
    model: MultimodalSpec,
    chosen: PlacementCandidate,
    scores: dict[str, float],
    scored: dict[str, PlacementCandidate],
    *,
    score: Callable[[PlacementCandidate], float],
    bound: Callable[[PlacementCandidate], float],
    workers: int,
) -> tuple[PlacementCandidate, PlacementCandidate]:
    """(the climb's end, the cut it started from): `chosen` climbed, and where that is no
    one-list cut, also the cost rule's cut over one chunk per rank (`second_start`); the end
    with the lower greedy score (`chosen`'s on a tie)."""
    climb = dict(evaluate=score, bound=bound, workers=workers, scored=scored)
    end = climb_cut(model, chosen, scores, **climb)
    other = second_start(chosen, scores, scored)
    if other is None:
        return end, chosen
    other_end = climb_cut(model, other, scores, **climb)
    if scores[other_end.name] < scores[end.name]:
        return other_end, other
    return end, chosen


def simulated_score(
    planner: DipPlanner,
    batches: Sequence[BatchMeta],
    *,
    limits: Sequence[float] | None,
    channel: ChannelFn = per_peer_channel,
) -> float:
    """Mean simulated iteration time of the first replica's plans of `batches` by `planner`; a
    plan whose activations exceed `limits` counts double. The start-up search gives it a
    greedy planner (`config.scoring_config`: Megatron's order with its recompute settings among
    its candidates); `placement_ties` the run's own, without the search."""
    times = []
    for b in batches:
        plan = planner.plan_layout(planner.layout(b), 0).plan
        sim = simulate(plan, planner.cost_model, channel=channel)
        over = limits is not None and not fits(sim, limits)
        times.append(sim.iteration_time * (2 if over else 1))
    return sum(times) / len(times)


def rank_load_bound(planner: DipPlanner, batches: Sequence[BatchMeta]) -> float:
    """A lower bound on `simulated_score` for the planner's placement: the mean over `batches` of
    the busiest rank's compute on the first replica, each module's share of a microbatch priced
    whole (no plan of that work, split or not, recomputing or not, with host overheads or
    without, takes less). The start-up search skips a candidate whose bound exceeds the best
    score found (`choose_dip_placement`): the same choice as scoring it, for less work."""
    busiest = []
    for batch in batches:
        works = merge_submicrobatches(planner.model, planner.layout(batch).replicas[0].works)
        subs = (s for w in works for s in w.submicrobatches)
        busiest.append(max(rank_loads(planner.cost_model, planner.placement, subs)))
    return sum(busiest) / len(busiest)


__all__ = ["rank_load_bound", "search_placement", "simulated_score", "static_candidates"]
