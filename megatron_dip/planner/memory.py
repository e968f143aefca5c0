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
first layer (`MemoryPolicy`; the cost model prices the copies on the shared host link). The
offloaded bytes a rank holds in host memory at once are bounded too (`host_limit`: its share of
the node's host memory), checked at every alive-set like the device limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    Forward,
    MemoryPolicy,
    Recompute,
    StageId,
)
from .quiet import native_stdout_silenced

logger = logging.getLogger(__name__)

ModeCost = Callable[[StageId, MemoryPolicy], "tuple[float, int]"]  # (fwd+bwd time, bytes)
HostBytes = Callable[[StageId, MemoryPolicy], float]  # bytes the mode keeps in host memory
StageModes = Callable[[StageId], Sequence[MemoryPolicy]]


def stage_modes(
    layers: int,
    *,
    offload: bool = False,
    hidden: int | Callable[[int], int] = 1,
    modules: tuple[str, ...] = (),
) -> tuple[MemoryPolicy, ...]:
    """The memory policies the memory pass chooses from for a chunk of `layers` layers (always
    five, or nine with `offload`, four more with `modules`; the cheapest first and the one that
    holds least last).

    `hidden(n)`: how many layers' copies hide behind the chunk's compute after block
    recomputation of its first n layers (`CostModel.hidden_offload_layers`; an int: the same for
    every n). Beyond that, offload pays its exposed transfer, and recomputing a layer costs
    about as much per byte as full recompute, so the offload policies are the offload that
    hides after block recomputation of none, one and half of the layers, and of the most
    layers after which one layer's offload still hides: the time-memory frontier between none
    and full. Where nothing hides, one layer is offered (exposed).

    `modules`: cheap module recomputation (`MemoryPolicy.modules`: the norms' and the MLP
    activation's outputs, a third to a half of a layer's bytes for a few per cent of its
    forward, about ten times cheaper per byte than recomputing layers) in the layers that keep
    their activations, offered with none, selective and block 1 / N/2 recompute (not with
    offload, which the runtime does not combine with it)."""
    half = max(1, layers // 2)
    recompute = (
        NO_RECOMPUTE,
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.BLOCK, 1),
        MemoryPolicy(Recompute.BLOCK, half),
    )
    if modules:
        mods = tuple(sorted(modules))
        recompute += tuple(MemoryPolicy(p.method, p.layers, 0, mods) for p in recompute)
    if not offload:
        return (*recompute, MemoryPolicy(Recompute.FULL, 0))
    if layers == 0:  # an input- or output-only chunk: nothing to offload (same count of modes)
        return (*recompute, *recompute[:4], MemoryPolicy(Recompute.FULL, 0))
    hides = hidden if callable(hidden) else (lambda n: hidden)
    most = next((n for n in range(layers - 1, half, -1) if hides(n) >= 1), half)
    offloads = tuple(_block_then_offload(layers, n, max(1, hides(n))) for n in (0, 1, half, most))
    return (*recompute, *offloads, MemoryPolicy(Recompute.FULL, 0))


def _block_then_offload(layers: int, n: int, k: int) -> MemoryPolicy:
    """Block recomputation of the first `n` layers, then offload of up to `k` of the rest
    (duplicates where the chunk is short)."""
    n = min(n, layers - 1) if n else 0
    k = min(k, layers - n)
    return MemoryPolicy(Recompute.BLOCK if n else Recompute.NONE, n, k)


class MemoryLimitError(ValueError):
    """No recompute choice fits the activation-memory limit."""


