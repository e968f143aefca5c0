"""Placing weight-gradient halves (W) into pipeline bubbles, Zero-Bubble style.

Splitting each backward into B (input gradients, on the critical path: the previous stage waits
for them) and W (weight gradients, needed only by the chunk's gradient reduction) lets W move
later: the B chain through the pipeline gets shorter (fill and drain shrink), and the W fill the
time a rank would otherwise wait (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024).

`fill_bubbles_with_weights` works on complete programs (communication already added): a W has
no messages, so moving it later can neither deadlock a plan nor change its messages. Starting
from W right after its B, each round defers every W and puts deferred W (oldest first) into
the waits where the previous round's execution idled, as many as fit the idle time (policies:
only W that fit, or also W of which half fits, each tried from the unmoved order); before a
Forward that would take the rank's activations over its `memory_limit`, the oldest deferred W
run first (ZB-H1's rule: the program never holds more than the limit, or than the unmoved
program where that held more), and the W still
deferred at the end of the program run there, chunk by chunk in the canonical reduction order so
that the reductions start as early as they can. Each chunk's `ReduceGrads` follows its last W.
The best round (shortest `execute` makespan, the unmoved order included) is returned, so the
pass never makes a plan slower under the timing it is given.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from .backward_split import canonical_reduction_order, with_reductions
from .engine import ExecutionResult
from .ir import (
    Backward,
    BackwardWeight,
    Forward,
    Instruction,
    Placement,
    Program,
    ReduceGrads,
    StageId,
    Wait,
)

Execute = Callable[[Sequence[Program]], ExecutionResult]


def _gaps(program: Program, result: ExecutionResult, rank: int) -> list[float]:
    """Idle seconds of each Wait of `program`, in program order."""
    idle = {index: end - start for index, start, end in result.waits[rank]}
    waits = [i for i, ins in enumerate(program.instructions) if isinstance(ins, Wait)]
    return [idle.get(i, 0.0) for i in waits]


def _weight_time(program: Program, result: ExecutionResult, rank: int) -> dict[StageId, float]:
    out = {}
    for index, start, end in result.spans[rank]:
        ins = program.instructions[index]
        if isinstance(ins, BackwardWeight):
            out[ins.stage] = end - start
    return out


class _RankFill:
    """Rebuilds one rank's program: W deferred into the measured gaps, within the memory limit.

    Memory is a function of program order alone: a stage's activations are held from its
    Forward to its W (or fused Backward). Before a Forward that would take the rank over
    `limit`, the oldest deferred W run first (ZB-H1's rule), so the rebuilt program never holds
    more than `max(limit, what the unmoved program holds)`."""

    def __init__(
        self, base: Program, gaps: list[float], seconds, nbytes, limit: float, overshoot: float
    ) -> None:
        self.base, self.gaps, self.seconds, self.nbytes = base, gaps, seconds, nbytes
        self.limit, self.overshoot = limit, overshoot
        self.out: list[Instruction] = []
        self.pending: deque[BackwardWeight] = deque()
        self.held = 0.0
        self.kept = {i.stage for i in base.instructions if isinstance(i, Backward)}
        self.split = {i.stage for i in base.instructions if isinstance(i, BackwardWeight)}

    def _run_oldest(self) -> None:
        w = self.pending.popleft()
        self.held -= self.nbytes(w.stage)
        self.out.append(w)

    def _fill(self, gap: float) -> None:
        """Run the oldest deferred W while they fit the gap (each may overrun what is left of
        it by `overshoot` of its own time)."""
        while self.pending:
            need = self.seconds.get(self.pending[0].stage, 0.0)
            if gap <= 0.0 or need * (1.0 - self.overshoot) > gap:
                return
            gap -= need
            self._run_oldest()

    def _forward(self, ins: Forward) -> None:
        if ins.stage in self.kept:
            nbytes = self.nbytes(ins.stage)
            while self.pending and self.held + nbytes > self.limit:
                self._run_oldest()
            self.held += nbytes
        self.out.append(ins)

    def build(self, placement: Placement) -> Program:
        k = 0
        for ins in self.base.instructions:
            if isinstance(ins, ReduceGrads):
                continue
            if isinstance(ins, BackwardWeight):
                self.pending.append(ins)
                continue
            if isinstance(ins, Forward):
                self._forward(ins)
                continue
            if isinstance(ins, Backward) and ins.stage not in self.split:
                self.held -= self.nbytes(ins.stage)  # fused, or a frozen module's only half
            elif isinstance(ins, Wait):
                self._fill(self.gaps[k] if k < len(self.gaps) else 0.0)
                k += 1
            self.out.append(ins)
        order = canonical_reduction_order(
            placement, {(w.stage.module, w.stage.chunk) for w in self.pending}
        )
        rank_of = {key: i for i, key in enumerate(order)}
        self.out.extend(
            sorted(self.pending, key=lambda w: rank_of[(w.stage.module, w.stage.chunk)])
        )
        return Program(self.base.rank, tuple(with_reductions(self.out, placement, self.base.rank)))


def fill_bubbles_with_weights(
    programs: Sequence[Program],
    *,
    placement: Placement,
    execute: Execute,
    weight_bytes: Callable[[StageId], float] = lambda stage: 0.0,
    memory_limit: Sequence[float] | None = None,
    rounds: int = 2,
    overshoots: Sequence[float] = (0.0, 0.5),
) -> tuple[tuple[Program, ...], ExecutionResult]:
    """Programs with their W moved into bubbles (see the module docstring) and their execution.

    `programs`: split programs (`backward_split.split_backwards`), W anywhere after its B.
    `execute`: times a set of programs (the simulator's engine run). `weight_bytes`: activation
    bytes a stage holds from its Forward until its W (or fused backward); `memory_limit[r]`:
    most activation bytes rank r may hold (None: no limit). `overshoots`: the fill policies tried, each for `rounds` rounds from
    the unmoved order (0: a W goes into a gap only if it fits; 0.5: if half of it does).
    Returns the fastest programs found and their execution.
    """
    limits = list(memory_limit) if memory_limit is not None else [float("inf")] * len(programs)
    base = tuple(programs)
    first = execute(base)
    best, best_result = base, first
    for overshoot in overshoots:
        measured, result = base, first
        for _ in range(rounds):
            # The waits are the same in every round (only W and reductions move): the gaps the
            # last round measured are indexed by wait.
            candidate = tuple(
                _RankFill(
                    p,
                    _gaps(measured[r], result, r),
                    _weight_time(measured[r], result, r),
                    weight_bytes,
                    limits[r],
                    overshoot,
                ).build(placement)
                for r, p in enumerate(base)
            )
            measured, result = candidate, execute(candidate)
            if result.makespan < best_result.makespan:
                best, best_result = candidate, result
    return best, best_result
