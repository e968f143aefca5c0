"""Validation of plans: everything the runtime relies on, checked before a plan is shipped.

`validate_plan` raises `engine.PlanError` (or its subclass `DeadlockError`) whose message names
the rank, the instruction index and the instruction at fault, or the table row for errors in the
sub-microbatch table. `check_channel_order` (part of `validate_plan`, and run by the runtime on
every plan) checks that both ends of each rank-to-rank channel post its messages in one order.
`check_plan_matches` catches plans meant for another job or iteration.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .backward_split import SplitScan
from .engine import PlanError, channel_of, execute_programs
from .graph import Dataflow
from .ir import (
    FORMAT_VERSION,
    Backward,
    BackwardWeight,
    Forward,
    Instruction,
    MessageKey,
    MessageKind,
    Placement,
    Plan,
    Program,
    Recv,
    ReduceGrads,
    Send,
    StageId,
    Wait,
    compute_tag,
)
from .passes import (
    ComputeId,
    compute_id,
    compute_inputs,
    consumer_of,
    describe_compute,
    producer_of,
)


def _short(ins: Instruction) -> str:
    if isinstance(ins, (Forward, Backward)):
        return describe_compute(compute_id(ins))
    if isinstance(ins, Send):
        return f"send {ins.key} to {ins.peer}"
    if isinstance(ins, Recv):
        return f"recv {ins.key} from {ins.peer}"
    if isinstance(ins, Wait):
        return "wait " + ", ".join(str(k) for k in ins.keys)
    if isinstance(ins, (BackwardWeight, ReduceGrads)):
        return _split_short(ins)
    return repr(ins)


def _split_short(ins: BackwardWeight | ReduceGrads) -> str:
    if isinstance(ins, BackwardWeight):
        return f"{compute_tag(ins)} {ins.stage}"
    return f"reduce {ins.module}{ins.chunk}"


def _at(rank: int, index: int, ins: Instruction) -> str:
    return f"rank {rank}: instruction {index} ({_short(ins)})"


class _Where:
    """Names an instruction in error messages; formatted only when an error is raised."""

    __slots__ = ("index", "ins", "rank")

    def __init__(self, rank: int, index: int, ins: Instruction) -> None:
        self.rank, self.index, self.ins = rank, index, ins

    def __str__(self) -> str:
        return _at(self.rank, self.index, self.ins)


@dataclass
class _Scan:
    """What the program scan found, for the global checks that follow it."""

    computes: dict[ComputeId, list[tuple[int, int]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    sends: dict[MessageKey, list[tuple[int, int, Send]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    recvs: dict[MessageKey, list[tuple[int, int, Recv]]] = field(
        default_factory=lambda: defaultdict(list)
    )


# ---------------------------------------------------------------------------------------------
# Tables


def _check_tables(plan: Plan) -> Dataflow:
    mb_ids = [m.index for m in plan.microbatches]
    if len(set(mb_ids)) != len(mb_ids):
        raise PlanError(f"microbatch table has duplicate indices: {sorted(mb_ids)}")
    mbs = set(mb_ids)
    modules = {m.name for m in plan.placement.modules}
    groups: dict[tuple[str, int], list] = defaultdict(list)
    for s in plan.submicrobatches:
        row = f"sub-microbatch {s.work}"
        if s.module not in modules:
            raise PlanError(f"{row}: module {s.module!r} is not in the placement")
        if s.microbatch not in mbs:
            raise PlanError(f"{row}: microbatch {s.microbatch} is not in the microbatch table")
        if s.tokens < 0 or s.padded_tokens < s.tokens or s.attention_pairs < 0:
            raise PlanError(
                f"{row}: needs 0 <= tokens <= padded_tokens and attention_pairs >= 0, got "
                f"tokens={s.tokens}, padded_tokens={s.padded_tokens}, "
                f"attention_pairs={s.attention_pairs}"
            )
        if s.instance_end < s.instance_start:
            raise PlanError(f"{row}: instances [{s.instance_start}, {s.instance_end}) reversed")
        groups[(s.module, s.microbatch)].append(s)
    for (module, mb), subs in groups.items():
        subs.sort(key=lambda s: s.index)
        expected_start = 0
        for i, s in enumerate(subs):
            if s.index != i:
                raise PlanError(
                    f"sub-microbatches of {module} in microbatch {mb} are numbered "
                    f"{[x.index for x in subs]}, expected 0..{len(subs) - 1}"
                )
            if s.instance_start != expected_start:
                raise PlanError(
                    f"sub-microbatch {s.work}: instances start at {s.instance_start}, expected "
                    f"{expected_start} (ranges must be contiguous and not overlap)"
                )
            expected_start = s.instance_end
    return _check_dependencies(plan)


def _check_dependencies(plan: Plan) -> Dataflow:
    if len(set(plan.dependencies)) != len(plan.dependencies):
        raise PlanError("dependency table lists a dependency twice")
    for d in plan.dependencies:
        if d.producer.microbatch != d.consumer.microbatch:
            raise PlanError(f"dependency {d.producer} -> {d.consumer} crosses microbatches")
    try:
        return Dataflow(plan.placement, plan.submicrobatches, plan.dependencies)
    except (ValueError, KeyError) as e:
        raise PlanError(f"inconsistent dependencies: {e}") from None


# ---------------------------------------------------------------------------------------------
# Program scan


def _check_stage(df: Dataflow, works: set, stage: StageId, where: _Where) -> None:
    """`works`: (module, microbatch, sub) of every sub-microbatch of the table."""
    if (stage.module, stage.microbatch, stage.sub) not in works:
        raise PlanError(f"{where}: sub-microbatch {stage.work} is not in the table")
    if not 0 <= stage.chunk < df.num_chunks(stage.module):
        raise PlanError(f"{where}: module {stage.module} has no chunk {stage.chunk}")


def _known_message(df: Dataflow, works: set, key: MessageKey, where: _Where) -> None:
    _check_stage(df, works, key.producer, where)
    _check_stage(df, works, key.consumer, where)
    if key.kind is MessageKind.ACTIVATION:
        known = key in df.forward_outputs(key.producer)
    else:
        known = key in df.backward_outputs(key.consumer)
    if not known:
        raise PlanError(f"{where}: {key} is not an edge of the data flow")


class _RankScan:
    """Walks one rank's program, checking each instruction against what came before it."""

    def __init__(self, plan: Plan, df: Dataflow, works: set, scan: _Scan, rank: int) -> None:
        self.plan, self.df, self.works, self.scan, self.rank = plan, df, works, scan, rank
        self.done: set[ComputeId] = set()
        self.posted: dict[tuple[bool, MessageKey], int] = {}
        self.received: set[MessageKey] = set()  # receives posted and waited for
        self.split = SplitScan(plan, rank)  # split backwards and reductions

    def run(self) -> None:
        for i, ins in enumerate(self.plan.programs[self.rank].instructions):
            where = _Where(self.rank, i, ins)
            if isinstance(ins, (Forward, Backward)):
                self._compute(i, ins, where)
            elif isinstance(ins, (Send, Recv)):
                self._comm(i, ins, where)
            elif isinstance(ins, Wait):
                self._wait(ins, where)
            elif isinstance(ins, BackwardWeight):
                self._check_owner(ins.stage, where)
                self.split.weight(ins, where)
            elif isinstance(ins, ReduceGrads):
                self.split.reduce(ins, where)
            else:
                raise PlanError(f"{where}: unknown instruction type {type(ins).__name__}")
        self.split.finish()

    def _check_owner(self, stage: StageId, where: _Where) -> None:
        _check_stage(self.df, self.works, stage, where)
        owner = self.df.rank_of(stage)
        if owner != self.rank:
            raise PlanError(f"{where}: chunk {stage.module}{stage.chunk} lives on rank {owner}")

    def _compute(self, i: int, ins: Forward | Backward, where: _Where) -> None:
        df, stage = self.df, ins.stage
        self._check_owner(stage, where)
        if isinstance(ins, Forward) and ins.memory.offload:
            chunk = self.plan.placement.module(stage.module).chunks[stage.chunk]
            try:
                ins.memory.check(chunk.num_layers)
            except ValueError as err:
                raise PlanError(f"{where}: {err}") from None
        if isinstance(ins, Backward):
            self.split.backward(ins, where)
            if self.plan.forward_only:
                raise PlanError(f"{where}: a forward-only plan has a Backward")
            if not df.needs_backward(stage.module):
                raise PlanError(
                    f"{where}: module {stage.module} is frozen with nothing trainable upstream, "
                    "so it has no Backward"
                )
            if (True, stage) not in self.done:
                raise PlanError(f"{where}: Backward before its Forward on this rank")
        deps = compute_inputs(ins, df)
        # A backward's own forward (deps[0]) was checked above, with a clearer message.
        for dep in deps[1:] if isinstance(ins, Backward) else deps:
            self._check_input(ins, dep, where)
        cid = compute_id(ins)
        self.done.add(cid)
        self.scan.computes[cid].append((self.rank, i))

    def _check_input(self, ins: Forward | Backward, dep: ComputeId, where: _Where) -> None:
        if self.df.rank_of(dep[1]) == self.rank:
            if dep not in self.done:
                raise PlanError(f"{where}: needs {describe_compute(dep)} earlier on this rank")
            return
        key = _key_between(dep, ins)
        if key not in self.received:
            raise PlanError(
                f"{where}: input {key} from rank {self.df.rank_of(dep[1])} is not received "
                "and waited for before it"
            )

    def _comm(self, i: int, ins: Send | Recv, where: _Where) -> None:
        df, key, is_send = self.df, ins.key, isinstance(ins, Send)
        _known_message(df, self.works, key, where)
        sender, receiver = df.sender_of(key), df.receiver_of(key)
        if sender == receiver:
            raise PlanError(f"{where}: {key} is a local hand-over on rank {sender}, not a message")
        me, other = (sender, receiver) if is_send else (receiver, sender)
        if me != self.rank:
            role = "sender" if is_send else "receiver"
            raise PlanError(f"{where}: the {role} of {key} is rank {me}")
        if ins.peer != other:
            raise PlanError(f"{where}: peer should be rank {other}, not {ins.peer}")
        if (is_send, key) in self.posted:
            raise PlanError(
                f"{where}: {key} already posted at instruction {self.posted[(is_send, key)]}"
            )
        if is_send and producer_of(key) not in self.done:
            raise PlanError(f"{where}: send before its producing compute")
        self.posted[(is_send, key)] = i
        table = self.scan.sends if is_send else self.scan.recvs
        table[key].append((self.rank, i, ins))

    def _wait(self, ins: Wait, where: _Where) -> None:
        for key in ins.keys:
            if (False, key) in self.posted:
                self.received.add(key)
            elif (True, key) not in self.posted:
                raise PlanError(f"{where}: waits for {key}, which this rank has not posted")


