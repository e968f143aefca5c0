"""Dual-queue greedy list scheduler: per-rank compute orders from stage priorities.

Repeatedly take the rank whose next stage can start earliest. On that rank, when both a forward
and a backward are ready, alternate them as 1F1B does; when only one kind is ready take it (it
fills what would otherwise be a bubble); within a kind, the lowest priority value wins. A rank at
its activation-memory limit takes no more forwards; only when every rank is stuck that way is the
limit overcommitted (reported, so the memory pass can add recomputation).

The scheduler works on an indexed `StageGraph` built once per batch, so that the search can call
it thousands of times cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..schedule.graph import Dataflow
from ..schedule.ir import NO_RECOMPUTE, Backward, Forward, MessageKey, RecomputeMode, StageId

StageCostFn = Callable[[StageId, RecomputeMode], "tuple[float, float, int]"]  # fwd, bwd, bytes
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

    @property
    def num_nodes(self) -> int:
        return 2 * len(self.stages)


def build_stage_graph(
    dataflow: Dataflow,
    *,
    stage_cost: StageCostFn,
    transfer: TransferFn,
    recompute: Callable[[StageId], RecomputeMode] = lambda s: NO_RECOMPUTE,
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


@dataclass(frozen=True)
class ListSchedule:
    """Per-rank compute orders and the scheduler's own timing estimate."""

    orders: tuple[tuple[Forward | Backward, ...], ...]
    makespan: float
    peak_memory: tuple[int, ...]
    overcommitted: bool
    durations: dict = field(default_factory=dict, compare=False, repr=False)  # instr -> seconds

    def duration(self, rank: int, ins: Forward | Backward) -> float:
        """Estimated duration of a compute instruction (for the communication pass)."""
        return self.durations[ins]


class _RankState:
    __slots__ = ("fixed", "free_at", "last_fwd", "mem", "next_fixed", "ready_b", "ready_f")

    def __init__(self) -> None:
        self.fixed: list[tuple[tuple, int]] | None = None  # forward order when not filling bubbles
        self.next_fixed = 0
        self.free_at = 0.0
        self.last_fwd = False
        self.mem = 0
        self.ready_f: list[tuple[tuple, float, int]] = []  # (priority, ready time, node)
        self.ready_b: list[tuple[tuple, float, int]] = []


def list_schedule(
    graph: StageGraph,
    *,
    priority: Sequence[tuple],
    memory_limit: Sequence[float] | None = None,
    recompute: Callable[[StageId], RecomputeMode] = lambda s: NO_RECOMPUTE,
    fill_bubbles: bool = True,
) -> ListSchedule:
    """Schedule every node of `graph`; `priority[k]` orders stage k's nodes (lower first).

    With `fill_bubbles=False` each rank runs its forwards strictly in priority order (a fixed
    segment order, the ablation baseline without dual-queue interleaving): a ready forward waits
    while a higher-priority forward of the same rank is not ready.
    """
    return _ListScheduler(graph, priority, memory_limit, recompute, fill_bubbles).run()


