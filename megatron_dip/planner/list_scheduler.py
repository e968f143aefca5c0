"""Dual-queue greedy list scheduler: per-rank compute orders from stage priorities.

Repeatedly take the rank whose next stage can start earliest. On that rank, when both a forward
and a backward are ready, alternate them as 1F1B does; when only one kind is ready take it (it
fills what would otherwise be a bubble); within a kind, the lowest priority value wins. A rank at
its activation-memory limit takes no more forwards; only when every rank is stuck that way is the
limit overcommitted (reported, so the memory pass can add recomputation).

The scheduler works on an indexed `StageGraph` built once per batch (its edges once per plan:
`StageGraph.with_costs` swaps the stage costs of another recompute choice in), flattened to
arrays and run by a compiled kernel (`schedule_kernel.run_schedule`, about 0.5 us per node), so
that the search can call it hundreds of times per batch. `list_makespan` is the search's score
(no instructions built); `list_schedule` builds the instruction orders when they are first used.
Ties are broken as the interpreted scheduler this replaced did (by priority, then ready time,
then node; ranks by start time, then rank): `tests/reference_planner.py` keeps it, and
`tests/test_fast_paths.py` checks that both give the same orders, times and peaks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..schedule.graph import Dataflow
from ..schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    MemoryPolicy,
    MessageKey,
    StageId,
)
from .schedule_kernel import run_schedule

StageCostFn = Callable[[StageId, MemoryPolicy], "tuple[float, float, int]"]  # fwd, bwd, bytes
TransferFn = Callable[[MessageKey], float]


@dataclass
class StageGraph:
    """Forward and backward nodes of every stage with their durations and dependencies.

    Node 2k is the forward of `stages[k]`, node 2k+1 its backward (absent when the module needs
    no backward: `has_backward[k]` False).
    """

    stages: list[StageId]
    rank: list[int]  # per stage
    fwd_time: list[float]
    bwd_time: list[float]
    act_bytes: list[int]
    has_backward: list[bool]
    succ: list[list[tuple[int, float]]]  # per node: (successor node, transfer delay)
    npred: list[int]  # per node
    num_ranks: int
    # Per stage: seconds of its split backward's weight-gradient half W (node 2S+k), 0 where the
    # backward is fused; `bwd_time` is then the input-gradient half B alone (`with_split`).
    wgt_time: list[float] | None = None
    # Per stage: bytes held from its split B to its W (instead of `act_bytes`).
    wgt_bytes: list[float] | None = None
    # Data-parallel reductions (`with_reductions`): per stage its reduction group (-1: none),
    # per group the seconds of its reduction.
    red_group: list[int] | None = None
    red_time: list[float] | None = None
    _arrays: _GraphArrays | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return 2 * len(self.stages)

    def with_costs(
        self, stage_cost: StageCostFn, recompute: Callable[[StageId], MemoryPolicy]
    ) -> StageGraph:
        """The same graph (nodes, edges, transfer delays) with each stage's durations and bytes
        from `stage_cost(stage, recompute(stage))`: what `build_stage_graph` returns for the same
        dataflow and transfers under another recompute choice, without rebuilding the edges."""
        fwd, bwd, act = [], [], []
        for s in self.stages:
            f, b, a = stage_cost(s, recompute(s))
            fwd.append(f)
            bwd.append(b)
            act.append(a)
        graph = StageGraph(
            self.stages,
            self.rank,
            fwd,
            bwd,
            act,
            self.has_backward,
            self.succ,
            self.npred,
            self.num_ranks,
        )
        if self._arrays is not None:
            graph._arrays = dataclasses.replace(
                self._arrays,
                fwd_time=np.asarray(fwd, dtype=float),
                bwd_time=np.asarray(bwd, dtype=float),
                act=np.asarray(act, dtype=float),
                int_bytes=all(isinstance(x, int) for x in act),
                wgt_time=np.zeros(len(fwd)),
                wgt_act=np.asarray(act, dtype=float),
                **_reduction_arrays(graph),
            )
        return graph

    @property
    def split(self) -> bool:
        """Whether some backward of the graph is split into B and W."""
        return self.wgt_time is not None and any(w > 0 for w in self.wgt_time)

    def with_split(
        self,
        input_time: Sequence[float],
        weight_time: Sequence[float],
        weight_bytes: Sequence[float] | None = None,
    ) -> StageGraph:
        """The same graph with split backwards: stage k's B lasts `input_time[k]` and its W
        `weight_time[k]` (0: the backward stays fused, lasting `input_time[k]`); between them
        the stage holds `weight_bytes[k]` (None: its activations)."""
        held = list(weight_bytes) if weight_bytes is not None else list(self.act_bytes)
        graph = dataclasses.replace(
            self, bwd_time=list(input_time), wgt_time=list(weight_time), wgt_bytes=held
        )
        if self._arrays is not None:
            graph._arrays = dataclasses.replace(
                self._arrays,
                bwd_time=np.asarray(input_time, dtype=float),
                wgt_time=np.asarray(weight_time, dtype=float),
                wgt_act=np.asarray(held, dtype=float),
                int_bytes=self._arrays.int_bytes and all(float(x).is_integer() for x in held),
            )
        return graph

    def with_reductions(self, group: Sequence[int], seconds: Sequence[float]) -> StageGraph:
        """The same graph with data-parallel gradient reductions: stage k's gradients belong to
        reduction `group[k]` (its chunk; -1: none), whose reduction takes `seconds[group]` on
        its rank's reduction channel once every stage of the group has its W (or fused
        backward) done; the scheduler then keeps W from being deferred past the reductions'
        deadline (`schedule_kernel`)."""
        graph = dataclasses.replace(self, red_group=list(group), red_time=list(seconds))
        if self._arrays is not None:
            graph._arrays = dataclasses.replace(self._arrays, **_reduction_arrays(graph))
        return graph

    def arrays(self) -> _GraphArrays:
        """The graph as flat arrays for the compiled scheduler (built once; do not mutate the
        graph afterwards)."""
        if self._arrays is None:
            self._arrays = _GraphArrays.of(self)
        return self._arrays


@dataclass(frozen=True)
class _GraphArrays:
    rank: np.ndarray
    fwd_time: np.ndarray
    bwd_time: np.ndarray
    act: np.ndarray  # doubles: exact sums for integer byte counts
    int_bytes: bool  # all byte counts are integers (peaks are reported as int)
    has_backward: np.ndarray
    succ_ptr: np.ndarray  # CSR successor lists
    succ_node: np.ndarray
    succ_delay: np.ndarray
    npred: np.ndarray
    rank_ptr: np.ndarray  # stages per rank, cumulative
    no_fixed: np.ndarray
    no_fixed_ptr: np.ndarray
    units: dict[tuple[str, int], int]  # (module, microbatch) -> index
    unit: np.ndarray  # per stage: its unit's index
    sub: np.ndarray
    chunk: np.ndarray
    wgt_time: np.ndarray  # zeros: no split backwards
    wgt_act: np.ndarray  # bytes held from a split B to its W
    red_grp: np.ndarray  # per stage: reduction group, -1: none
    red_count: np.ndarray  # per group: stages with a backward
    red_time: np.ndarray  # per group: seconds of its reduction

    @classmethod
    def of(cls, g: StageGraph) -> _GraphArrays:
        rank = np.asarray(g.rank, dtype=np.int64)
        counts = np.bincount(rank, minlength=g.num_ranks) if len(rank) else np.zeros(g.num_ranks)
        units: dict[tuple[str, int], int] = {}
        unit = [units.setdefault((s.module, s.microbatch), len(units)) for s in g.stages]
        return cls(
            rank=rank,
            fwd_time=np.asarray(g.fwd_time, dtype=float),
            bwd_time=np.asarray(g.bwd_time, dtype=float),
            act=np.asarray(g.act_bytes, dtype=float),
            int_bytes=all(isinstance(x, int) for x in g.act_bytes),
            has_backward=np.asarray(g.has_backward, dtype=np.int64),
            succ_ptr=np.concatenate(([0], np.cumsum([len(s) for s in g.succ]))).astype(np.int64),
            succ_node=np.array([n for s in g.succ for n, _ in s], dtype=np.int64),
            succ_delay=np.array([d for s in g.succ for _, d in s], dtype=float),
            npred=np.asarray(g.npred, dtype=np.int64),
            rank_ptr=np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
            no_fixed=np.zeros(1, dtype=np.int64),
            no_fixed_ptr=np.zeros(g.num_ranks + 1, dtype=np.int64),
            units=units,
            unit=np.asarray(unit, dtype=np.int64),
            sub=np.asarray([s.sub for s in g.stages], dtype=np.int64),
            chunk=np.asarray([s.chunk for s in g.stages], dtype=np.int64),
            wgt_time=np.asarray(g.wgt_time or [0.0] * len(g.stages), dtype=float),
            wgt_act=np.asarray(g.wgt_bytes or g.act_bytes, dtype=float),
            **_reduction_arrays(g),
        )


def _reduction_arrays(g: StageGraph) -> dict[str, np.ndarray]:
    """The kernel's reduction arrays of `g` (no groups without `with_reductions`); a stage
    without a backward belongs to no group."""
    seconds = np.asarray(g.red_time or [], dtype=float)
    group = np.asarray(g.red_group or [-1] * len(g.stages), dtype=np.int64)
    group = np.where(np.asarray(g.has_backward, dtype=bool), group, -1)
    count = np.bincount(group[group >= 0], minlength=len(seconds)).astype(np.int64)
    return {"red_grp": group, "red_count": count, "red_time": seconds}


def build_stage_graph(
    dataflow: Dataflow,
    *,
    stage_cost: StageCostFn,
    transfer: TransferFn,
    recompute: Callable[[StageId], MemoryPolicy] = lambda s: NO_RECOMPUTE,
    forward_only: bool = False,
) -> StageGraph:
    """Index the stages of `dataflow` with their costs for the list scheduler."""
    stages = dataflow.stages()
    index = {s: k for k, s in enumerate(stages)}
    n = len(stages)
    rank = [dataflow.rank_of(s) for s in stages]
    fwd, bwd, act, has_b = [0.0] * n, [0.0] * n, [0] * n, [False] * n
    succ: list[list[tuple[int, float]]] = [[] for _ in range(2 * n)]
    npred = [0] * (2 * n)
    for k, s in enumerate(stages):
        fwd[k], bwd[k], act[k] = stage_cost(s, recompute(s))
        has_b[k] = dataflow.needs_backward(s.module) and not forward_only
        if has_b[k]:  # backward after own forward
            succ[2 * k].append((2 * k + 1, 0.0))
            npred[2 * k + 1] += 1
        for key in dataflow.forward_outputs(s):
            c = index[key.consumer]
            delay = transfer(key) if rank[c] != rank[k] else 0.0
            succ[2 * k].append((2 * c, delay))
            npred[2 * c] += 1
        for key in dataflow.backward_outputs(s) if has_b[k] else ():
            p = index[key.producer]
            delay = transfer(key) if rank[p] != rank[k] else 0.0
            succ[2 * k + 1].append((2 * p + 1, delay))
            npred[2 * p + 1] += 1
    return StageGraph(stages, rank, fwd, bwd, act, has_b, succ, npred, dataflow.placement.num_ranks)


class ListSchedule:
    """Per-rank compute orders and the scheduler's own timing estimate.

    `orders` (per rank, `Forward`/`Backward` instructions) and `durations` (instruction ->
    seconds) are built on first use: the planner compares most schedules by makespan and peak
    memory alone."""

    def __init__(self, run: _Run, recompute: Callable[[StageId], MemoryPolicy]) -> None:
        self._run, self._recompute = run, recompute
        self.makespan: float = run.makespan
        self.peak_memory: tuple[int, ...] = run.peak
        self.overcommitted: bool = run.overcommitted

    @functools.cached_property
    def _built(self) -> tuple[tuple[tuple[Forward | Backward, ...], ...], dict]:
        return self._run.instructions(self._recompute)

    @property
    def orders(self) -> tuple[tuple[Forward | Backward, ...], ...]:
        return self._built[0]

    @property
    def durations(self) -> dict:
        return self._built[1]

    def duration(self, rank: int, ins: Forward | Backward) -> float:
        """Estimated duration of a compute instruction (for the communication pass)."""
        return self.durations[ins]

    def __repr__(self) -> str:
        return (
            f"ListSchedule(makespan={self.makespan!r}, peak_memory={self.peak_memory!r}, "
            f"overcommitted={self.overcommitted!r})"
        )


def list_schedule(
    graph: StageGraph,
    *,
    priority: Sequence[tuple],
    memory_limit: Sequence[float] | None = None,
    recompute: Callable[[StageId], MemoryPolicy] = lambda s: NO_RECOMPUTE,
    fill_bubbles: bool = True,
    overshoot: float = 0.0,
) -> ListSchedule:
    """Schedule every node of `graph`; `priority[k]` orders stage k's nodes (lower first).

    With `fill_bubbles=False` each rank runs its forwards strictly in priority order (a fixed
    segment order, the ablation baseline without dual-queue interleaving): a ready forward waits
    while a higher-priority forward of the same rank is not ready. With split backwards
    (`StageGraph.with_split`) a rank runs its oldest pending W where it would idle, or in a gap
    before its next ready node that the W fits with at most `overshoot` of it overrunning
    (`schedule_kernel`); the orders then hold `BackwardInput` and `BackwardWeight`.
    """
    return ListSchedule(
        _run(graph, priority_ranks(priority), memory_limit, fill_bubbles, overshoot), recompute
    )


def list_makespan(
    graph: StageGraph,
    *,
    priority: Sequence[int] | np.ndarray,
    memory_limit: Sequence[float] | None = None,
    fill_bubbles: bool = True,
    overshoot: float = 0.0,
) -> float:
    """The makespan `list_schedule` reports, for integer priority ranks (`priority_ranks`,
    `unit_priority_ranks`), without building instructions: what the search scores."""
    return _run(graph, priority, memory_limit, fill_bubbles, overshoot).makespan


def split_list_schedule(
    graph: StageGraph,
    *,
    priority: Sequence[tuple],
    memory_limit: Sequence[float] | None = None,
    recompute: Callable[[StageId], MemoryPolicy] = lambda s: NO_RECOMPUTE,
    fill_bubbles: bool = True,
    overshoot: float = 0.0,
    rounds: int = 3,
) -> ListSchedule:
    """`list_schedule` of a graph with split backwards, run `rounds` times: each run after the
    first knows when every rank's next forward or backward was ready in the run before, so a
    rank with nothing ready runs a W only where it fits before that time (a W that overran it
    would delay the B chain of the drain), and the end of its compute is the deadline of the
    data-parallel reductions (`StageGraph.with_reductions`): no W is deferred so far that a
    chunk's reduction would end after it. The shortest run within memory (else the shortest)."""
    run = _split_runs(
        graph, priority_ranks(priority), memory_limit, fill_bubbles, overshoot, rounds
    )
    return ListSchedule(run, recompute)


