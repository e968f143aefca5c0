"""Memory pass: per rank, choose a recompute strategy per chunk under an activation-memory limit.

Given the order a rank runs its stages in, the activations alive after each forward are known.
Choosing recompute mode m for chunk c changes both the bytes each of c's stages keeps and the time
its backward takes. We pick one mode per chunk so that every alive-set fits under the limit at the
least added time: a small 0/1 integer programme per rank, solved with HiGHS (scipy.optimize.milp).
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
    """Recompute mode per (module, chunk); chunks not listed recompute nothing."""

    modes: dict[tuple[str, int], Recompute]
    added_time: float

    def of(self, stage: StageId) -> Recompute:
        return self.modes.get((stage.module, stage.chunk), Recompute.NONE)


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
    """Cheapest per-chunk recompute modes keeping every rank's alive activations under its limit."""
    modes: dict[tuple[str, int], Recompute] = {}
    added = 0.0
    for rank, order in enumerate(orders):
        chosen, extra = _solve_rank(rank, order, mode_cost, keeps_activations, memory_limit[rank])
        modes.update(chosen)
        added += extra
    return RecomputeChoice(modes, added)


def _solve_rank(
    rank: int,
    order: Sequence[Forward | Backward],
    mode_cost: ModeCost,
    keeps: Callable[[StageId], bool],
    limit: float,
) -> tuple[dict[tuple[str, int], Recompute], float]:
    peaks = _alive_sets(order, keeps)
    stages = sorted({s for p in peaks for s in p})
    if not stages:
        return {}, 0.0
    chunks = sorted({(s.module, s.chunk) for s in stages})
    col = {(c, m): i * len(MODES) + j for i, c in enumerate(chunks) for j, m in enumerate(MODES)}
    n = len(col)
    time_of = {(s, m): mode_cost(s, m) for s in stages for m in MODES}
    objective = np.zeros(n)
    for s in stages:
        base = time_of[(s, Recompute.NONE)][0]
        for m in MODES:
            objective[col[((s.module, s.chunk), m)]] += time_of[(s, m)][0] - base
    rows, upper = [], []
    for alive in _dedupe(peaks):
        row = np.zeros(n)
        for s in alive:
            for m in MODES:
                row[col[((s.module, s.chunk), m)]] += time_of[(s, m)][1]
        rows.append(row)
        upper.append(limit)
    one_mode = np.zeros((len(chunks), n))
    for i in range(len(chunks)):
        one_mode[i, i * len(MODES) : (i + 1) * len(MODES)] = 1
    result = milp(
        objective,
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        constraints=[
            LinearConstraint(np.array(rows), -np.inf, np.array(upper)),
            LinearConstraint(one_mode, 1, 1),
        ],
    )
    if not result.success:
        need = max(sum(time_of[(s, Recompute.FULL)][1] for s in alive) for alive in peaks)
        raise MemoryLimitError(
            f"rank {rank}: activation-memory limit {limit / 2**30:.2f} GiB is below what this "
            f"schedule needs even with full recomputation ({need / 2**30:.2f} GiB); raise "
            "--dip-memory-limit-gb or use smaller sub-microbatches"
        )
    x = np.round(result.x).astype(int)
    chosen = {c: m for (c, m), i in col.items() if x[i] == 1 and m is not Recompute.NONE}
    return chosen, float(objective @ x)


def _dedupe(peaks: list[list[StageId]]) -> list[list[StageId]]:
    """Drop alive-sets contained in the next one (only maximal sets constrain)."""
    out = []
    for i, p in enumerate(peaks):
        if i + 1 < len(peaks) and set(p) <= set(peaks[i + 1]):
            continue
        out.append(p)
    return out
