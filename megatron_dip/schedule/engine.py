"""Execution semantics of plans: one abstract machine for deadlock checks and timing.

`execute_programs` runs all ranks' programs under the semantics documented in `ir.py`
(non-blocking posts, batches starting in order on each rank, an operation completing when both
its batch and its counterpart's batch have started, blocking `Wait`s). With zero durations it is
the deadlock check used by validation; with a cost model's durations it is the simulator's core.

The machine is evaluated in max-plus form (each time is a max over the times it depends on), so
no global event queue is needed and the result does not depend on the order ranks are visited.

Host copies (activation offload, with a `host_copy` duration): every rank has one copy channel
per direction (the runtime's two side copy streams per device, device to host and back: the
PCIe link is full duplex), whose copies run one after another in the order they are issued. A
forward's copy out is issued `lead` seconds into the forward and never delays the compute. A
backward's reload is issued as the backward starts (where the runtime prefetches), once its
stage's copy out is done, and the backward, `window` seconds in, waits for it: it ends later by
the reload's finish past that point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .ir import (
    Backward,
    BackwardWeight,
    Channels,
    Forward,
    Instruction,
    MessageKey,
    Program,
    Recv,
    ReduceGrads,
    Send,
    Wait,
    compute_tag,
)

ComputeTime = Callable[[int, Instruction], float]
TransferTime = Callable[[Send], float]
# (rank, compute instruction) -> (lead or window seconds, seconds on the rank's copy channel):
# a forward's copy out issued `lead` into it, a backward's reload it waits for `window` into it.
HostCopy = Callable[[int, Instruction], "tuple[float, float]"]


class PlanError(ValueError):
    """A plan is not executable; the message names the ranks and instructions at fault."""


class DeadlockError(PlanError):
    """Every unfinished rank is blocked; `blocked` holds one description per rank."""

    def __init__(self, blocked: list[str]) -> None:
        self.blocked = blocked
        super().__init__("plan deadlocks:\n  " + "\n  ".join(blocked))


@dataclass
class ExecutionResult:
    """Times of one execution. `spans[r]` holds (instruction index, start, end) of each compute
    instruction of rank r (weight-gradient halves included), `waits[r]` (instruction index,
    start, end) of each blocking wait, `reductions[r]` (instruction index, start, end) of each
    data-parallel gradient reduction (they run one after another beside the compute and count
    in `finish`), `op_complete[(rank, is_send, key)]` when each point-to-point operation
    completed, `copies[r]` (instruction index, start, end) of each host copy on rank r's copy
    channels (a forward's copy out, a backward's reload; empty without `host_copy`)."""

    finish: list[float]
    spans: list[list[tuple[int, float, float]]]
    waits: list[list[tuple[int, float, float]]]
    _ops: list = field(repr=False, compare=False, default_factory=list)  # (rank, send, key, t)
    reductions: list[list[tuple[int, float, float]]] = field(default_factory=list)
    copies: list[list[tuple[int, float, float]]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.finish, default=0.0)

    @property
    def op_complete(self) -> dict[tuple[int, bool, MessageKey], float]:
        return {(r, s, k): t for r, s, k, t in self._ops}


ChannelFn = Callable[[int, "Send | Recv"], object]


def single_channel(rank: int, op: Send | Recv) -> object:
    """All point-to-point operations of a rank share one ordered stream (one NCCL communicator
    for the pipeline group, as Megatron-Core uses)."""
    return 0


def per_peer_channel(rank: int, op: Send | Recv) -> object:
    """One ordered stream per (sender, receiver) pair: a 2-rank communicator per direction."""
    return ("send", op.peer) if isinstance(op, Send) else ("recv", op.peer)


def channel_of(channels: Channels) -> ChannelFn:
    """The streams a plan's `Plan.channels` declares, as the machine's channel function."""
    return per_peer_channel if channels is Channels.PER_PEER else single_channel


_KINDS: dict[type, type] = {
    t: t for t in (Forward, Backward, BackwardWeight, ReduceGrads, Send, Recv, Wait)
}


def _kind(ins: object) -> type | None:
    """The instruction type `ins` is an instance of (a subclass counts as its base)."""
    return next((t for t in _KINDS if isinstance(ins, t)), None)


class _Ops:
    """Every Send/Recv of every program, numbered, with its batch and its counterpart.

    Batches are maximal runs of consecutive Send/Recv of a program, split by channel. Op i is
    `op[i]` on rank `rank[i]` in batch `batch[i]`; `other[i]` is the matching op on the peer.
    """

    def __init__(self, programs: Sequence[Program], channel: ChannelFn) -> None:
        self.op: list[Send | Recv] = []
        self.rank: list[int] = []
        self.batch: list[int] = []
        self.other: list[int] = []
        self.batch_rank: list[int] = []
        self.batch_first: list[int] = []  # instruction index where the batch's run starts
        self.batch_ops: list[list[int]] = []
        self.first_of: list[dict[int, list[int]]] = []  # per rank: run start -> its batches
        self.queues: list[list[list[int]]] = []  # per rank, per channel: batches in order
        # key -> [its send op, its receive op] (-1: none yet), also found by id(key): a plan's
        # Send, Recv and Wait usually share one key object, whose hash is not cheap.
        self.pairs: dict[MessageKey, list[int]] = {}
        self.by_id: dict[int, list[int]] = {}
        for p in programs:
            self._split(p, channel)
        self._check_pairs()

    def _split(self, program: Program, channel: ChannelFn) -> None:
        instrs, rank = program.instructions, program.rank
        first_of: dict[int, list[int]] = {}
        queues: dict[object, list[int]] = {}
        i = 0
        while i < len(instrs):
            if not isinstance(instrs[i], (Send, Recv)):
                i += 1
                continue
            j = i
            by_channel: dict[object, list[Send | Recv]] = {}
            while j < len(instrs) and isinstance(instrs[j], (Send, Recv)):
                by_channel.setdefault(channel(rank, instrs[j]), []).append(instrs[j])
                j += 1
            first_of[i] = []
            for ch, ops in by_channel.items():
                b = len(self.batch_rank)
                first_of[i].append(b)
                queues.setdefault(ch, []).append(b)
                self.batch_rank.append(rank)
                self.batch_first.append(i)
                self.batch_ops.append([self._add(rank, b, op) for op in ops])
            i = j
        self.first_of.append(first_of)
        self.queues.append(list(queues.values()))

    def pair(self, key: MessageKey) -> list[int] | None:
        """[send op, receive op] of `key` (-1 where absent), None if the key has no op."""
        found = self.by_id.get(id(key))
        if found is None:
            found = self.pairs.get(key)
            if found is not None:
                self.by_id[id(key)] = found
        return found

    def _add(self, rank: int, batch: int, op: Send | Recv) -> int:
        is_send = type(op) is Send or isinstance(op, Send)
        pair = self.pair(op.key)
        if pair is None:
            pair = self.pairs[op.key] = self.by_id[id(op.key)] = [-1, -1]
        side = 0 if is_send else 1
        if pair[side] >= 0:
            other = self.rank[pair[side]]
            kind = "send" if is_send else "receive"
            raise PlanError(
                f"message {op.key} has a second {kind} on rank {rank} (first on rank {other})"
            )
        i = len(self.op)
        pair[side] = i
        self.op.append(op)
        self.rank.append(rank)
        self.batch.append(batch)
        self.other.append(-1)
        return i

    def _check_pairs(self) -> None:
        for i, op in enumerate(self.op):
            is_send = type(op) is Send or isinstance(op, Send)
            key = op.key
            j = self.pair(key)[1 if is_send else 0]
            rank = self.rank[i]
            if j < 0:
                missing = "receive" if is_send else "send"
                what = "send" if is_send else "receive"
                raise PlanError(
                    f"rank {rank}: {what} of {key} has no matching {missing} on any rank"
                )
            if self.op[i].peer != self.rank[j]:
                raise PlanError(
                    f"rank {rank}: {key} names peer {self.op[i].peer}, but the matching op is on "
                    f"rank {self.rank[j]}"
                )
            self.other[i] = j


class _Machine:
    def __init__(
        self,
        programs: Sequence[Program],
        compute_time: ComputeTime,
        transfer_time: TransferTime,
        post_overhead: float,
        channel: ChannelFn,
        host_copy: HostCopy | None = None,
        whole_batches: bool = False,
    ) -> None:
        self.programs = programs
        self.host_copy = host_copy
        self.whole_batches = whole_batches
        self.compute_time = compute_time
        self.transfer_time = transfer_time
        self.post_overhead = post_overhead
        self.ops = ops = _Ops(programs, channel)
        n = len(programs)
        self.pc = [0] * n
        self.clock = [0.0] * n
        nb, no = len(ops.batch_rank), len(ops.op)
        self.post: list[float | None] = [None] * nb
        self.start: list[float | None] = [None] * nb
        self.complete: list[float | None] = [None] * nb
        self.pending = [len(o) for o in ops.batch_ops]  # ops of the batch not yet complete
        self.op_done: list[float | None] = [None] * no
        self.done_order: list[int] = []
        self.active = [[0] * len(q) for q in ops.queues]  # per rank, per channel
        self.spans: list[list[tuple[int, float, float]]] = [[] for _ in programs]
        self.waits: list[list[tuple[int, float, float]]] = [[] for _ in programs]
        self.reductions: list[list[tuple[int, float, float]]] = [[] for _ in programs]
        self.copies: list[list[tuple[int, float, float]]] = [[] for _ in programs]
        self.channel_free = [[0.0, 0.0] for _ in programs]  # per rank: copy out, reload
        self.copied: dict[tuple[int, object], float] = {}  # (rank, stage) -> copy out end
        self.wait_ops: dict[tuple[int, int], list[list[int]]] = {}  # (rank, pc) -> ops per key

    # -- rank progress ---------------------------------------------------------------------

    def advance(self, r: int) -> bool:
        instrs = self.programs[r].instructions
        first_of, batch_ops = self.ops.first_of[r], self.ops.batch_ops
        spans, compute_time = self.spans[r], self.compute_time
        moved = False
        pc, clock = self.pc[r], self.clock[r]
        while pc < len(instrs):
            ins = instrs[pc]
            cls = _KINDS.get(type(ins)) or _kind(ins)
            if cls is Forward or cls is Backward or cls is BackwardWeight:
                start = clock
                clock = start + compute_time(r, ins)
                if self.host_copy is not None:
                    clock = self._copy(r, pc, ins, start, clock)
                spans.append((pc, start, clock))
                pc += 1
            elif cls is ReduceGrads:
                self._reduce(r, pc, clock, compute_time(r, ins))
                pc += 1
            elif cls is Send or cls is Recv:
                posted = first_of[pc]
                clock += self.post_overhead
                for b in posted:
                    self.post[b] = clock
                pc += sum(len(batch_ops[b]) for b in posted)
            elif cls is Wait:
                self.pc[r], self.clock[r] = pc, clock
                done = self._wait_time(r, ins)
                if done is None:
                    return moved
                self.waits[r].append((pc, clock, max(clock, done)))
                clock = max(clock, done)
                pc += 1
            else:
                self.pc[r], self.clock[r] = pc, clock
                raise PlanError(f"rank {r}: instruction {pc} has unknown type {ins!r}")
            moved = True
        self.pc[r], self.clock[r] = pc, clock
        return moved

    def _copy(self, r: int, pc: int, ins: Instruction, start: float, end: float) -> float:
        """Issue compute instruction `ins`'s host copy on rank r's copy channel of its
        direction and return when `ins` ends: a copy out delays nothing; a backward waits,
        `window` seconds in, for its reload."""
        if isinstance(ins, BackwardWeight):  # it moves nothing
            return end
        offset, seconds = self.host_copy(r, ins)
        if seconds <= 0:
            return end
        if isinstance(ins, Forward):
            self._issue(r, ins, start + offset, seconds, pc)
            return end
        ready = self._issue(r, ins, start, seconds, pc)
        return end + max(0.0, ready - (start + offset))

    def _issue(self, r: int, ins: Instruction, at: float, seconds: float, pc: int) -> float:
        """Put `ins`'s copy of `seconds` on rank r's channel of its direction at `at`, after
        what is queued there and, for a reload, after its stage's copy out; when it ends."""
        reload = not isinstance(ins, Forward)
        free = self.channel_free[r]
        begin = max(at, free[reload])
        if reload:
            begin = max(begin, self.copied.pop((r, ins.stage), 0.0))
        else:
            self.copied[(r, ins.stage)] = begin + seconds
        free[reload] = begin + seconds
        self.copies[r].append((pc, begin, begin + seconds))
        return begin + seconds

    def _reduce(self, r: int, pc: int, clock: float, duration: float) -> None:
        """A reduction starts when posted and after the rank's previous one (one data-parallel
        communicator per rank: collectives run in issue order)."""
        done = self.reductions[r]
        start = max(clock, done[-1][2] if done else 0.0)
        done.append((pc, start, start + duration))

    def _wait_time(self, r: int, ins: Wait) -> float | None:
        ops, latest = self.ops, self.clock[r]
        mine_of = self.wait_ops.get((r, self.pc[r]))
        if mine_of is None:  # a blocked wait is evaluated again: resolve its keys once
            mine_of = self.wait_ops[(r, self.pc[r])] = [
                [i for i in ops.pair(key) or () if i >= 0 and ops.rank[i] == r] for key in ins.keys
            ]
        done = self.complete if self.whole_batches else self.op_done
        for key, mine in zip(ins.keys, mine_of):
            at = (ops.batch[i] for i in mine) if self.whole_batches else mine
            t = next((done[i] for i in at if done[i] is not None), None)
            if t is None:
                if not mine:
                    raise PlanError(
                        f"rank {r}: instruction {self.pc[r]} waits for {key}, "
                        "which this rank neither sends nor receives"
                    )
                if self.post[ops.batch[mine[0]]] is None:
                    raise PlanError(
                        f"rank {r}: instruction {self.pc[r]} waits for {key} before posting it"
                    )
                return None
            latest = max(latest, t)
        return latest

    # -- communication progress ------------------------------------------------------------

    def resolve(self, r: int) -> bool:
        moved = False
        for ch, queue in enumerate(self.ops.queues[r]):
            moved |= self._resolve_channel(r, ch, queue)
        return moved

    def _resolve_channel(self, r: int, ch: int, queue: list[int]) -> bool:
        moved = False
        ops, start, op_done = self.ops, self.start, self.op_done
        active = self.active[r]
        while active[ch] < len(queue):
            k = active[ch]
            b = queue[k]
            if start[b] is None:
                if self.post[b] is None:
                    return moved
                prev = self.complete[queue[k - 1]] if k else 0.0
                start[b] = max(self.post[b], prev or 0.0)
                moved = True
            for i in ops.batch_ops[b]:
                if op_done[i] is not None:
                    continue
                j = ops.other[i]
                peer = ops.batch[j]
                if start[peer] is None:
                    continue
                send = ops.op[i] if type(ops.op[i]) is Send else ops.op[j]
                t = max(start[b], start[peer]) + self.transfer_time(send)
                op_done[i] = op_done[j] = t
                self.done_order += (i, j)
                self.pending[b] -= 1
                self.pending[peer] -= 1
                moved = True
            if self.pending[b]:
                return moved
            self.complete[b] = max(op_done[i] for i in ops.batch_ops[b])
            active[ch] += 1
            moved = True
        return moved

    # -- driver ----------------------------------------------------------------------------

    def run(self) -> ExecutionResult:
        n = len(self.programs)
        progress = True
        while progress:
            progress = False
            for r in range(n):
                progress |= self.advance(r)
            for r in range(n):
                progress |= self.resolve(r)
        unfinished = [r for r in range(n) if not self._finished(r)]
        if unfinished:
            raise DeadlockError([self._describe_blocked(r) for r in unfinished])
        finish = [max([self.clock[r]] + [e for _, _, e in self.reductions[r]]) for r in range(n)]
        for b, r in enumerate(self.ops.batch_rank):
            finish[r] = max(finish[r], self.complete[b] or 0.0)
        ops = self.ops
        done = [
            (ops.rank[i], type(ops.op[i]) is Send, ops.op[i].key, self.op_done[i])
            for i in self.done_order
        ]
        return ExecutionResult(finish, self.spans, self.waits, done, self.reductions, self.copies)

    def _finished(self, r: int) -> bool:
        if self.pc[r] < len(self.programs[r].instructions):
            return False
        return all(a == len(q) for a, q in zip(self.active[r], self.ops.queues[r]))

    def _describe_blocked(self, r: int) -> str:
        instrs = self.programs[r].instructions
        if self.pc[r] < len(instrs):
            where = f"rank {r} blocked at instruction {self.pc[r]} ({_short(instrs[self.pc[r]])})"
        else:
            where = f"rank {r} at end of program"
        parts = []
        for a, queue in zip(self.active[r], self.ops.queues[r]):
            if a < len(queue):
                parts.append(self._describe_batch(r, queue[a]))
        return "; ".join([where, *parts])

    def _describe_batch(self, r: int, b: int) -> str:
        ops = self.ops
        if self.start[b] is None:
            return f"its batch at instruction {ops.batch_first[b]} is not posted yet"
        pending = []
        instrs = self.programs[r].instructions
        for i in ops.batch_ops[b]:
            if self.op_done[i] is not None:
                continue
            op, j = ops.op[i], ops.other[i]
            peer_first = ops.batch_first[ops.batch[j]]
            index = next(x for x in range(ops.batch_first[b], len(instrs)) if instrs[x] is op)
            pending.append(
                f"{_short(op)} (instruction {index}) waits for rank "
                f"{ops.rank[j]}'s batch at instruction {peer_first}"
            )
        return "pending: " + "; ".join(pending)


