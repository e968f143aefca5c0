"""Split backwards and explicit gradient reductions in plans (the Zero-Bubble plan format).

A fused `Backward` computes a chunk's input and weight gradients at once. Split, its
`BackwardInput` (B) computes only the input gradients, the ones the previous pipeline stage waits
for, and its `BackwardWeight` (W) the weight gradients later: W is off the critical path and can
fill pipeline bubbles (`zero_bubble.py` places it). Until its W, a stage keeps the activations
its weight gradients need. A frozen module has no W: its B is its whole backward.

`ReduceGrads` makes the data-parallel gradient reduction of a chunk an instruction: it must come
after the chunk's last weight gradient on its rank (a fused Backward or a W of a trainable
module), once per trainable chunk of the rank, in the canonical order of
`canonical_reduction_order` (collectives on one data-parallel group are matched by issue order,
and every replica runs its own plan).

`split_backwards` turns a plan's programs into split form (each W right after its B, one
reduction after each chunk's last W); `check_split` is the part of `validate_plan` that checks
these rules.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .engine import PlanError
from .ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    Placement,
    Plan,
    Program,
    Recv,
    ReduceGrads,
    Send,
    StageId,
)

ChunkKey = tuple[str, int]


def canonical_reduction_order(placement: Placement, chunks: set[ChunkKey]) -> list[ChunkKey]:
    """The order in which every replica issues the reductions of `chunks`: consumer modules
    before producer modules (placement order reversed), higher chunks before lower ones (the
    order in which pipelines usually finish)."""
    order = [(m.name, c.index) for m in reversed(placement.modules) for c in reversed(m.chunks)]
    return [k for k in order if k in chunks]


def trainable_chunks(placement: Placement, rank: int) -> set[ChunkKey]:
    """The chunks on `rank` that have weight gradients (chunks of trainable modules)."""
    return {
        (m.name, c.index)
        for m in placement.modules
        if m.trainable
        for c in m.chunks
        if c.rank == rank
    }


def makes_weight_grads(ins: Instruction, placement: Placement) -> bool:
    """Whether `ins` accumulates weight gradients: a W, or a fused Backward of a trainable
    module (a `BackwardInput` never does)."""
    if isinstance(ins, BackwardWeight):
        return True
    if isinstance(ins, Backward) and not isinstance(ins, BackwardInput):
        return placement.module(ins.stage.module).trainable
    return False


def _split_program(program: Program, placement: Placement, fused: Collection[StageId]) -> Program:
    trainable = {m.name for m in placement.modules if m.trainable}
    out: list[Instruction] = []
    for ins in program.instructions:
        if type(ins) is Backward and ins.stage not in fused:
            out.append(BackwardInput(ins.stage))
            if ins.stage.module in trainable:
                out.append(BackwardWeight(ins.stage))
        elif not isinstance(ins, ReduceGrads):
            out.append(ins)
    return Program(program.rank, tuple(with_reductions(out, placement, program.rank)))


def with_reductions(
    instructions: Sequence[Instruction], placement: Placement, rank: int
) -> list[Instruction]:
    """`instructions` (without reductions) with one `ReduceGrads` per trainable chunk of
    `rank`, each as early as its chunk's last weight gradient and the canonical order allow."""
    last: dict[ChunkKey, int] = {}
    for i, ins in enumerate(instructions):
        if makes_weight_grads(ins, placement):
            last[(ins.stage.module, ins.stage.chunk)] = i
    after: dict[int, list[ChunkKey]] = {}
    at = -1
    for key in canonical_reduction_order(placement, trainable_chunks(placement, rank)):
        at = max(at, last.get(key, -1))
        after.setdefault(at, []).append(key)
    out = [ReduceGrads(*k) for k in after.get(-1, [])]
    for i, ins in enumerate(instructions):
        out.append(ins)
        out.extend(ReduceGrads(*k) for k in after.get(i, []))
    return out