class _ListScheduler:
    def __init__(self, graph, priority, memory_limit, recompute, fill_bubbles) -> None:
        self.graph = graph
        self.priority = priority
        self.recompute = recompute
        n = graph.num_ranks
        self.limit = list(memory_limit) if memory_limit is not None else [float("inf")] * n
        self.ranks = [_RankState() for _ in range(n)]
        if not fill_bubbles:
            for r, st in enumerate(self.ranks):
                st.fixed = sorted(
                    (priority[k], 2 * k) for k in range(len(graph.stages)) if graph.rank[k] == r
                )
        self.ready_time = [0.0] * graph.num_nodes
        self.npred = list(graph.npred)
        for k in range(len(graph.stages)):
            if self.npred[2 * k] == 0:
                self.ranks[graph.rank[k]].ready_f.append((priority[k], 0.0, 2 * k))
        self.orders: list[list[Forward | Backward]] = [[] for _ in range(n)]
        self.durations: dict[Forward | Backward, float] = {}
        self.peak = [0] * n
        self.overcommitted = False
        # Each rank's best next step only changes when the rank runs something or receives
        # newly ready work, so it is cached and recomputed for those ranks alone.
        self.cached: list[tuple[float, tuple] | None] = [None] * n
        self.dirty = set(range(n))

    def run(self) -> ListSchedule:
        finish = 0.0
        for _ in range(sum(1 + h for h in self.graph.has_backward)):
            start, r, entry = self._next()
            finish = max(finish, self._execute(r, entry, start))
        return ListSchedule(
            tuple(tuple(o) for o in self.orders),
            finish,
            tuple(self.peak),
            self.overcommitted,
            self.durations,
        )

    def _next(self) -> tuple[float, int, tuple]:
        for r in self.dirty:
            self.cached[r] = _rank_choice(self.graph, self.ranks[r], self.limit[r], strict=True)
        self.dirty.clear()
        options = [(c[0], r, c[1]) for r, c in enumerate(self.cached) if c is not None]
        if not options:  # every rank is stuck at its memory limit: overcommit the earliest
            for r, st in enumerate(self.ranks):
                c = _rank_choice(self.graph, st, self.limit[r], strict=False)
                if c is not None:
                    options.append((c[0], r, c[1]))
        if not options:
            raise RuntimeError("list scheduler stalled: the stage graph has a cycle")
        return min(options, key=lambda o: (o[0], o[1]))

    def _execute(self, r: int, entry: tuple, start: float) -> float:
        g, st = self.graph, self.ranks[r]
        self.dirty.add(r)
        node = entry[2]
        k, is_fwd = node // 2, node % 2 == 0
        (st.ready_f if is_fwd else st.ready_b).remove(entry)
        if is_fwd and st.fixed is not None:
            st.next_fixed += 1
        end = start + (g.fwd_time[k] if is_fwd else g.bwd_time[k])
        st.free_at, st.last_fwd = end, is_fwd
        if is_fwd:
            if g.has_backward[k]:
                st.mem += g.act_bytes[k]
                self.overcommitted |= st.mem > self.limit[r]
                self.peak[r] = max(self.peak[r], st.mem)
            ins: Forward | Backward = Forward(g.stages[k], *self.recompute(g.stages[k]))
        else:
            st.mem -= g.act_bytes[k]
            ins = Backward(g.stages[k])
        self.orders[r].append(ins)
        self.durations[ins] = max(end - start, 1e-12)  # the communication pass needs > 0
        self._release(node, end)
        return end

    def _release(self, node: int, end: float) -> None:
        g = self.graph
        for nxt, delay in g.succ[node]:
            self.ready_time[nxt] = max(self.ready_time[nxt], end + delay)
            self.npred[nxt] -= 1
            if self.npred[nxt] == 0:
                kk = nxt // 2
                target = self.ranks[g.rank[kk]]
                self.dirty.add(g.rank[kk])
                queue = target.ready_f if nxt % 2 == 0 else target.ready_b
                queue.append((self.priority[kk], self.ready_time[nxt], nxt))


def _rank_choice(
    graph: StageGraph, st: _RankState, limit: float, *, strict: bool
) -> tuple[float, tuple] | None:
    """(start time, queue entry) of the rank's next node, or None if nothing is allowed."""
    fwd = [e for e in st.ready_f if not strict or st.mem + graph.act_bytes[e[2] // 2] <= limit]
    if st.fixed is not None:
        nxt = st.fixed[st.next_fixed][1] if st.next_fixed < len(st.fixed) else -1
        fwd = [e for e in fwd if e[2] == nxt]
    if not fwd and not st.ready_b:
        return None
    t0 = max(st.free_at, min(e[1] for e in (*fwd, *st.ready_b)))
    avail_f = [e for e in fwd if e[1] <= t0]
    avail_b = [e for e in st.ready_b if e[1] <= t0]
    if avail_f and avail_b:
        queue = avail_b if st.last_fwd else avail_f
    else:
        queue = avail_f or avail_b
    return t0, min(queue)


def priorities_from_units(
    stages: Sequence[StageId], unit_order: Sequence[tuple[str, int]]
) -> list[tuple]:
    """Stage priorities from an order of (module, microbatch) units: earlier unit first, then
    sub-microbatch, then chunk."""
    position = {u: i for i, u in enumerate(unit_order)}
    return [(position[(s.module, s.microbatch)], s.sub, s.chunk) for s in stages]