def _short(ins: Instruction) -> str:
    if isinstance(ins, (Forward, Backward, BackwardWeight)):
        return f"{compute_tag(ins)} {ins.stage}"
    if isinstance(ins, ReduceGrads):
        return f"reduce {ins.module}{ins.chunk}"
    if isinstance(ins, Send):
        return f"send {ins.key} to {ins.peer}"
    if isinstance(ins, Recv):
        return f"recv {ins.key} from {ins.peer}"
    return "wait " + ", ".join(str(k) for k in ins.keys)


def execute_programs(
    programs: Sequence[Program],
    *,
    compute_time: ComputeTime | None = None,
    transfer_time: TransferTime | None = None,
    post_overhead: float = 0.0,
    channel: ChannelFn = single_channel,
    host_copy: HostCopy | None = None,
    whole_batches: bool = False,
) -> ExecutionResult:
    """Run `programs` on the abstract machine and return their timing.

    `host_copy`: the seconds of each compute instruction's host copy and where it starts or
    is waited for (module docstring; None: no host copies). `whole_batches`: a `Wait` returns
    only when the batches holding its operations completed, as the runtime waits (NCCL
    completes the operations of one `batch_isend_irecv` together), rather than when the
    operations themselves did: the deadlock check of `validate_plan`.

    `channel` maps each operation to the ordered stream it travels on (`single_channel`: one
    per rank, Megatron-Core's single pipeline communicator; `per_peer_channel`: one per sender and
    receiver pair). Batches of one channel start in order.

    Raises `DeadlockError` when the programs cannot finish, `PlanError` when a message has no
    matching counterpart or a wait names a message the rank never posted.
    """
    machine = _Machine(
        programs,
        compute_time or (lambda r, i: 0.0),
        transfer_time or (lambda s: 0.0),
        post_overhead,
        channel,
        host_copy,
        whole_batches,
    )
    return machine.run()