def place_weights(
    programs: Sequence[Program],
    orders: Sequence[Sequence[Instruction]],
    placement: Placement,
) -> tuple[Program, ...]:
    """`programs` (complete, made from `orders` without their W) with every `BackwardWeight` of
    `orders[r]` placed where that order has it, and one reduction per trainable chunk.

    A W goes after the compute it follows in its order and after the sends and receives posted
    next to that compute, before the next wait or compute: the W fills the time the rank would
    wait there, and no message is posted later than without it. A W has no messages, so the
    programs stay deadlock-free (`passes.add_communication`'s argument is about posts and waits
    alone)."""
    out = []
    for program, order in zip(programs, orders):
        after: dict[tuple[bool, StageId] | None, list[BackwardWeight]] = {}
        anchor = None
        for ins in order:
            if isinstance(ins, BackwardWeight):
                after.setdefault(anchor, []).append(ins)
            else:
                anchor = (isinstance(ins, Forward), ins.stage)
        placed: list[Instruction] = list(after.get(None, ()))
        pending: list[BackwardWeight] = []
        for ins in program.instructions:
            if pending and not isinstance(ins, (Send, Recv)):
                placed.extend(pending)
                pending = []
            placed.append(ins)
            if isinstance(ins, (Forward, Backward)):
                pending = after.get((isinstance(ins, Forward), ins.stage), [])
        placed.extend(pending)
        out.append(Program(program.rank, tuple(with_reductions(placed, placement, program.rank))))
    return tuple(out)


def split_backwards(plan: Plan, fused: Collection[StageId] = frozenset()) -> tuple[Program, ...]:
    """The programs of `plan` with every fused Backward but those of the stages in `fused`
    split into B and W (W right after its B; frozen modules get no W) and an explicit reduction
    per trainable chunk. (A fused Backward stays valid beside split ones: where a W would hold
    more than the stage's activations, e.g. recomputed layers' inputs, a plan at its memory
    limit keeps that stage fused.)"""
    if plan.forward_only:
        return plan.programs
    return tuple(_split_program(p, plan.placement, fused) for p in plan.programs)


# ---------------------------------------------------------------------------------------------
# Validation


class SplitScan:
    """Checks one rank's split backwards and reductions as `validate` walks its program."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.inputs_done: set[StageId] = set()
        self.weights_done: set[StageId] = set()
        self.reduced: list[ChunkKey] = []

    def weight(self, ins: BackwardWeight, where: object) -> None:
        """Check a W: trainable module, on this rank, after its B, once."""
        stage = ins.stage
        if self.plan.forward_only:
            raise PlanError(f"{where}: a forward-only plan has a BackwardWeight")
        if not self.plan.placement.module(stage.module).trainable:
            raise PlanError(f"{where}: module {stage.module} is frozen: it has no weight gradients")
        if stage not in self.inputs_done:
            raise PlanError(f"{where}: BackwardWeight before its BackwardInput on this rank")
        if stage in self.weights_done:
            raise PlanError(f"{where}: second BackwardWeight of {stage}")
        self._not_reduced(stage, where)
        self.weights_done.add(stage)

    def backward(self, ins: Backward, where: object) -> None:
        """Note a B; a fused Backward must come before its chunk's reduction."""
        if isinstance(ins, BackwardInput):
            self.inputs_done.add(ins.stage)
        elif makes_weight_grads(ins, self.plan.placement):
            self._not_reduced(ins.stage, where)

    def reduce(self, ins: ReduceGrads, where: object) -> None:
        """Check a reduction: a trainable chunk of this rank, once."""
        key = (ins.module, ins.chunk)
        if self.plan.forward_only:
            raise PlanError(f"{where}: a forward-only plan has a gradient reduction")
        if key not in trainable_chunks(self.plan.placement, self.rank):
            raise PlanError(f"{where}: {ins.module}{ins.chunk} is no trainable chunk of this rank")
        if key in self.reduced:
            raise PlanError(f"{where}: second reduction of {ins.module}{ins.chunk}")
        self.reduced.append(key)

    def _not_reduced(self, stage: StageId, where: object) -> None:
        if (stage.module, stage.chunk) in self.reduced:
            raise PlanError(
                f"{where}: weight gradients of {stage.module}{stage.chunk} after its reduction"
            )

    def finish(self) -> None:
        """Every B of a trainable module has its W; reductions all or none, canonical order."""
        placement, rank = self.plan.placement, self.rank
        missing = sorted(
            s for s in self.inputs_done - self.weights_done if placement.module(s.module).trainable
        )
        if missing:
            raise PlanError(f"rank {rank}: BackwardInput of {missing[0]} has no BackwardWeight")
        if not self.reduced:
            return
        want = canonical_reduction_order(placement, trainable_chunks(placement, rank))
        if self.reduced != want:
            raise PlanError(
                f"rank {rank}: reductions {self.reduced}, expected one per trainable chunk in "
                f"the canonical order {want} (replicas match collectives by issue order)"
            )
