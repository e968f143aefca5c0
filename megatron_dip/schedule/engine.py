"""Execution semantics of plans: one abstract machine for deadlock checks and timing.

`execute_programs` runs all ranks' programs under the semantics documented in `ir.py`
(non-blocking posts, batches starting in order on each rank, an operation completing when both
its batch and its counterpart's batch have started, blocking `Wait`s). With zero durations it is
the deadlock check used by validation; with a cost model's durations it is the simulator's core.

The machine is evaluated in max-plus form (each time is a max over the times it depends on), so
no global event queue is needed and the result does not depend on the order ranks are visited.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .ir import Backward, Forward, Instruction, MessageKey, Program, Recv, Send, Wait

ComputeTime = Callable[[int, Instruction], float]
TransferTime = Callable[[Send], float]


class PlanError(ValueError):
    """A plan is not executable; the message names the ranks and instructions at fault."""


class DeadlockError(PlanError):
    """Every unfinished rank is blocked; `blocked` holds one description per rank."""

    def __init__(self, blocked: list[str]) -> None:
        self.blocked = blocked
        super().__init__("plan deadlocks:\n  " + "\n  ".join(blocked))


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


@dataclass
class ExecutionResult:
    """Times of one execution. `spans[r]` holds (instruction index, start, end) of each compute
    instruction of rank r, `waits[r]` (instruction index, start, end) of each blocking wait."""

    finish: list[float]
    spans: list[list[tuple[int, float, float]]]
    waits: list[list[tuple[int, float, float]]]
    op_complete: dict[tuple[int, bool, MessageKey], float]

    @property
    def makespan(self) -> float:
        return max(self.finish, default=0.0)


ChannelFn = Callable[[int, "Send | Recv"], object]


def single_channel(rank: int, op: Send | Recv) -> object:
    """All point-to-point operations of a rank share one ordered stream (one NCCL communicator
    for the pipeline group, as Megatron-Core uses)."""
    return 0


def per_peer_channel(rank: int, op: Send | Recv) -> object:
    """One ordered stream per (sender, receiver) pair: a 2-rank communicator per direction."""
    return ("send", op.peer) if isinstance(op, Send) else ("recv", op.peer)


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
    ) -> None:
        self.programs = programs
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

    def run(self) -> ExecutionResult:
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
        return ExecutionResult(finish, self.spans, self.waits, self.op_complete)

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


def execute_programs(
    programs: Sequence[Program],
    *,
    compute_time: ComputeTime | None = None,
    transfer_time: TransferTime | None = None,
    post_overhead: float = 0.0,
    channel: ChannelFn = single_channel,
) -> ExecutionResult:
    """Run `programs` on the abstract machine and return their timing.

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
    )
    return machine.run()