@dataclass(frozen=True)
class RecomputeChoice:
    """Recompute mode per stage, or per (module, chunk) for all its stages; what is not listed
    recomputes nothing."""

    modes: dict[StageId | tuple[str, int], MemoryPolicy]
    added_time: float

    def of(self, stage: StageId) -> MemoryPolicy:
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
    host_bytes: HostBytes | None = None,
    host_limit: Sequence[float] | None = None,
    row_cache: dict | None = None,
    floor: Callable[[StageId], MemoryPolicy] | None = None,
    exact: bool = True,
) -> RecomputeChoice:
    """Cheapest per-stage recompute modes keeping every rank's alive activations under its
    limit; `modes_of(stage)` lists a stage's candidates (`stage_modes`). With `host_bytes` and
    `host_limit`, the offloaded bytes alive at once on a rank stay under its host limit too
    (modes that offload nothing must report 0; the last, full recomputation, always does).
    `row_cache`: a dict the caller keeps across passes over the same stages and costs. With
    `floor`, each stage starts from `floor(stage)` and may only move to modes holding no more
    (the added time reported is over the floor's); stages left there are not listed.
    `exact=False`: the greedy answer alone, never the MILP (a pass that only tops up a choice
    already made, where a solve per round would cost more than it can save)."""
    modes: dict[StageId | tuple[str, int], MemoryPolicy] = {}
    added = 0.0
    for rank, order in enumerate(orders):
        problem = _Problem(
            mode_cost, modes_of, keeps_activations, host_bytes, row_cache, floor, exact
        )
        host = float("inf") if host_limit is None else host_limit[rank]
        chosen, extra = _solve_rank(rank, order, problem, (memory_limit[rank], host))
        modes.update(chosen)
        added += extra
    return RecomputeChoice(modes, added)


def within_host_limit(
    orders: Sequence[Sequence[Forward | Backward]],
    choice: RecomputeChoice,
    *,
    host_bytes: HostBytes,
    host_limit: Sequence[float],
    keeps_activations: Callable[[StageId], bool],
    mode_cost: ModeCost | None = None,
) -> RecomputeChoice:
    """`choice` with full recomputation instead of offload for the stages that take an
    alive-set of `orders` over its rank's host limit (the largest offloads first): the orders
    a schedule ends with under the device limit can differ from those the choice was made on.
    Full recomputation holds less device memory too, so the device limit still holds. With
    `mode_cost`, the choice's added time grows by what each demotion adds."""
    modes, added = dict(choice.modes), choice.added_time
    for rank, order in enumerate(orders):
        stages, peaks = _alive_sets(order, keeps_activations)
        held = np.array([host_bytes(st, choice.of(st)) for st in stages])
        for alive in peaks:
            excess = held[alive].sum() - host_limit[rank]
            for i in sorted(alive, key=lambda i: (-held[i], i)):
                if excess <= 0 or held[i] <= 0:
                    break
                if mode_cost is not None:
                    full, old = (
                        mode_cost(stages[i], MemoryPolicy(Recompute.FULL, 0)),
                        choice.of(stages[i]),
                    )
                    added += full[0] - mode_cost(stages[i], old)[0]
                modes[stages[i]] = MemoryPolicy(Recompute.FULL, 0)
                excess -= held[i]
                held[i] = 0.0
    return RecomputeChoice(modes, added)


def relax_choice(
    orders: Sequence[Sequence[Forward | Backward]],
    choice: RecomputeChoice,
    *,
    mode_cost: ModeCost,
    modes_of: StageModes,
    keeps_activations: Callable[[StageId], bool],
    memory_limit: Sequence[float],
    host_bytes: HostBytes | None = None,
    host_limit: Sequence[float] | None = None,
    row_cache: dict | None = None,
) -> RecomputeChoice:
    """`choice` with each stage stepped back to the cheapest of its modes that keeps every
    alive-set of `orders` under its rank's limits (`_undo_unneeded`, costliest upgrade first).

    The pass chooses modes on a schedule relaxed to more in-flight work than the real limit
    allows; the schedule made under the real limit with those modes throttles forwards and
    keeps fewer stages alive at once, so some of the recomputation it pays for frees bytes no
    alive-set of its own orders needs. Stages whose mode is not among `modes_of` keep it."""
    modes: dict[StageId | tuple[str, int], MemoryPolicy] = {}
    added = choice.added_time
    problem = _Problem(mode_cost, modes_of, keeps_activations, host_bytes, row_cache)
    for rank, order in enumerate(orders):
        stages, peaks = _alive_sets(order, keeps_activations)
        if not stages or not peaks:
            continue
        rows = [_row(problem, st, tuple(modes_of(st))) for st in stages]
        held = [choice.of(st) for st in stages]
        mode = np.array([r[0].index(m) if m in r[0] else -1 for r, m in zip(rows, held)])
        if not (mode > 0).any():
            continue
        fixed = mode < 0  # a mode outside the list: that mode alone, never moved
        rows = [
            _fixed_row(r, m, mode_cost, st) if f else r
            for r, m, st, f in zip(rows, held, stages, fixed)
        ]
        mode[fixed] = 0
        time = np.array([r[1] for r in rows], dtype=float)
        nbytes = np.array([r[2] for r in rows], dtype=float)
        pb = _RankProblem(
            stages, [r[0] for r in rows], time, nbytes, peaks, memory_limit[rank], peaks=peaks
        )
        if host_bytes is not None and host_limit is not None:
            _with_host(pb, problem, host_limit[rank])
        if not pb.fits(mode):
            continue  # `orders` do not fit `choice` itself: nothing to take back
        relaxed = _undo_unneeded(pb, mode)
        for i in np.flatnonzero((relaxed != mode) & ~fixed):
            modes[stages[i]] = pb.modes[i][relaxed[i]]
            added -= float(time[i, mode[i]] - time[i, relaxed[i]])
    if not modes:
        return choice
    return RecomputeChoice({**choice.modes, **modes}, added)


