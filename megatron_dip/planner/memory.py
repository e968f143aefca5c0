"""Memory pass: per rank, choose a recompute strategy per stage under an activation-memory limit.

Given the order a rank runs its stages in, the activations alive after each forward are known.
Choosing recompute mode m for a stage (one chunk on one sub-microbatch) changes both the bytes it
keeps until its backward and the time that backward takes. We pick one mode per stage so that
every alive-set fits under the limit at the least added time: only the stages alive at the peaks
need recomputing. Per rank: a greedy choice (then undoing upgrades that became unnecessary),
improved by the exact 0/1 integer programme (HiGHS, scipy.optimize.milp) only where it is small;
the work is bounded by problem size and node count, never by the clock (see MILP_MAX_STAGES).

The modes of a stage are `stage_modes(layers)`: none, selective, Megatron's block method over the
first layer and over half of the chunk's layers (partial recomputation inside a chunk), and full;
the last one holds the least. With offload, also memory policies that move the saved tensors of
one or half of the chunk's layers to host memory, alone or after block recomputation of the
first layer (`MemoryPolicy`; the cost model prices the copies on the shared host link).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    Forward,
    MemoryPolicy,
    Recompute,
    RecomputeMode,
    StageId,
)
from .quiet import native_stdout_silenced

logger = logging.getLogger(__name__)

ModeCost = Callable[[StageId, RecomputeMode], "tuple[float, int]"]  # (fwd+bwd time, bytes)
StageModes = Callable[[StageId], Sequence[RecomputeMode]]


def stage_modes(layers: int, *, offload: bool = False) -> tuple[RecomputeMode, ...]:
    """The memory policies the memory pass chooses from for a chunk of `layers` layers (always
    five, or nine with `offload`; the cheapest first and the one that holds least last)."""
    half = max(1, layers // 2)
    recompute = (
        NO_RECOMPUTE,
        (Recompute.SELECTIVE, 0),
        (Recompute.BLOCK, 1),
        (Recompute.BLOCK, half),
    )
    if not offload:
        return (*recompute, (Recompute.FULL, 0))
    if layers == 0:  # an input- or output-only chunk: nothing to offload (same count of modes)
        return (*recompute, *recompute, (Recompute.FULL, 0))
    # One layer (whose copies usually hide behind the chunk's compute) and half of them, alone
    # and after block recomputation of the first layer (duplicates where the chunk is short).
    rest = max(1, (layers - 1) // 2)
    offloads = (
        MemoryPolicy(Recompute.NONE, 0, 1),
        MemoryPolicy(Recompute.NONE, 0, half),
        MemoryPolicy(Recompute.BLOCK, 1, 1) if layers > 1 else NO_RECOMPUTE,
        MemoryPolicy(Recompute.BLOCK, 1, rest) if layers > 1 else NO_RECOMPUTE,
    )
    return (*recompute, *offloads, (Recompute.FULL, 0))


class MemoryLimitError(ValueError):
    """No recompute choice fits the activation-memory limit."""


@dataclass(frozen=True)
class RecomputeChoice:
    """Recompute mode per stage, or per (module, chunk) for all its stages; what is not listed
    recomputes nothing."""

    modes: dict[StageId | tuple[str, int], RecomputeMode]
    added_time: float

    def of(self, stage: StageId) -> RecomputeMode:
        mode = self.modes.get(stage)
        return (
            mode if mode is not None else self.modes.get((stage.module, stage.chunk), NO_RECOMPUTE)
        )


def _alive_sets(
    order: Sequence[Forward | Backward], keeps: Callable[[StageId], bool]
) -> tuple[list[StageId], list[np.ndarray]]:
    """The rank's stages holding activations (indexed) and the maximal alive-sets: the stages
    alive right before each backward that follows a forward (only those can be peaks)."""
    index: dict[StageId, int] = {}
    alive: dict[int, None] = {}
    peaks: list[np.ndarray] = []
    grew = False
    for ins in order:
        if isinstance(ins, Forward) and keeps(ins.stage):
            alive[index.setdefault(ins.stage, len(index))] = None
            grew = True
        elif isinstance(ins, Backward) and ins.stage in index:
            if grew:
                peaks.append(np.fromiter(alive, dtype=np.int64, count=len(alive)))
                grew = False
            alive.pop(index[ins.stage], None)
    if grew:
        peaks.append(np.fromiter(alive, dtype=np.int64, count=len(alive)))
    return list(index), peaks


def choose_recompute(
    orders: Sequence[Sequence[Forward | Backward]],
    *,
    mode_cost: ModeCost,
    modes_of: StageModes,
    keeps_activations: Callable[[StageId], bool],
    memory_limit: Sequence[float],
) -> RecomputeChoice:
    """Cheapest per-stage recompute modes keeping every rank's alive activations under its
    limit; `modes_of(stage)` lists a stage's candidates (`stage_modes`)."""
    modes: dict[StageId | tuple[str, int], RecomputeMode] = {}
    added = 0.0
    for rank, order in enumerate(orders):
        problem = _Problem(mode_cost, modes_of, keeps_activations)
        chosen, extra = _solve_rank(rank, order, problem, memory_limit[rank])
        modes.update(chosen)
        added += extra
    return RecomputeChoice(modes, added)


