"""Memory pass: per rank, choose a recompute strategy per stage under an activation-memory limit.

Given the order a rank runs its stages in, the activations alive after each forward are known.
Choosing recompute mode m for a stage (one chunk on one sub-microbatch) changes both the bytes it
keeps until its backward and the time that backward takes. We pick one mode per stage so that
every alive-set fits under the limit at the least added time: only the stages alive at the peaks
need recomputing. A 0/1 integer programme per rank, solved with HiGHS (scipy.optimize.milp).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ..schedule.ir import Backward, Forward, Recompute, StageId

MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
ModeCost = Callable[[StageId, Recompute], "tuple[float, int]"]  # (fwd+bwd time, activation bytes)


class MemoryLimitError(ValueError):
    """No recompute choice fits the activation-memory limit."""


@dataclass(frozen=True)
class RecomputeChoice:
    """Recompute mode per stage, or per (module, chunk) for all its stages; what is not listed
    recomputes nothing."""

    modes: dict[StageId | tuple[str, int], Recompute]
    added_time: float

    def of(self, stage: StageId) -> Recompute:
        mode = self.modes.get(stage)
        return (
            mode
            if mode is not None
            else self.modes.get((stage.module, stage.chunk), Recompute.NONE)
        )


def _alive_sets(
    order: Sequence[Forward | Backward], keeps: Callable[[StageId], bool]
) -> list[list[StageId]]:
    alive: dict[StageId, None] = {}
    peaks: list[list[StageId]] = []
    for ins in order:
        if isinstance(ins, Forward) and keeps(ins.stage):
            alive[ins.stage] = None
            peaks.append(list(alive))
        elif isinstance(ins, Backward):
            alive.pop(ins.stage, None)
    return peaks


def choose_recompute(
    orders: Sequence[Sequence[Forward | Backward]],
    *,
    mode_cost: ModeCost,
    keeps_activations: Callable[[StageId], bool],
    memory_limit: Sequence[float],
) -> RecomputeChoice:
    """Cheapest per-stage recompute modes keeping every rank's alive activations under its limit."""
    modes: dict[StageId | tuple[str, int], Recompute] = {}
    added = 0.0
    for rank, order in enumerate(orders):
        chosen, extra = _solve_rank(rank, order, mode_cost, keeps_activations, memory_limit[rank])
        modes.update(chosen)
        added += extra
    return RecomputeChoice(modes, added)


# The exact MILP is solved only when this few stages need a decision (HiGHS slows down sharply
# beyond); the greedy answer stands otherwise and is the fallback when the solver's time runs out.
MILP_MAX_STAGES = 120
MILP_TIME_LIMIT_S = 0.5


@dataclass
class _RankProblem:
    stages: list[StageId]  # stages alive in at least one over-limit set
    cost: dict[tuple[StageId, Recompute], tuple[float, int]]  # (time, bytes)
    sets: list[list[StageId]]  # alive-sets that exceed the limit with no recomputation
    limit: float


def _problem(rank: int, order, mode_cost: ModeCost, keeps, limit: float) -> _RankProblem | None:
    peaks = _dedupe(_alive_sets(order, keeps))
    cost: dict[tuple[StageId, Recompute], tuple[float, int]] = {}
    for alive in peaks:
        for st in alive:
            if (st, Recompute.NONE) not in cost:
                for m in MODES:
                    cost[(st, m)] = mode_cost(st, m)
    over = [a for a in peaks if sum(cost[(st, Recompute.NONE)][1] for st in a) > limit]
    if not over:
        return None
    for alive in over:
        need = sum(cost[(st, Recompute.FULL)][1] for st in alive)
        if need > limit:
            raise MemoryLimitError(
                f"rank {rank}: activation-memory limit {limit / 2**30:.2f} GiB is below what this "
                f"schedule needs even with full recomputation ({need / 2**30:.2f} GiB); raise "
                "--dip-memory-limit-gb or use smaller sub-microbatches"
            )
    stages = sorted({st for a in over for st in a})
    return _RankProblem(stages, cost, over, limit)


