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
from ..schedule.ir import Backward, Forward, MessageKey, Recompute, StageId

StageCostFn = Callable[[StageId, Recompute], "tuple[float, float, int]"]  # fwd, bwd, act bytes
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
    recompute: Callable[[StageId], Recompute] = lambda s: Recompute.NONE,
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
    recompute: Callable[[StageId], Recompute] = lambda s: Recompute.NONE,
    fill_bubbles: bool = True,
) -> ListSchedule:
    """Schedule every node of `graph`; `priority[k]` orders stage k's nodes (lower first).

    With `fill_bubbles=False` each rank runs its forwards strictly in priority order (a fixed
    segment order, the ablation baseline without dual-queue interleaving): a ready forward waits
    while a higher-priority forward of the same rank is not ready.
    """
    n_ranks = graph.num_ranks
    limit = list(memory_limit) if memory_limit is not None else [float("inf")] * n_ranks
    ranks = [_RankState() for _ in range(n_ranks)]
    if not fill_bubbles:
        for r, st in enumerate(ranks):
            st.fixed = sorted(
                (priority[k], 2 * k) for k in range(len(graph.stages)) if graph.rank[k] == r
            )
    ready_time = [0.0] * graph.num_nodes
    npred = list(graph.npred)
    for k in range(len(graph.stages)):
        if npred[2 * k] == 0:
            ranks[graph.rank[k]].ready_f.append((priority[k], 0.0, 2 * k))
    orders: list[list[Forward | Backward]] = [[] for _ in range(n_ranks)]
    durations: dict[Forward | Backward, float] = {}
    peak = [0] * n_ranks
    remaining = sum(1 + h for h in graph.has_backward)
    overcommitted = False
    finish = 0.0
    while remaining:
        choice = _pick(graph, ranks, limit, strict=True) or _pick(graph, ranks, limit, strict=False)
        if choice is None:
            raise RuntimeError("list scheduler stalled: the stage graph has a cycle")
        r, entry, start = choice
        st = ranks[r]
        node = entry[2]
        k, is_fwd = node // 2, node % 2 == 0
        (st.ready_f if is_fwd else st.ready_b).remove(entry)
        if is_fwd and st.fixed is not None:
            st.next_fixed += 1
        end = start + (graph.fwd_time[k] if is_fwd else graph.bwd_time[k])
        st.free_at, st.last_fwd = end, is_fwd
        if is_fwd:
            if graph.has_backward[k]:
                st.mem += graph.act_bytes[k]
                overcommitted |= st.mem > limit[r]
                peak[r] = max(peak[r], st.mem)
            ins: Forward | Backward = Forward(graph.stages[k], recompute(graph.stages[k]))
        else:
            st.mem -= graph.act_bytes[k]
            ins = Backward(graph.stages[k])
        orders[r].append(ins)
        durations[ins] = max(end - start, 1e-12)  # the communication pass needs positive times
        finish = max(finish, end)
        remaining -= 1
        for nxt, delay in graph.succ[node]:
            ready_time[nxt] = max(ready_time[nxt], end + delay)
            npred[nxt] -= 1
            if npred[nxt] == 0:
                kk = nxt // 2
                target = ranks[graph.rank[kk]]
                queue = target.ready_f if nxt % 2 == 0 else target.ready_b
                queue.append((priority[kk], ready_time[nxt], nxt))
    return ListSchedule(
        tuple(tuple(o) for o in orders), finish, tuple(peak), overcommitted, durations
    )


def _pick(
    graph: StageGraph, ranks: list[_RankState], limit: list[float], *, strict: bool
) -> tuple[int, tuple, float] | None:
    """The (rank, queue entry, start time) to schedule next, or None if nothing is allowed."""
    best = None
    for r, st in enumerate(ranks):
        fwd = [
            e for e in st.ready_f if not strict or st.mem + graph.act_bytes[e[2] // 2] <= limit[r]
        ]
        if st.fixed is not None:
            nxt = st.fixed[st.next_fixed][1] if st.next_fixed < len(st.fixed) else -1
            fwd = [e for e in fwd if e[2] == nxt]
        if not fwd and not st.ready_b:
            continue
        t0 = max(st.free_at, min(e[1] for e in (*fwd, *st.ready_b)))
        if best is not None and t0 >= best[2]:
            continue
        avail_f = [e for e in fwd if e[1] <= t0]
        avail_b = [e for e in st.ready_b if e[1] <= t0]
        if avail_f and avail_b:
            queue = avail_b if st.last_fwd else avail_f
        else:
            queue = avail_f or avail_b
        best = (r, min(queue), t0)
    return best


def priorities_from_units(
    stages: Sequence[StageId], unit_order: Sequence[tuple[str, int]]
) -> list[tuple]:
    """Stage priorities from an order of (module, microbatch) units: earlier unit first, then
    sub-microbatch, then chunk."""
    position = {u: i for i, u in enumerate(unit_order)}
    return [(position[(s.module, s.microbatch)], s.sub, s.chunk) for s in stages]
