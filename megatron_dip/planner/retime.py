"""A list schedule's per-rank orders timed again under other stage costs (same orders).

The memory pass may take back recomputation a schedule's own alive-sets do not need
(`memory.relax_choice`). Scheduling again with the cheaper stages lets the list scheduler pick
other orders, which under the memory limit it throttles differently (often into a longer
makespan); keeping the orders and only timing them again cannot: every node's start is the
latest of its rank's previous node's end and its inputs' arrival, both no later than before
when no duration grew, and the alive-sets are the orders' own, so the bytes are the ones the
relaxed choice was checked against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..schedule.ir import MemoryPolicy, StageId
from .list_scheduler import ListSchedule, StageGraph, _Run


def retimed(
    schedule: ListSchedule,
    graph: StageGraph,
    recompute: Callable[[StageId], MemoryPolicy],
    memory_limit: list[float] | None = None,
) -> ListSchedule | None:
    """`schedule`'s node order run with `graph`'s durations and bytes (the same stages, dataflow
    and ranks; `recompute` names the graph's memory policies), each node as early as its rank
    and its inputs allow; None for a schedule with split backwards or DP reductions (their W
    placement is the scheduler's own rule)."""
    run: _Run = schedule._run
    a = graph.arrays()
    stages = len(graph.stages)
    if (a.wgt_time > 0).any() or len(a.red_time) or (run.order >= 2 * stages).any():
        return None
    start = np.zeros(3 * stages)
    end = np.zeros(3 * stages)
    ready = np.zeros(2 * stages)
    free_at = np.zeros(graph.num_ranks)
    mem = np.zeros(graph.num_ranks)
    peak = np.zeros(graph.num_ranks)
    fwd, bwd, act, keeps = a.fwd_time, a.bwd_time, a.act, a.has_backward
    ptr, succ, delay = a.succ_ptr, a.succ_node, a.succ_delay
    for node in run.order.tolist():
        k, is_fwd = node >> 1, not node & 1
        r = a.rank[k]
        t0 = max(free_at[r], ready[node])
        stop = t0 + (fwd[k] if is_fwd else bwd[k])
        start[node], end[node], free_at[r] = t0, stop, stop
        if keeps[k]:
            mem[r] += act[k] if is_fwd else -act[k]
            peak[r] = max(peak[r], mem[r])
        for e in range(ptr[node], ptr[node + 1]):
            ready[succ[e]] = max(ready[succ[e]], stop + delay[e])
    limit = np.full(graph.num_ranks, np.inf) if memory_limit is None else np.asarray(memory_limit)
    peaks = tuple(int(x) for x in peak) if a.int_bytes else tuple(float(x) for x in peak)
    over = bool((peak > limit).any())
    makespan = float(end.max()) if len(end) else 0.0
    return ListSchedule(_Run(graph, run.order, start, end, makespan, peaks, over, ready), recompute)