def _fixed_row(row: tuple, mode: MemoryPolicy, mode_cost: ModeCost, stage: StageId) -> tuple:
    """A row of `row`'s width holding `mode` in every place."""
    t, b = mode_cost(stage, mode)
    k = len(row[0])
    return (mode,) * k, [t] * k, [b] * k


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
    host_bytes: HostBytes | None = None
    rows: dict | None = None  # a cache of `_row`s shared across passes
    floor: Callable[[StageId], MemoryPolicy] | None = None
    exact: bool = True  # improve the greedy answer with the MILP where that is worth a solve


@dataclass
class _RankProblem:
    """Stage i's time and bytes under its mode j are time[i, j], nbytes[i, j] (j indexes the
    stage's `modes[i]`, the same number for every stage)."""

    stages: list[StageId]
    modes: list[Sequence[MemoryPolicy]]
    time: np.ndarray
    nbytes: np.ndarray
    sets: list[np.ndarray]  # alive-sets (stage indices) over the limit with no recomputation
    limit: float
    # Host memory, where some mode offloads: host[i, j] bytes, checked on every alive-set.
    host: np.ndarray | None = None
    host_sets: list[np.ndarray] = field(default_factory=list)
    host_limit: float = float("inf")
    peaks: list[np.ndarray] = field(default_factory=list)  # every maximal alive-set

    def members(self, sets: list[np.ndarray]) -> np.ndarray:
        """[set, stage] membership of `sets`."""
        member = np.zeros((len(sets), len(self.stages)), dtype=bool)
        for i, alive in enumerate(sets):
            member[i, alive] = True
        return member

    def added(self, mode: np.ndarray) -> float:
        """Seconds `mode` adds over every stage's first mode."""
        rows = np.arange(len(self.stages))
        return float((self.time[rows, mode] - self.time[:, 0]).sum())

    def fits(self, mode: np.ndarray) -> bool:
        """Whether `mode` keeps every over-limit alive-set under both limits."""
        held = self.nbytes[np.arange(len(self.stages)), mode]
        return all(held[a].sum() <= self.limit for a in self.sets) and self.host_fits(mode)

    def host_fits(self, mode: np.ndarray) -> bool:
        """Whether every alive-set's offloaded bytes under `mode` fit the host limit."""
        if self.host is None:
            return True
        held = self.host[np.arange(len(self.stages)), mode]
        return all(held[a].sum() <= self.host_limit for a in self.host_sets)


def _problem(rank: int, order, problem: _Problem, limit: float) -> _RankProblem | None:
    stages, peaks = _alive_sets(order, problem.keeps)
    if not stages:
        return None
    modes = [tuple(problem.modes_of(st)) for st in stages]
    rows = [_row(problem, st, ms) for st, ms in zip(stages, modes)]
    if problem.floor is not None:
        rows = [_upgrades(problem, st, row) for st, row in zip(stages, rows)]
        modes = [r[0] for r in rows]
    time = np.array([r[1] for r in rows], dtype=float)
    nbytes = np.array([r[2] for r in rows], dtype=float)
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
    return _RankProblem(stages, modes, time, nbytes, over, limit, peaks=peaks)


