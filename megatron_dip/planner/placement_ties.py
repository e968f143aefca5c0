"""The start-up search's near-ties, settled by the plans the run makes.

`placement_search.simulated_score` ranks placements by greedy plans of the calibration batches: the
cheap proxy that lets the search score tens of candidates. Its error can exceed the margins it
decides. On T2V-S (t2v) the two best candidates scored 0.15% apart, and the run's plans of the
one that lost were 0.2% faster; on VLM-M (mixed) 0.10% apart, the same way round. So the
candidates that score within `TIE_MARGIN` of the best (at most `MAX_FINALISTS`, the best among
them) are scored again by `evaluate`, the run's own planner configuration (its sub-microbatch
cuts, offload offers and split backward; without the search, so that a score stays a function of
the data), and the lowest of those scores wins; its ties go to the greedy order.

Where the search's climb (`placement_climb`) moved the cut, the cut it started from is a finalist
too, whatever its greedy score: the climb follows the greedy score alone, and on VLM-L its first
step lowered that score by 4.7% while the run's plans of the moved cut were 1.4% slower.

A candidate whose bound exceeds the best greedy score is not a finalist, whatever its score: with
several workers such a candidate may or may not have been scored, depending on timing
(`candidate_pool.CandidateScorer`), and the choice must not depend on timing. Every candidate
whose bound is at most the best score is scored, with any number of workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from .candidate_pool import CandidateScorer
from .placement import PlacementCandidate

logger = logging.getLogger(__name__)

TIE_MARGIN = 0.005  # relative to the best greedy score: 3x the largest reversal measured
MAX_FINALISTS = 3


def finalists(
    chosen: PlacementCandidate,
    scores: Mapping[str, float],
    scored: Mapping[str, PlacementCandidate],
    *,
    bound: Callable[[PlacementCandidate], float] | None = None,
    margin: float = TIE_MARGIN,
    keep: int = MAX_FINALISTS,
    start: PlacementCandidate | None = None,
) -> list[PlacementCandidate]:
    """`chosen` (the best greedy score) and the candidates of `scored` whose greedy score is
    within `margin` of it and whose bound does not exceed it, lowest scores first (ties by
    name), `keep` at most; then `start`, the cut the climb moved from, if it is another."""
    best = scores[chosen.name]
    near = sorted(
        (scores[name], name)
        for name in scored
        if name != chosen.name and name in scores and scores[name] <= best * (1.0 + margin)
    )
    out = [chosen]
    for _, name in near:
        if len(out) == keep:
            break
        cand = scored[name]
        if bound is None or bound(cand) <= best:
            out.append(cand)
    if start is not None and all(c.name != start.name for c in out):
        out.append(start)
    return out


def settle_near_ties(
    chosen: PlacementCandidate,
    scores: Mapping[str, float],
    scored: Mapping[str, PlacementCandidate],
    *,
    evaluate: Callable[[PlacementCandidate], float],
    bound: Callable[[PlacementCandidate], float] | None = None,
    workers: int = 1,
    margin: float = TIE_MARGIN,
    keep: int = MAX_FINALISTS,
    start: PlacementCandidate | None = None,
) -> tuple[PlacementCandidate, dict[str, float]]:
    """The finalist (`finalists`, `start` the climb's starting cut) that `evaluate` scores
    lowest, and the finalists' scores by name; `chosen` and no scores when it has no rival.
    `workers` as in `placement.choose_dip_placement` (the same choice, sooner)."""
    cands = finalists(chosen, scores, scored, bound=bound, margin=margin, keep=keep, start=start)
    if len(cands) == 1:
        return chosen, {}
    settled: dict[int, float] = {}
    with CandidateScorer(evaluate, cands, workers=workers) as scorer:
        for i, score in scorer.scored(range(len(cands)), stop=lambda i: False):
            settled[i] = score
    winner = min(range(len(cands)), key=lambda i: (settled[i], i))
    planned = {cands[i].name: settled[i] for i in range(len(cands))}
    logger.info(
        "placement near-ties (within %.1f%% of the best greedy score, and the cut the climb "
        "started from), scored with the run's plans: %s; %r wins",
        100 * margin,
        planned,
        cands[winner].name,
    )
    return cands[winner], planned


__all__ = ["MAX_FINALISTS", "TIE_MARGIN", "finalists", "settle_near_ties"]
