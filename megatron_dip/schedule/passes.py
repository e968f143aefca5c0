"""Plan passes: turn per-rank compute orders into complete programs.

`add_communication` inserts the `Send`/`Recv`/`Wait` instructions a set of compute orders needs,
using a posting strategy that can be proven deadlock-free under the semantics of `engine.py`
(see its docstring). `ideal_timing` is the communication-free timing it is based on; it is also
the cheapest way to detect compute orders that are cyclic in themselves.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .engine import DeadlockError, PlanError
from .graph import Dataflow
from .ir import (
    Backward,
    Channels,
    Forward,
    Instruction,
    MessageKey,
    MessageKind,
    Program,
    Recv,
    Send,
    StageId,
    TensorSpec,
    Wait,
)

# Computes a receive is posted ahead where the plan has per-peer streams (`add_communication`
# with `Channels.PER_PEER`): what training (--dip-receive-lead) and the studies plan with.
RECEIVE_LEAD = 1

TensorFn = Callable[[MessageKey], tuple[TensorSpec, ...]]
"""Tensors a message carries; called with the same key on both ends of a message."""

ComputeTimeFn = Callable[[int, Forward | Backward], float]
"""Duration of a compute instruction on a rank."""

ComputeId = tuple[bool, StageId]
"""(is_forward, stage): names one compute instruction of an iteration."""


def compute_id(ins: Forward | Backward) -> ComputeId:
    """The `ComputeId` of a compute instruction."""
    return (isinstance(ins, Forward), ins.stage)


def describe_compute(cid: ComputeId) -> str:
    """Short text of a compute, as in engine messages: `F vit0[mb1.0]`."""
    return f"{'F' if cid[0] else 'B'} {cid[1]}"


def compute_inputs(ins: Forward | Backward, dataflow: Dataflow) -> list[ComputeId]:
    """The computes whose results `ins` consumes (its own rank's program order aside).

    A forward needs the forwards of its producers; a backward needs its own forward (saved
    activations) and the backwards of the consumers that send it gradients.
    """
    if isinstance(ins, Forward):
        return [(True, k.producer) for k in dataflow.forward_inputs(ins.stage)]
    return [(True, ins.stage)] + [(False, k.consumer) for k in dataflow.backward_inputs(ins.stage)]


def compute_outputs(ins: Forward | Backward, dataflow: Dataflow) -> list[MessageKey]:
    """The messages `ins` produces (local hand-overs included)."""
    if isinstance(ins, Forward):
        return dataflow.forward_outputs(ins.stage)
    return dataflow.backward_outputs(ins.stage)


def consumer_of(key: MessageKey) -> ComputeId:
    """The compute that consumes message `key`."""
    if key.kind is MessageKind.ACTIVATION:
        return (True, key.consumer)
    return (False, key.producer)


def producer_of(key: MessageKey) -> ComputeId:
    """The compute that produces message `key`."""
    if key.kind is MessageKind.ACTIVATION:
        return (True, key.producer)
    return (False, key.consumer)


@dataclass(frozen=True)
class IdealTiming:
    """Communication-free timing of compute orders: `start[r][k]`, `finish[r][k]` of compute k
    of rank r, and where each compute is (`where[cid] = (rank, k)`)."""

    start: list[list[float]]
    finish: list[list[float]]
    where: dict[ComputeId, tuple[int, int]]


def _index_computes(
    compute: Sequence[Sequence[Forward | Backward]], dataflow: Dataflow
) -> dict[ComputeId, tuple[int, int]]:
    where: dict[ComputeId, tuple[int, int]] = {}
    for r, order in enumerate(compute):
        for k, ins in enumerate(order):
            if not isinstance(ins, (Forward, Backward)):
                raise PlanError(f"rank {r}: compute {k} is not a Forward/Backward: {ins!r}")
            cid = compute_id(ins)
            if cid in where:
                other = where[cid]
                raise PlanError(
                    f"rank {r}: compute {k} ({describe_compute(cid)}) already appears on rank "
                    f"{other[0]} as compute {other[1]}"
                )
            owner = dataflow.rank_of(ins.stage)
            if owner != r:
                raise PlanError(
                    f"rank {r}: compute {k} ({describe_compute(cid)}) runs a chunk that lives "
                    f"on rank {owner}"
                )
            where[cid] = (r, k)
    return where


def _dependencies(
    compute: Sequence[Sequence[Forward | Backward]],
    dataflow: Dataflow,
    where: dict[ComputeId, tuple[int, int]],
) -> list[list[list[ComputeId]]]:
    deps = [[compute_inputs(ins, dataflow) for ins in order] for order in compute]
    for r, order in enumerate(compute):
        for k, ins in enumerate(order):
            for d in deps[r][k]:
                if d not in where:
                    raise PlanError(
                        f"rank {r}: compute {k} ({describe_compute(compute_id(ins))}) needs "
                        f"{describe_compute(d)}, which no rank computes"
                    )
    return deps


def ideal_timing(
    compute: Sequence[Sequence[Forward | Backward]],
    dataflow: Dataflow,
    *,
    compute_time: ComputeTimeFn | None = None,
) -> IdealTiming:
    """Time the compute orders as if messages were free and instantaneous.

    Each compute starts when the previous compute of its rank and every compute it depends on
    (see `compute_inputs`) have finished. Raises `DeadlockError` naming the blocked ranks and
    computes when the orders are cyclic, `PlanError` when a compute depends on one that no
    rank runs, runs on a rank that does not own its chunk, or appears twice.
    """
    if len(compute) != dataflow.placement.num_ranks:
        raise PlanError(
            f"{len(compute)} compute orders for {dataflow.placement.num_ranks} pipeline ranks"
        )
    duration = compute_time or (lambda r, ins: 1.0)
    where = _index_computes(compute, dataflow)
    deps = _dependencies(compute, dataflow, where)
    n = len(compute)
    start: list[list[float]] = [[0.0] * len(o) for o in compute]
    finish: list[list[float]] = [[0.0] * len(o) for o in compute]
    done: dict[ComputeId, float] = {}
    pc = [0] * n
    waiters: dict[ComputeId, list[int]] = defaultdict(list)
    todo = list(range(n))
    while todo:
        r = todo.pop()
        while pc[r] < len(compute[r]):
            k = pc[r]
            missing = next((d for d in deps[r][k] if d not in done), None)
            if missing is not None:
                waiters[missing].append(r)
                break
            ready = max([done[d] for d in deps[r][k]] + [finish[r][k - 1] if k else 0.0])
            dur = duration(r, compute[r][k])
            if not dur > 0:
                raise ValueError(f"compute_time must be positive, got {dur} for rank {r} k {k}")
            start[r][k], finish[r][k] = ready, ready + dur
            cid = compute_id(compute[r][k])
            done[cid] = finish[r][k]
            todo.extend(waiters.pop(cid, ()))
            pc[r] += 1
    stuck = [r for r in range(n) if pc[r] < len(compute[r])]
    if stuck:
        raise DeadlockError([_describe_stuck(r, pc[r], compute, deps, done, where) for r in stuck])
    return IdealTiming(start, finish, where)


def _describe_stuck(
    r: int,
    k: int,
    compute: Sequence[Sequence[Forward | Backward]],
    deps: list[list[list[ComputeId]]],
    done: dict[ComputeId, float],
    where: dict[ComputeId, tuple[int, int]],
) -> str:
    here = describe_compute(compute_id(compute[r][k]))
    needs = [
        f"{describe_compute(d)} (rank {where[d][0]}, compute {where[d][1]})"
        for d in deps[r][k]
        if d not in done
    ]
    return f"rank {r} blocked at compute {k} ({here}), which needs " + ", ".join(needs)


@dataclass(frozen=True)
class _Op:
    """One posted operation of a rank, with its global order position (t, key)."""

    t: float
    key: MessageKey
    is_send: bool
    peer: int
    post_step: int  # the batch before compute `post_step` (len(order) = the final batch)
    wait_step: int  # the wait before compute `wait_step` (len(order) = the final wait)
    ahead: bool = False  # a receive posted one compute ahead: after that step's wait


def _message_ops(
    compute: Sequence[Sequence[Forward | Backward]],
    dataflow: Dataflow,
    timing: IdealTiming,
    channels: Channels,
) -> list[list[_Op]]:
    """Send and receive operations of every rank, with their posting and waiting steps
    (receives one batch ahead on per-peer streams: `add_communication`)."""
    ops: list[list[_Op]] = [[] for _ in compute]
    for r, order in enumerate(compute):
        for j, ins in enumerate(order):
            for key in compute_outputs(ins, dataflow):
                dest = timing.where.get(consumer_of(key))
                if dest is None or dest[0] == r:
                    continue  # nobody consumes it, or a local hand-over
                q_rank, q = dest
                t = timing.finish[r][j]
                # The receiver posts in the first batch whose compute starts at or after t
                # (one batch before it where streams are per peer).
                recv_step = bisect.bisect_left(timing.start[q_rank], t, 0, q + 1)
                ahead = channels is Channels.PER_PEER and recv_step > 0
                post_step = recv_step - 1 if ahead else recv_step
                ops[q_rank].append(_Op(t, key, False, r, post_step, q, ahead))
                send_step = j + 1
                posted_at = timing.finish[q_rank][recv_step - 1] if recv_step else 0.0
                # Release the send buffer at the first wait that cannot delay its compute (as
                # without the lead: an earlier release wait would hold the sender for the
                # transfer, which the ideal timing does not see).
                done_at = max(t, posted_at)
                wait_step = bisect.bisect_left(timing.start[r], done_at, send_step)
                ops[r].append(_Op(t, key, True, q_rank, send_step, wait_step))
    return ops


def _assemble(
    rank: int, order: Sequence[Forward | Backward], ops: list[_Op], tensors: TensorFn
) -> Program:
    n = len(order)
    posts: list[list[_Op]] = [[] for _ in range(n + 1)]
    ahead: list[list[_Op]] = [[] for _ in range(n + 1)]
    waits: list[list[_Op]] = [[] for _ in range(n + 1)]
    for op in ops:
        (ahead if op.ahead else posts)[op.post_step].append(op)
        waits[min(op.wait_step, n)].append(op)
    out: list[Instruction] = []
    for k in range(n + 1):
        out += _posted(posts[k], tensors)
        if waits[k]:
            out.append(Wait(tuple(o.key for o in sorted(waits[k], key=lambda o: (o.t, o.key)))))
        out += _posted(ahead[k], tensors)  # after the wait: never waited for with it
        if k < n:
            out.append(order[k])
    return Program(rank, tuple(out))


def _posted(ops: list[_Op], tensors: TensorFn) -> list[Send | Recv]:
    """The Send/Recv instructions of `ops`, in (T, key) order."""
    return [
        (Send if op.is_send else Recv)(op.key, op.peer, tuple(tensors(op.key)))
        for op in sorted(ops, key=lambda o: (o.t, o.key))
    ]


def add_communication(
    compute: Sequence[Sequence[Forward | Backward]],
    dataflow: Dataflow,
    *,
    tensors: TensorFn,
    compute_time: ComputeTimeFn | None = None,
    channels: Channels = Channels.SINGLE,
) -> tuple[Program, ...]:
    """Insert `Send`/`Recv`/`Wait` into per-rank compute orders; return one program per rank.

    `compute[r]` is rank r's order of forwards and backwards. Every data-flow edge between
    computes on different ranks becomes one message (gradients only where
    `Dataflow.backward_outputs` says); edges within a rank are local hand-overs.

    Strategy. Time the orders without communication (`ideal_timing`, unit durations unless
    `compute_time` is given; cyclic orders raise `DeadlockError`). Each message gets the
    timestamp T = ideal finish of the compute producing it, and the global order position
    (T, key), identical on both of its ranks. Before compute k of a rank (ideal start S_k) the
    rank posts ONE batch, sorted by (T, key), of all its not yet posted operations with
    T <= S_k: the sends of its earlier computes and the receives it will need; then it waits for
    the receives compute k consumes, and for sends whose ideal completion is at or before S_k
    (so buffers are released without delaying anything). After the last compute it posts the
    remaining sends and waits for everything still outstanding.

    Why this cannot deadlock. Durations are positive, so every operation in the batch before
    compute k has S_(k-1) < T <= S_k (a send of compute k-1 has T = F_(k-1) > S_(k-1); a
    receive with T <= S_(k-1) was posted earlier): on every rank, the operations of an earlier
    batch precede those of any later batch in (T, key). Every wait names operations of batches
    already posted. Now show by strong induction on (T, key) that every operation completes.
    Take operation X and assume every operation before it completes. On X's rank, every
    instruction before X's batch is a compute (never blocks), a post (never blocks), or a wait
    for operations of earlier batches, which precede X and so complete: the rank posts X's
    batch. The batch before it holds only earlier operations, so it completes and X's batch
    starts. The same holds for the rank of X's counterpart, which has the same (T, key); both
    batches start, so X completes. Since all operations complete, every wait returns and every
    program runs to its end.

    Receives posted ahead (`channels` = `ir.Channels.PER_PEER`, for plans declaring per-peer
    streams; `RECEIVE_LEAD` computes, the only lead there is). Posted as above, a receive whose
    compute starts, in the ideal timing, when its message is produced (the critical path) is
    posted right before that compute, so the transfer cannot overlap anything: on NCCL a
    transfer starts when both ends have posted. With the lead, a receive of batch j >= 1 is
    posted one compute earlier, right after the wait before compute j - 1 (so no wait ever
    names it together with that step's receives: the runtime waits for whole batches, and so
    does the deadlock check, `validate_plan`); sends and waits do not move. On one stream this
    can deadlock (a receive not yet due would hold back the rank's later sends), so the plan
    must declare per-peer streams. There the argument holds again, by the same induction, now
    over batches. Take X (on stream a -> b) and assume every operation before it in (T, key)
    completes. Its send is posted as before. Its receive is posted after the wait before compute
    j - 1, where j is the first compute of b with S_j >= T; every wait of b up to there precedes
    compute j - 1 and names operations with T' <= S_(j-1) < T, and waits for their batches,
    which hold only such operations (a batch of receives posted ahead holds the receives of one
    batch j, all with T' <= S_j, and is first waited for before a compute i >= j); so b gets
    there. On stream a -> b both ends post in (T, key) order, so the batches before X's on it
    hold earlier operations, which complete; both of X's batches start and X completes. The
    price is memory: a receive's buffer exists one compute earlier. There is no lead of 2 or
    more: the receives of several batches would share the first batch, which the first wait
    waits for.
    """
    timing = ideal_timing(compute, dataflow, compute_time=compute_time)
    ops = _message_ops(compute, dataflow, timing, channels)
    return tuple(_assemble(r, order, ops[r], tensors) for r, order in enumerate(compute))