def split_list_makespan(
    graph: StageGraph,
    *,
    priority: Sequence[int] | np.ndarray,
    memory_limit: Sequence[float] | None = None,
    fill_bubbles: bool = True,
    overshoot: float = 0.0,
    rounds: int = 3,
) -> tuple[float, bool]:
    """(makespan, overcommitted) of `split_list_schedule`, for integer priority ranks, without
    building instructions: what the search scores split schedules by."""
    run = _split_runs(graph, priority, memory_limit, fill_bubbles, overshoot, rounds)
    return run.makespan, run.overcommitted


def _split_runs(graph, prank, memory_limit, fill_bubbles, overshoot, rounds) -> _Run:
    """The best of `split_list_schedule`'s runs (its docstring)."""
    prank = np.asarray(prank, dtype=np.int64)
    best, expect, deadline = None, None, np.inf
    for _ in range(rounds):
        run = _run(graph, prank, memory_limit, fill_bubbles, overshoot, expect, deadline)
        key = (run.overcommitted, run.makespan)
        if best is None or key < (best.overcommitted, best.makespan):
            best = run
        expect = run.compute_ready()
        deadline = float(run.end.max(initial=0.0))
    return best


def warm_up() -> None:
    """Load (or compile, the first time on a machine) the scheduler kernel now, not in the
    first plan: a two-stage graph on one rank."""
    stages = [StageId("warm-up", 0, 0), StageId("warm-up", 1, 0)]
    succ = [[(1, 0.0), (2, 0.0)], [], [(3, 0.0)], [(1, 0.0)]]
    graph = StageGraph(
        stages, [0, 0], [1.0, 1.0], [2.0, 2.0], [1, 1], [True, True], succ, [0, 2, 1, 1], 1
    )
    for fill in (True, False):
        list_makespan(graph, priority=[0, 1], memory_limit=[1.0], fill_bubbles=fill)