def _key_between(dep: ComputeId, ins: Forward | Backward) -> MessageKey:
    if isinstance(ins, Forward):
        return MessageKey(MessageKind.ACTIVATION, dep[1], ins.stage)
    return MessageKey(MessageKind.GRADIENT, ins.stage, dep[1])


# ---------------------------------------------------------------------------------------------
# Global checks


def _check_coverage(plan: Plan, df: Dataflow, scan: _Scan) -> None:
    for stage in df.stages():
        want_b = df.needs_backward(stage.module) and not plan.forward_only
        for is_fwd, want in ((True, 1), (False, 1 if want_b else 0)):
            found = scan.computes.get((is_fwd, stage), [])
            if len(found) != want:
                name = "Forward" if is_fwd else "Backward"
                at = ", ".join(f"rank {r} instruction {i}" for r, i in found) or "nowhere"
                raise PlanError(
                    f"stage {stage} needs {want} {name}, found {len(found)} ({at}); "
                    f"rank {df.rank_of(stage)} owns its chunk"
                )


def _check_messages(scan: _Scan) -> None:
    # The first failing message in key order is reported; keys are only sorted when one fails.
    failing = [key for key in set(scan.sends) | set(scan.recvs) if _message_error(scan, key)]
    if failing:
        raise _message_error(scan, min(failing))