def _greedy(pb: _RankProblem) -> dict[StageId, Recompute]:
    """Repeatedly relieve the most over-full set by the cheapest bytes-per-second upgrade."""
    mode = {st: Recompute.NONE for st in pb.stages}
    member: dict[StageId, list[int]] = {st: [] for st in pb.stages}
    for i, alive in enumerate(pb.sets):
        for st in alive:
            member[st].append(i)
    used = [sum(pb.cost[(st, Recompute.NONE)][1] for st in a) for a in pb.sets]
    while True:
        worst = max(range(len(used)), key=used.__getitem__)
        if used[worst] <= pb.limit:
            return mode
        best = None
        for st in pb.sets[worst]:
            t0, b0 = pb.cost[(st, mode[st])]
            for m in MODES:
                t1, b1 = pb.cost[(st, m)]
                if b1 < b0:
                    ratio = (b0 - b1) / max(t1 - t0, 1e-12)
                    if best is None or ratio > best[0]:
                        best = (ratio, st, m)
        _, st, m = best  # a full-recompute solution exists (checked), so an upgrade exists
        saved = pb.cost[(st, mode[st])][1] - pb.cost[(st, m)][1]
        for i in member[st]:
            used[i] -= saved
        mode[st] = m


def _exact(pb: _RankProblem) -> dict[StageId, Recompute] | None:
    """The MILP over the undecided stages (HiGHS), or None when too big or not solved in time."""
    if len(pb.stages) > MILP_MAX_STAGES:
        return None
    col = {
        (st, m): i * len(MODES) + j for i, st in enumerate(pb.stages) for j, m in enumerate(MODES)
    }
    n = len(col)
    objective = np.zeros(n)
    for (st, m), i in col.items():
        objective[i] = pb.cost[(st, m)][0] - pb.cost[(st, Recompute.NONE)][0]
    rows = np.zeros((len(pb.sets), n))
    for r, alive in enumerate(pb.sets):
        for st in alive:
            for m in MODES:
                rows[r, col[(st, m)]] += pb.cost[(st, m)][1]
    one_mode = np.kron(np.eye(len(pb.stages)), np.ones(len(MODES)))
    result = milp(
        objective,
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        constraints=[
            LinearConstraint(rows, -np.inf, np.full(len(pb.sets), pb.limit)),
            LinearConstraint(one_mode, 1, 1),
        ],
        options={"time_limit": MILP_TIME_LIMIT_S},
    )
    if result.x is None or result.status not in (0, 1):
        return None
    x = np.round(result.x).astype(int)
    return {st: m for (st, m), i in col.items() if x[i] == 1}


def _solve_rank(
    rank: int,
    order: Sequence[Forward | Backward],
    mode_cost: ModeCost,
    keeps: Callable[[StageId], bool],
    limit: float,
) -> tuple[dict[StageId, Recompute], float]:
    pb = _problem(rank, order, mode_cost, keeps, limit)
    if pb is None:
        return {}, 0.0

    def added(mode: dict[StageId, Recompute]) -> float:
        return sum(pb.cost[(st, m)][0] - pb.cost[(st, Recompute.NONE)][0] for st, m in mode.items())

    def fits(mode: dict[StageId, Recompute]) -> bool:
        return all(sum(pb.cost[(st, mode[st])][1] for st in a) <= limit for a in pb.sets)

    best = _greedy(pb)
    exact = _exact(pb)
    if exact is not None and fits(exact) and added(exact) < added(best):
        best = exact
    chosen = {st: m for st, m in best.items() if m is not Recompute.NONE}
    return chosen, added(best)


def _dedupe(peaks: list[list[StageId]]) -> list[list[StageId]]:
    """Drop alive-sets contained in the next one (only maximal sets constrain)."""
    out = []
    for i, p in enumerate(peaks):
        if i + 1 < len(peaks) and set(p) <= set(peaks[i + 1]):
            continue
        out.append(p)
    return out