def _with_host(pb: _RankProblem, problem: _Problem, host_limit: float) -> bool:
    """Add the host-memory rows to `pb` (True), unless no mode of its stages offloads."""
    host = np.array(
        [[problem.host_bytes(st, m) for m in ms] for st, ms in zip(pb.stages, pb.modes)]
    )
    if not host.any():
        return False
    pb.host, pb.host_sets, pb.host_limit = host, pb.peaks, host_limit
    return True


def _row(problem: _Problem, stage: StageId, modes: tuple) -> tuple:
    """(modes, times, bytes) of a stage, from `problem.rows` where the same modes object was
    priced before (the planner's memoized `modes_of` returns one object per stage)."""
    found = problem.rows.get(stage) if problem.rows is not None else None
    if found is not None and found[0] is modes:
        return found
    costs = [problem.mode_cost(stage, m) for m in modes]
    found = (modes, [c[0] for c in costs], [c[1] for c in costs])
    if problem.rows is not None:
        problem.rows[stage] = found
    return found


def _upgrades(problem: _Problem, stage: StageId, row: tuple) -> tuple:
    """`row` with the stage's `floor` mode first and in place of every mode holding more."""
    modes, times, nbytes = row
    floor = problem.floor(stage)
    if floor == modes[0]:
        return row
    if floor in modes:
        t, b = times[modes.index(floor)], nbytes[modes.index(floor)]
    else:
        t, b = problem.mode_cost(stage, floor)
    keep = [k for k in range(1, len(modes)) if nbytes[k] <= b]
    out = ([floor], [t], [b])
    for k in range(1, len(modes)):
        ok = k in keep
        out[0].append(modes[k] if ok else floor)
        out[1].append(times[k] if ok else t)
        out[2].append(nbytes[k] if ok else b)
    return tuple(out[0]), out[1], out[2]


def _greedy(pb: _RankProblem) -> np.ndarray:
    """Mode index per stage: repeatedly relieve the most over-full set by the upgrade that saves
    the most bytes per second of added time. Where no upgrade of that set saves bytes (within
    the host limit), the answer is returned over the limit (the caller's `fits` says so)."""
    mode = np.zeros(len(pb.stages), dtype=np.int64)
    member = pb.members(pb.sets)
    used = member @ pb.nbytes[:, 0]
    host = _HostLedger(pb, mode)
    while True:
        worst = int(np.argmax(used))
        if used[worst] <= pb.limit:
            return mode
        cand = pb.sets[worst]
        saved = pb.nbytes[cand, mode[cand], None] - pb.nbytes[cand]  # [stages, modes]
        added = np.maximum(pb.time[cand] - pb.time[cand, mode[cand], None], 1e-12)
        ratio = np.where((saved > 0) & host.allows(cand, mode), saved / added, -np.inf)
        if not np.isfinite(ratio.max()):
            return mode  # nothing relieves this set: stepping on would loop for ever
        k, m = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        st = cand[k]
        used -= member[:, st] * saved[k, m]
        host.move(st, mode[st], m)
        mode[st] = m


class _HostLedger:
    """The offloaded bytes of every alive-set under the modes being chosen (no-op without a
    host limit): which upgrades stay within the host limit, and the move of one stage."""

    def __init__(self, pb: _RankProblem, mode: np.ndarray) -> None:
        self.pb = pb
        if pb.host is not None:
            self.member = pb.members(pb.host_sets)
            self.used = self.member @ pb.host[np.arange(len(pb.stages)), mode]

    def allows(self, cand: np.ndarray, mode: np.ndarray) -> np.ndarray:
        """[stages, modes]: whether moving stage cand[k] to mode j keeps every alive-set it is
        in under the host limit, or offloads no more than now (a set already over the limit,
        e.g. under a refinement's floor modes, must still be able to step off offload)."""
        pb = self.pb
        if pb.host is None:
            return np.ones((len(cand), pb.time.shape[1]), dtype=bool)
        grow = pb.host[cand] - pb.host[cand, mode[cand], None]
        slack = np.where(self.member[:, cand], pb.host_limit - self.used[:, None], np.inf)
        return (grow <= 0) | (grow <= slack.min(axis=0, initial=np.inf)[:, None])

    def move(self, stage: int, old: int, new: int) -> None:
        if self.pb.host is not None:
            grow = self.pb.host[stage, new] - self.pb.host[stage, old]
            self.used += self.member[:, stage] * grow