def _message_error(scan: _Scan, key: MessageKey) -> PlanError | None:
    sends, recvs = scan.sends.get(key, []), scan.recvs.get(key, [])
    if consumer_of(key) not in scan.computes:
        r, i, op = (sends or recvs)[0]
        return PlanError(
            f"{_at(r, i, op)}: no rank computes {describe_compute(consumer_of(key))}, which would consume it"
        )
    # A second Send/Recv of a key is caught by the scan: on its own rank as posted twice,
    # on any other rank as the wrong sender/receiver. A send always has its receive here:
    # the consumer exists (coverage) and needs that receive (input check).
    if not sends:
        r, i, op = recvs[0]
        return PlanError(f"{_at(r, i, op)}: no matching Send on any rank")
    (sr, si, s) = sends[0]
    if recvs and s.tensors != recvs[0][2].tensors:
        return PlanError(
            f"{_at(sr, si, s)}: sends tensors {s.tensors}, "
            f"the receiver expects {recvs[0][2].tensors}"
        )
    return None


def check_channel_order(programs: Sequence[Program]) -> None:
    """Raise `PlanError` unless every channel a -> b carries its messages in one order.

    For every ordered pair of ranks (a, b), the messages rank a sends to b, in program order,
    must be the messages rank b receives from a, in program order: NCCL and gloo match the
    point-to-point operations between two ranks in the order they are issued, not by message,
    so the k-th send of a channel always meets its k-th receive. The error names both ranks, the
    position of the first message that differs and the instruction holding it on each end.
    """
    ends: dict[bool, dict[tuple[int, int], list[tuple[MessageKey, int]]]] = {
        True: defaultdict(list),
        False: defaultdict(list),
    }
    for program in programs:
        for i, ins in enumerate(program.instructions):
            if isinstance(ins, Send):
                ends[True][(program.rank, ins.peer)].append((ins.key, i))
            elif isinstance(ins, Recv):
                ends[False][(ins.peer, program.rank)].append((ins.key, i))
    for a, b in sorted(set(ends[True]) | set(ends[False])):
        sent, received = ends[True].get((a, b), []), ends[False].get((a, b), [])
        if [k for k, _ in sent] == [k for k, _ in received]:
            continue
        first = next(
            (n for n, (x, y) in enumerate(zip(sent, received)) if x[0] != y[0]),
            min(len(sent), len(received)),
        )
        raise PlanError(
            f"channel rank {a} -> rank {b}: message {first} that rank {a} sends is "
            f"{_channel_end(sent, first, a)}, but message {first} that rank {b} receives is "
            f"{_channel_end(received, first, b)}; both ends must post a channel's messages in "
            "the same order (NCCL and gloo match point-to-point operations by order)"
        )


