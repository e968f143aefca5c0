"""The list scheduler and the execution engine as they were before their rewrites for speed
(issue 16), kept verbatim as the references the fast versions are compared against
(`test_fast_paths.py`). Not used by the package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_dip.planner.list_scheduler import StageGraph
from megatron_dip.schedule.engine import ChannelFn, DeadlockError, PlanError, single_channel
from megatron_dip.schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    Forward,
    Instruction,
    MemoryPolicy,
    MessageKey,
    Program,
    Recv,
    Send,
    StageId,
    Wait,
)

ComputeTime = Callable[[int, Instruction], float]
TransferTime = Callable[[Send], float]


@dataclass(frozen=True)
class ListSchedule:
    """Per-rank compute orders and the scheduler's own timing estimate."""

    orders: tuple[tuple[Forward | Backward, ...], ...]
    makespan: float
    peak_memory: tuple[int, ...]
    overcommitted: bool
    durations: dict = field(default_factory=dict, compare=False, repr=False)  # instr -> seconds


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


def reference_list_schedule(
    graph: StageGraph,
    *,
    priority: Sequence[tuple],
    memory_limit: Sequence[float] | None = None,
    recompute: Callable[[StageId], MemoryPolicy] = lambda s: NO_RECOMPUTE,
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
            ins: Forward | Backward = Forward(g.stages[k], self.recompute(g.stages[k]))
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


# -- the execution engine (schedule/engine.py) before its integer-indexed rewrite -----------------


@dataclass
class _Result:
    finish: list[float]
    spans: list
    waits: list
    op_complete: dict


@dataclass
class _Batch:
    rank: int
    first: int  # index of the first instruction of the batch
    ops: list[Send | Recv]
    channel: object = 0
    post: float | None = None
    start: float | None = None
    complete: float | None = None
    op_complete: dict[tuple[bool, MessageKey], float] = field(default_factory=dict)


def _split_batches(
    program: Program, channel: ChannelFn
) -> tuple[list[_Batch], dict[int, list[int]]]:
    """Maximal runs of consecutive Send/Recv, split by channel; first instruction index of a run
    -> the batches it posts."""
    batches: list[_Batch] = []
    first_of: dict[int, list[int]] = {}
    instrs = program.instructions
    i = 0
    while i < len(instrs):
        if isinstance(instrs[i], (Send, Recv)):
            j = i
            while j < len(instrs) and isinstance(instrs[j], (Send, Recv)):
                j += 1
            by_channel: dict[object, list[Send | Recv]] = {}
            for op in instrs[i:j]:
                by_channel.setdefault(channel(program.rank, op), []).append(op)
            first_of[i] = []
            for ch, ops in by_channel.items():
                first_of[i].append(len(batches))
                batches.append(_Batch(program.rank, i, ops, ch))
            i = j
        else:
            i += 1
    return batches, first_of


class _Machine:
    def __init__(
        self,
        programs: Sequence[Program],
        compute_time: ComputeTime,
        transfer_time: TransferTime,
        post_overhead: float,
        channel: ChannelFn,
        whole_batches: bool,
    ) -> None:
        self.programs = programs
        self.whole_batches = whole_batches
        self.compute_time = compute_time
        self.transfer_time = transfer_time
        self.post_overhead = post_overhead
        n = len(programs)
        self.pc = [0] * n
        self.clock = [0.0] * n
        self.batches: list[list[_Batch]] = []
        self.first_of: list[dict[int, list[int]]] = []
        # Per rank and channel: the batch indices in order, and the first not yet completed.
        self.queues: list[dict[object, list[int]]] = []
        self.active: list[dict[object, int]] = []
        self.where: dict[tuple[bool, MessageKey], tuple[int, int]] = {}
        for p in programs:
            b, f = _split_batches(p, channel)
            self.batches.append(b)
            self.first_of.append(f)
            queues: dict[object, list[int]] = {}
            for bi, batch in enumerate(b):
                queues.setdefault(batch.channel, []).append(bi)
            self.queues.append(queues)
            self.active.append(dict.fromkeys(queues, 0))
            for bi, batch in enumerate(b):
                for op in batch.ops:
                    slot = (isinstance(op, Send), op.key)
                    if slot in self.where:
                        other = self.where[slot][0]
                        kind = "send" if slot[0] else "receive"
                        raise PlanError(
                            f"message {op.key} has a second {kind} on rank {p.rank} "
                            f"(first on rank {other})"
                        )
                    self.where[slot] = (p.rank, bi)
        self.spans: list[list[tuple[int, float, float]]] = [[] for _ in programs]
        self.waits: list[list[tuple[int, float, float]]] = [[] for _ in programs]
        self.op_complete: dict[tuple[int, bool, MessageKey], float] = {}
        self._check_pairs()

    def _check_pairs(self) -> None:
        for (is_send, key), (rank, _) in self.where.items():
            if (not is_send, key) not in self.where:
                missing = "receive" if is_send else "send"
                op = "send" if is_send else "receive"
                raise PlanError(f"rank {rank}: {op} of {key} has no matching {missing} on any rank")
            peer = self.where[(not is_send, key)][0]
            declared = self._op(rank, is_send, key).peer
            if declared != peer:
                raise PlanError(
                    f"rank {rank}: {key} names peer {declared}, but the matching op is on rank {peer}"
                )

    def _op(self, rank: int, is_send: bool, key: MessageKey) -> Send | Recv:
        bi = self.where[(is_send, key)][1]
        for op in self.batches[rank][bi].ops:
            if isinstance(op, Send) == is_send and op.key == key:
                return op
        raise AssertionError("unreachable")

    # -- rank progress ---------------------------------------------------------------------

    def advance(self, r: int) -> bool:
        instrs = self.programs[r].instructions
        moved = False
        while self.pc[r] < len(instrs):
            ins = instrs[self.pc[r]]
            if isinstance(ins, (Forward, Backward)):
                start = self.clock[r]
                self.clock[r] = start + self.compute_time(r, ins)
                self.spans[r].append((self.pc[r], start, self.clock[r]))
                self.pc[r] += 1
            elif isinstance(ins, (Send, Recv)):
                posted = [self.batches[r][bi] for bi in self.first_of[r][self.pc[r]]]
                self.clock[r] += self.post_overhead
                for batch in posted:
                    batch.post = self.clock[r]
                self.pc[r] += sum(len(b.ops) for b in posted)
            elif isinstance(ins, Wait):
                done = self._wait_time(r, ins)
                if done is None:
                    return moved
                self.waits[r].append((self.pc[r], self.clock[r], max(self.clock[r], done)))
                self.clock[r] = max(self.clock[r], done)
                self.pc[r] += 1
            else:
                raise PlanError(f"rank {r}: instruction {self.pc[r]} has unknown type {ins!r}")
            moved = True
        return moved

    def _wait_time(self, r: int, ins: Wait) -> float | None:
        latest = self.clock[r]
        for key in ins.keys:
            t = self.op_complete.get((r, True, key), self.op_complete.get((r, False, key)))
            if t is not None and self.whole_batches:  # the batch holding it, as a whole
                mine = (True, key) if self.where.get((True, key), (-1,))[0] == r else (False, key)
                t = self.batches[r][self.where[mine][1]].complete
            if t is None:
                posted = [
                    s for s in ((True, key), (False, key)) if self.where.get(s, (-1,))[0] == r
                ]
                if not posted:
                    raise PlanError(
                        f"rank {r}: instruction {self.pc[r]} waits for {key}, "
                        "which this rank neither sends nor receives"
                    )
                bi = self.where[posted[0]][1]
                if self.batches[r][bi].post is None:
                    raise PlanError(
                        f"rank {r}: instruction {self.pc[r]} waits for {key} before posting it"
                    )
                return None
            latest = max(latest, t)
        return latest

    # -- communication progress ------------------------------------------------------------

    def resolve(self, r: int) -> bool:
        moved = False
        for ch, queue in self.queues[r].items():
            moved |= self._resolve_channel(r, ch, queue)
        return moved

    def _resolve_channel(self, r: int, ch: object, queue: list[int]) -> bool:
        moved = False
        batches = self.batches[r]
        while self.active[r][ch] < len(queue):
            k = self.active[r][ch]
            b = batches[queue[k]]
            if b.start is None:
                if b.post is None:
                    return moved
                prev = batches[queue[k - 1]].complete if k else 0.0
                b.start = max(b.post, prev or 0.0)
                moved = True
            for op in b.ops:
                slot = (isinstance(op, Send), op.key)
                if slot in b.op_complete:
                    continue
                peer_rank, peer_bi = self.where[(not slot[0], op.key)]
                peer = self.batches[peer_rank][peer_bi]
                if peer.start is None:
                    continue
                send = op if isinstance(op, Send) else self._op(peer_rank, True, op.key)
                t = max(b.start, peer.start) + self.transfer_time(send)
                b.op_complete[slot] = t
                peer.op_complete[(not slot[0], op.key)] = t
                self.op_complete[(r, slot[0], op.key)] = t
                self.op_complete[(peer_rank, not slot[0], op.key)] = t
                moved = True
            if len(b.op_complete) < len(b.ops):
                return moved
            b.complete = max(b.op_complete.values())
            self.active[r][ch] += 1
            moved = True
        return moved

    # -- driver ----------------------------------------------------------------------------

    def run(self) -> _Result:
        n = len(self.programs)
        progress = True
        while progress:
            progress = False
            for r in range(n):
                progress |= self.advance(r)
            for r in range(n):
                progress |= self.resolve(r)
        unfinished = [
            r
            for r in range(n)
            if self.pc[r] < len(self.programs[r].instructions)
            or any(self.active[r][ch] < len(q) for ch, q in self.queues[r].items())
        ]
        if unfinished:
            raise DeadlockError([self._describe_blocked(r) for r in unfinished])
        finish = [
            max([self.clock[r]] + [b.complete or 0.0 for b in self.batches[r]]) for r in range(n)
        ]
        return _Result(finish, self.spans, self.waits, self.op_complete)

    def _describe_blocked(self, r: int) -> str:
        instrs = self.programs[r].instructions
        if self.pc[r] < len(instrs):
            where = f"rank {r} blocked at instruction {self.pc[r]} ({_short(instrs[self.pc[r]])})"
        else:
            where = f"rank {r} at end of program"
        parts = []
        for ch, queue in self.queues[r].items():
            if self.active[r][ch] < len(queue):
                parts.append(self._describe_batch(r, self.batches[r][queue[self.active[r][ch]]]))
        return "; ".join([where, *parts])

    def _describe_batch(self, r: int, b: _Batch) -> str:
        if b.start is None:
            return f"its batch at instruction {b.first} is not posted yet"
        pending = []
        instrs = self.programs[r].instructions
        for op in b.ops:
            if (isinstance(op, Send), op.key) in b.op_complete:
                continue
            peer_rank, peer_bi = self.where[(not isinstance(op, Send), op.key)]
            peer_first = self.batches[peer_rank][peer_bi].first
            index = next(i for i in range(b.first, len(instrs)) if instrs[i] is op)
            pending.append(
                f"{_short(op)} (instruction {index}) waits for rank "
                f"{peer_rank}'s batch at instruction {peer_first}"
            )
        return "pending: " + "; ".join(pending)


def _short(ins: Instruction) -> str:
    if isinstance(ins, Forward):
        return f"F {ins.stage}"
    if isinstance(ins, Backward):
        return f"B {ins.stage}"
    if isinstance(ins, Send):
        return f"send {ins.key} to {ins.peer}"
    if isinstance(ins, Recv):
        return f"recv {ins.key} from {ins.peer}"
    return "wait " + ", ".join(str(k) for k in ins.keys)


def reference_execute_programs(
    programs,
    *,
    compute_time=None,
    transfer_time=None,
    post_overhead=0.0,
    channel=single_channel,
    whole_batches=False,
) -> _Result:
    """`execute_programs` as it was (a wait returns when the named operations completed, or,
    with `whole_batches`, the whole batches holding them)."""
    machine = _Machine(
        programs,
        compute_time or (lambda r, i: 0.0),
        transfer_time or (lambda s: 0.0),
        post_overhead,
        channel,
        whole_batches,
    )
    return machine.run()