def _undo_unneeded(pb: _RankProblem, mode: np.ndarray) -> np.ndarray:
    """Step each upgraded stage (costliest upgrade first) back to the cheapest mode that keeps
    every alive-set under the limit: a greedy upgrade made early can become unnecessary once
    later upgrades relieved the same sets. Deterministic (ties by stage index)."""
    mode = mode.copy()
    member = pb.members(pb.sets)
    rows = np.arange(len(pb.stages))
    used = member @ pb.nbytes[rows, mode]
    host = _HostLedger(pb, mode)
    upgraded = [int(i) for i in np.flatnonzero(mode)]
    upgraded.sort(key=lambda i: (-(pb.time[i, mode[i]] - pb.time[i, 0]), i))
    for i in upgraded:
        for m in range(mode[i]):  # cheapest first
            if pb.time[i, m] >= pb.time[i, mode[i]]:
                continue
            grow = pb.nbytes[i, m] - pb.nbytes[i, mode[i]]
            stage = np.array([i])
            if np.all(used[member[:, i]] + grow <= pb.limit) and host.allows(stage, mode)[0, m]:
                used[member[:, i]] += grow
                host.move(i, mode[i], m)
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
    constraints = [LinearConstraint(rows, -np.inf, upper), LinearConstraint(one_mode, 1, 1)]
    if pb.host is not None:
        constraints.append(_host_rows(pb, involved, local))
    with native_stdout_silenced():  # HiGHS prints some messages from C++ whatever `disp` says
        result = milp(
            objective,
            integrality=np.ones(len(objective)),
            bounds=Bounds(0, 1),
            constraints=constraints,
            options={"node_limit": MILP_NODE_LIMIT, "disp": False},
        )
    if result.x is None or result.status not in (0, 1):
        return None
    mode = np.zeros(len(pb.stages), dtype=np.int64)
    mode[involved] = np.round(result.x).reshape(len(involved), k).argmax(axis=1)
    return mode


def _host_rows(pb: _RankProblem, involved: np.ndarray, local: dict[int, int]):
    """The MILP's host-memory rows: each alive-set's offloaded bytes of the solved stages,
    plus the fixed (mode 0) bytes of its other stages, under the host limit."""
    from scipy.optimize import LinearConstraint

    k = pb.host.shape[1]
    rows = np.zeros((len(pb.host_sets), len(involved) * k))
    upper = np.full(len(pb.host_sets), pb.host_limit)
    for r, alive in enumerate(pb.host_sets):
        for st in alive:
            i = local.get(int(st))
            if i is None:
                upper[r] -= pb.host[st, 0]
            else:
                rows[r, i * k : (i + 1) * k] = pb.host[st]
    return LinearConstraint(rows, -np.inf, upper)


def _solve_rank(
    rank: int,
    order: Sequence[Forward | Backward],
    problem: _Problem,
    limits: tuple[float, float],
) -> tuple[dict[StageId, MemoryPolicy], float]:
    """One rank's modes (device limit, host limit) and the time they add. The host limit is
    checked on the answer first and added to the problem only where that answer breaks it."""
    limit, host_limit = limits
    pb = _problem(rank, order, problem, limit)
    if pb is None:
        return {}, 0.0
    best = _solve(pb, exact=problem.exact)
    if problem.host_bytes is not None and host_limit < float("inf"):
        held = np.array(
            [problem.host_bytes(st, ms[m]) for st, ms, m in zip(pb.stages, pb.modes, best)]
        )
        if any(held[a].sum() > host_limit for a in pb.peaks) and _with_host(
            pb, problem, host_limit
        ):
            best = _solve(pb, exact=problem.exact)
    chosen = {pb.stages[i]: pb.modes[i][m] for i, m in enumerate(best) if m != 0}
    return chosen, pb.added(best)


def _solve(pb: _RankProblem, *, exact: bool) -> np.ndarray:
    """The greedy answer, improved by the exact one (`exact`) where that is worth a solve and
    fits."""
    best = _undo_unneeded(pb, _greedy(pb))
    if not exact or pb.added(best) <= MILP_MIN_GAIN * float(pb.time[:, 0].sum()):
        return best  # nothing worth a solve
    exact = _exact(pb)
    if exact is not None and pb.fits(exact) and pb.added(exact) < pb.added(best):
        return exact
    return best
