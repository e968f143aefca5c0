"""The start-up search's last step: move the chosen static cut one layer at a time.

`placement.choose_dip_placement` scores DIP's segment counts and the static placements cut by
the cost rule. When a static one-list cut wins, this scores its neighbours (each stage boundary
moved by one layer, `placement_neighbours`) with the same score, moves to the best one if it
scores lower, and repeats from there (so a cut two or more layers away is reached through
improving steps) for at most `MAX_STEPS` steps. Scoring only the winner's neighbours keeps the
search's cost at a few candidates per step (6 on a 4-stage cut, 14 on 8 stages) rather than
every static cut's neighbours.

Where DIP's own segments (or another placement that is no one-list cut) win, a second climb
starts from the cost rule's cut over one chunk per rank (`second_start`): the cost rule balances
compute and ignores memory, so that cut's first ranks can sit just over the activation limit,
where the greedy score counts the plan double, while a cut one layer away fits (VLM-S
mixed-blend: `static cost-split v1` 22.77 s, doubled; its cut 18/19/19/39 15.25 s, below DIP's
best segments at 15.64 s). That cut is the cheapest to climb (2(P - 1) neighbours a step) and
the one a Megatron user moves layers of first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..modelspec import MultimodalSpec
from .candidate_pool import CandidateScorer
from .placement import PlacementCandidate
from .placement_neighbours import base_name, neighbour_candidates, searched

MAX_STEPS = 4  # a cut at most this many layers' moves from the cost rule's


def climb_cut(
    model: MultimodalSpec,
    chosen: PlacementCandidate,
    scores: dict[str, float],
    *,
    evaluate: Callable[[PlacementCandidate], float],
    bound: Callable[[PlacementCandidate], float] | None = None,
    workers: int = 1,
    max_steps: int = MAX_STEPS,
    scored: dict[str, PlacementCandidate] | None = None,
) -> PlacementCandidate:
    """From `chosen` (scored in `scores`), the neighbouring cut that scores lowest while that
    is strictly lower than where it stands, step by step; `chosen` itself if no neighbour beats
    it or it is not a static one-list cut. `scores` gains every neighbour scored (for the log),
    `scored` the neighbours themselves by name; `bound` and `workers` as in
    `choose_dip_placement` (the same choice, for less work)."""
    best, best_score = chosen, scores[chosen.name]
    seen = {chosen.placement}  # the cost rule's cut is also a neighbour of its neighbours
    for _ in range(max_steps):
        fresh = [c for c in neighbour_candidates(model, best) if c.placement not in seen]
        seen.update(c.placement for c in fresh)
        step = _lowest(fresh, best_score, scores, evaluate, bound, workers)
        if scored is not None:
            scored.update((c.name, c) for c in fresh if c.name in scores)
        if step is None:
            break
        best, best_score = step
    return best


def second_start(
    chosen: PlacementCandidate,
    scores: dict[str, float],
    scored: dict[str, PlacementCandidate],
) -> PlacementCandidate | None:
    """Where a second climb starts (module docstring): the cost rule's cut over one chunk per
    rank among the `scored` candidates, where `chosen` is no one-list cut; else None."""
    if searched(chosen):
        return None
    bases = [
        c
        for c in scored.values()
        if c.name in scores
        and c.family == "cost-split"
        and len(c.stage_units[0]) == 1
        and c.name == base_name(c)  # the cost rule's own cut, not a moved one
    ]
    return min(bases, key=lambda c: (scores[c.name], c.name), default=None)


def _lowest(
    cands: Sequence[PlacementCandidate],
    to_beat: float,
    scores: dict[str, float],
    evaluate: Callable[[PlacementCandidate], float],
    bound: Callable[[PlacementCandidate], float] | None,
    workers: int,
) -> tuple[PlacementCandidate, float] | None:
    """The lowest-scoring of `cands` (the earlier on ties) if it scores below `to_beat`,
    skipping those whose bound exceeds the lowest score so far (bounds ascending)."""
    bounds = [bound(c) for c in cands] if bound is not None else [0.0] * len(cands)
    order = sorted(range(len(cands)), key=bounds.__getitem__)
    lowest: list[tuple[float, int]] = [(to_beat, -1)]  # (score, index); -1: nothing beat it

    def cannot_win(i: int) -> bool:
        return bounds[i] > lowest[0][0]

    with CandidateScorer(evaluate, cands, workers=workers) as scorer:
        for i, score in scorer.scored(order, stop=cannot_win):
            scores[cands[i].name] = score
            if score < to_beat and (score, i) < lowest[0]:
                lowest[0] = (score, i)
    score, i = lowest[0]
    return None if i < 0 else (cands[i], score)


__all__ = ["MAX_STEPS", "climb_cut", "second_start"]