# The memory pass is bounded by work, never by the clock: every result the ranks must agree on
# (plans made inline, by a restarted planner, or on another machine) depends on its input only.
# The greedy answer (relieve the fullest alive-set by the upgrade saving most bytes per second,
# then undo upgrades that turned out unnecessary) always stands; the exact 0/1 programme (HiGHS)
# improves on it only where it is small enough to finish within its node budget in milliseconds
# (HiGHS is deterministic for a given node limit; no time limit is set). A wall-clock limit made
# the chosen recompute modes, and so the plan bytes, depend on a rank's load (issue 22).
MILP_MAX_STAGES = 48
MILP_NODE_LIMIT = 200
# Nor when the greedy answer adds less than this share of the rank's compute: the exact solver
# can save at most what the greedy answer adds (the bound), so a solve cannot pay for itself.
MILP_MIN_GAIN = 0.01


@dataclass(frozen=True)
class _Problem:
    """What every rank's problem is built from."""

    mode_cost: ModeCost
    modes_of: StageModes
    keeps: Callable[[StageId], bool]


@dataclass
class _RankProblem:
    """Stage i's time and bytes under its mode j are time[i, j], nbytes[i, j] (j indexes the
    stage's `modes[i]`, the same number for every stage)."""

    stages: list[StageId]
    modes: list[Sequence[RecomputeMode]]
    time: np.ndarray
    nbytes: np.ndarray
    sets: list[np.ndarray]  # alive-sets (stage indices) over the limit with no recomputation
    limit: float


def _problem(rank: int, order, problem: _Problem, limit: float) -> _RankProblem | None:
    stages, peaks = _alive_sets(order, problem.keeps)
    if not stages:
        return None
    modes = [tuple(problem.modes_of(st)) for st in stages]
    costs = [[problem.mode_cost(st, m) for m in ms] for st, ms in zip(stages, modes)]
    time = np.array([[c[0] for c in row] for row in costs], dtype=float)
    nbytes = np.array([[c[1] for c in row] for row in costs], dtype=float)
    over = [a for a in peaks if nbytes[a, 0].sum() > limit]
    if not over:
        return None
    for alive in over:
        need = nbytes[alive, -1].sum()
        if need > limit:
            raise MemoryLimitError(
                f"rank {rank}: activation-memory limit {limit / 2**30:.2f} GiB is below what this "
                f"schedule needs even with full recomputation ({need / 2**30:.2f} GiB); raise "
                "--dip-memory-limit-gb or use smaller sub-microbatches"
            )
    return _RankProblem(stages, modes, time, nbytes, over, limit)


def _greedy(pb: _RankProblem) -> np.ndarray:
    """Mode index per stage: repeatedly relieve the most over-full set by the upgrade that saves
    the most bytes per second of added time."""
    n = len(pb.stages)
    mode = np.zeros(n, dtype=np.int64)
    member = np.zeros((len(pb.sets), n), dtype=bool)
    for i, alive in enumerate(pb.sets):
        member[i, alive] = True
    used = member @ pb.nbytes[:, 0]
    while True:
        worst = int(np.argmax(used))
        if used[worst] <= pb.limit:
            return mode
        cand = pb.sets[worst]
        saved = pb.nbytes[cand, mode[cand], None] - pb.nbytes[cand]  # [stages, modes]
        added = np.maximum(pb.time[cand] - pb.time[cand, mode[cand], None], 1e-12)
        ratio = np.where(saved > 0, saved / added, -np.inf)
        k, m = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        st = cand[k]
        used -= member[:, st] * saved[k, m]
        mode[st] = m