def _channel_end(ops: list[tuple[MessageKey, int]], n: int, rank: int) -> str:
    if n >= len(ops):
        return "nothing"
    key, index = ops[n]
    return f"{key} (rank {rank} instruction {index})"


def validate_plan(plan: Plan) -> None:
    """Check that `plan` is complete, consistent and executable; raise `PlanError` if not.

    Checks: format version; the sub-microbatch, microbatch and dependency tables; every compute
    on the rank owning its chunk, with its inputs produced earlier on the rank or received and
    waited for; exactly one Forward per stage and exactly one Backward iff the module needs one
    and the plan is not forward-only (a `BackwardInput` counts as the Backward; split backwards
    and reductions: `backward_split.SplitScan`); every send after its producing compute; every cross-rank
    message with exactly one Send and one Recv, correct peers and equal tensor specs; that the
    programs run to completion under the semantics of `engine.py` on the streams the plan
    declares (`Plan.channels`; no deadlock); finally that every rank-to-rank channel carries its
    messages in one order (`check_channel_order`).
    """
    if plan.version != FORMAT_VERSION:
        raise PlanError(
            f"plan format version {plan.version}, this code understands version {FORMAT_VERSION}"
        )
    df = _check_tables(plan)
    works = {(w.module, w.microbatch, w.sub) for w in df.works}
    scan = _Scan()
    for rank in range(plan.num_ranks):
        _RankScan(plan, df, works, scan, rank).run()
    _check_coverage(plan, df, scan)
    _check_messages(scan)
    execute_programs(plan.programs, channel=channel_of(plan.channels), whole_batches=True)
    check_channel_order(plan.programs)


def check_plan_matches(
    plan: Plan, *, placement: Placement, num_ranks: int, iteration: int | None = None
) -> None:
    """Raise `PlanError` when `plan` was made for another world size, placement or iteration."""
    what = f"plan {plan.name!r} (iteration {plan.iteration})"
    if plan.num_ranks != num_ranks:
        raise PlanError(f"{what} is for {plan.num_ranks} pipeline ranks, this job has {num_ranks}")
    if iteration is not None and plan.iteration != iteration:
        raise PlanError(f"{what} arrived for iteration {iteration}")
    if plan.placement != placement:
        raise PlanError(
            f"{what} uses another placement: {_placement_diff(plan.placement, placement)}"
        )


def _placement_diff(got: Placement, want: Placement) -> str:
    got_names = [m.name for m in got.modules]
    want_names = [m.name for m in want.modules]
    if got_names != want_names:
        return f"modules {got_names}, expected {want_names}"
    for g, w in zip(got.modules, want.modules):
        if g != w:
            cg = [(c.layer_start, c.layer_end, c.rank) for c in g.chunks]
            cw = [(c.layer_start, c.layer_end, c.rank) for c in w.chunks]
            return (
                f"module {g.name}: chunks (layers, rank) {cg}, trainable={g.trainable}; "
                f"expected {cw}, trainable={w.trainable}"
            )
    return "placements differ"