def priority_ranks(priority: Sequence[tuple]) -> np.ndarray:
    """Dense integer ranks of `priority` (equal priorities get equal ranks): comparing these
    decides exactly as comparing the priorities themselves."""
    order = sorted(range(len(priority)), key=priority.__getitem__)
    ranks = np.zeros(len(priority), dtype=np.int64)
    value, previous = -1, None
    for k in order:
        if value < 0 or priority[k] != previous:
            value, previous = value + 1, priority[k]
        ranks[k] = value
    return ranks


@dataclass(frozen=True)
class _Run:
    """One scheduler run in node numbers: `order` = the nodes in the order they were taken."""

    graph: StageGraph
    order: np.ndarray
    start: np.ndarray
    end: np.ndarray
    makespan: float
    peak: tuple
    overcommitted: bool
    ready: np.ndarray  # per F/B node: when all its inputs were there

    def compute_ready(self) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, the ready times of its forwards and backwards in the order they ran (CSR:
        pointers per rank, times): a later run's expectation of when each rank's next F/B can
        start (`schedule_kernel`)."""
        g = self.graph
        nodes = self.order[self.order < 2 * len(g.stages)]
        ranks = g.arrays().rank[nodes >> 1]
        by_rank = np.argsort(ranks, kind="stable")
        counts = np.bincount(ranks, minlength=g.num_ranks)
        ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        return ptr, self.ready[nodes[by_rank]].astype(float)

    def instructions(self, recompute: Callable[[StageId], MemoryPolicy]) -> tuple[tuple, dict]:
        """The per-rank instruction orders and their durations."""
        g = self.graph
        durations: dict[Forward | Backward | BackwardWeight, float] = {}
        orders: list[list[Forward | Backward | BackwardWeight]] = [[] for _ in range(g.num_ranks)]
        start, end = self.start.tolist(), self.end.tolist()
        weights = g.arrays().wgt_time
        n = len(g.stages)
        for node in self.order.tolist():
            k = node - 2 * n if node >= 2 * n else node >> 1
            stage = g.stages[k]
            if node >= 2 * n:
                ins = BackwardWeight(stage)
            elif not node & 1:
                ins = Forward(stage, recompute(stage))
            else:
                ins = BackwardInput(stage) if weights[k] > 0 else Backward(stage)
            orders[g.rank[k]].append(ins)
            durations[ins] = max(end[node] - start[node], 1e-12)  # the comm pass needs > 0
        return tuple(map(tuple, orders)), durations


def _run(
    graph: StageGraph,
    prank,
    memory_limit,
    fill_bubbles: bool,
    overshoot: float,
    expect=None,
    deadline: float = np.inf,
) -> _Run:
    a = graph.arrays()
    prank = np.asarray(prank, dtype=np.int64)
    n = graph.num_ranks
    limit = np.full(n, np.inf) if memory_limit is None else np.asarray(memory_limit, dtype=float)
    if fill_bubbles:
        fixed, fixed_ptr = a.no_fixed, a.no_fixed_ptr
    else:  # each rank's forwards in (priority, node) order
        fixed = 2 * np.lexsort((np.arange(len(prank)), prank, a.rank))
        fixed_ptr = a.rank_ptr
    status, order, start, end, makespan, peak, over, ready = run_schedule(
        a.rank,
        a.fwd_time,
        a.bwd_time,
        a.act,
        a.has_backward,
        prank,
        a.succ_ptr,
        a.succ_node,
        a.succ_delay,
        a.npred,
        limit,
        fixed,
        fixed_ptr,
        not fill_bubbles,
        a.wgt_time,
        a.wgt_act,
        float(overshoot),
        *(expect or (np.zeros(n + 1, dtype=np.int64), np.zeros(0))),
        a.red_grp,
        a.red_count,
        a.red_time,
        float(deadline),
    )
    if status:
        raise RuntimeError("list scheduler stalled: the stage graph has a cycle")
    peaks = tuple(int(x) for x in peak) if a.int_bytes else tuple(float(x) for x in peak)
    return _Run(graph, order, start, end, float(makespan), peaks, bool(over), ready)


def priorities_from_units(
    stages: Sequence[StageId], unit_order: Sequence[tuple[str, int]]
) -> list[tuple]:
    """Stage priorities from an order of (module, microbatch) units: earlier unit first, then
    sub-microbatch, then chunk."""
    position = {u: i for i, u in enumerate(unit_order)}
    return [(position[(s.module, s.microbatch)], s.sub, s.chunk) for s in stages]


def unit_priority_ranks(graph: StageGraph, unit_order: Sequence[tuple[str, int]]) -> np.ndarray:
    """`priority_ranks(priorities_from_units(graph.stages, unit_order))`, computed on arrays
    (the search calls it once per rollout)."""
    a = graph.arrays()
    position = np.zeros(len(a.units), dtype=np.int64)
    for i, u in enumerate(unit_order):
        if u in a.units:
            position[a.units[u]] = i
    missing = len(a.units) - len({u for u in unit_order if u in a.units})
    if missing:
        raise KeyError(f"unit order lacks {missing} unit(s) of the graph")
    keys = (position[a.unit], a.sub, a.chunk)
    order = np.lexsort(keys[::-1])
    ranks = np.empty(len(order), dtype=np.int64)
    if len(order):
        step = np.ones(len(order), dtype=np.int64)
        step[0] = 0
        same = np.ones(len(order) - 1, dtype=bool)
        for key in keys:
            same &= key[order[1:]] == key[order[:-1]]
        step[1:][same] = 0
        ranks[order] = np.cumsum(step)
    return ranks