def _undo_unneeded(pb: _RankProblem, mode: np.ndarray) -> np.ndarray:
    """Step each upgraded stage (costliest upgrade first) back to the cheapest mode that keeps
    every alive-set under the limit: a greedy upgrade made early can become unnecessary once
    later upgrades relieved the same sets. Deterministic (ties by stage index)."""
    mode = mode.copy()
    member = np.zeros((len(pb.sets), len(pb.stages)), dtype=bool)
    for i, alive in enumerate(pb.sets):
        member[i, alive] = True
    rows = np.arange(len(pb.stages))
    used = member @ pb.nbytes[rows, mode]
    upgraded = [int(i) for i in np.flatnonzero(mode)]
    upgraded.sort(key=lambda i: (-(pb.time[i, mode[i]] - pb.time[i, 0]), i))
    for i in upgraded:
        for m in range(mode[i]):  # cheapest first
            if pb.time[i, m] >= pb.time[i, mode[i]]:
                continue
            grow = pb.nbytes[i, m] - pb.nbytes[i, mode[i]]
            if np.all(used[member[:, i]] + grow <= pb.limit):
                used[member[:, i]] += grow
                mode[i] = m
                break
    return mode


def _exact(pb: _RankProblem) -> np.ndarray | None:
    """The MILP over the stages of the over-limit sets (HiGHS); None when too big or unsolved."""
    # Imported here: scipy.optimize takes seconds to import on a loaded machine, and the
    # planner process should be ready before the first iterations (most plans never get here).
    involved = np.unique(np.concatenate(pb.sets))
    if len(involved) > MILP_MAX_STAGES:
        return None
    from scipy.optimize import Bounds, LinearConstraint, milp

    k = pb.time.shape[1]
    local = {int(st): i for i, st in enumerate(involved)}
    objective = (pb.time[involved] - pb.time[involved, :1]).ravel()
    rows = np.zeros((len(pb.sets), len(involved) * k))
    upper = np.full(len(pb.sets), pb.limit)
    for r, alive in enumerate(pb.sets):
        for st in alive:
            i = local[int(st)]
            rows[r, i * k : (i + 1) * k] = pb.nbytes[st]
    one_mode = np.kron(np.eye(len(involved)), np.ones(k))
    with native_stdout_silenced():  # HiGHS prints some messages from C++ whatever `disp` says
        result = milp(
            objective,
            integrality=np.ones(len(objective)),
            bounds=Bounds(0, 1),
            constraints=[LinearConstraint(rows, -np.inf, upper), LinearConstraint(one_mode, 1, 1)],
            options={"node_limit": MILP_NODE_LIMIT, "disp": False},
        )
    if result.x is None or result.status not in (0, 1):
        return None
    mode = np.zeros(len(pb.stages), dtype=np.int64)
    mode[involved] = np.round(result.x).reshape(len(involved), k).argmax(axis=1)
    return mode


def _solve_rank(
    rank: int, order: Sequence[Forward | Backward], problem: _Problem, limit: float
) -> tuple[dict[StageId, RecomputeMode], float]:
    pb = _problem(rank, order, problem, limit)
    if pb is None:
        return {}, 0.0
    rows = np.arange(len(pb.stages))

    def added(mode: np.ndarray) -> float:
        return float((pb.time[rows, mode] - pb.time[:, 0]).sum())

    def fits(mode: np.ndarray) -> bool:
        held = pb.nbytes[rows, mode]
        return all(held[a].sum() <= limit for a in pb.sets)

    best = _undo_unneeded(pb, _greedy(pb))
    if added(best) <= MILP_MIN_GAIN * float(pb.time[:, 0].sum()):
        exact = None  # nothing worth a solve
    else:
        exact = _exact(pb)
    if exact is not None and fits(exact) and added(exact) < added(best):
        best = exact
    chosen = {pb.stages[i]: pb.modes[i][m] for i, m in enumerate(best) if m != 0}
    return chosen, added(best)
