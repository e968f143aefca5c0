"""Per-instruction timing behind the executor's public hook `on_instruction`.

`on_instruction(index, instruction, start, end)` is called once for every instruction of the
program, in program order, at the end of `Executor.run()` (after the program completed); `start`
and `end` are wall-clock seconds (`time.time()`, comparable across the ranks of a node). The
instructions of one Send/Recv batch are posted by one handler call and share its span.

On CUDA an instruction's span is measured on the GPU: a CUDA event is recorded on the current
stream before and after its handler, and the events are resolved once, at the end of the
iteration (no synchronisation per instruction, the CPU keeps running ahead). One reference event,
synchronised when the clock starts, places the GPU times on the wall clock. Elsewhere the span is
the handler's own wall-clock time.

`SpanRecorder` is a reusable hook that keeps the spans of the compute instructions (what the
training loop logs, traces and feeds the cost-model calibration with); `RankRuntime` takes it
like any other hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_dip.schedule.ir import Backward, BackwardWeight, Forward, Instruction, compute_label

InstructionHook = Callable[[int, Instruction, float, float], None]
# (label, module, is_forward, start, end): the shape `planner.trace.write_chrome_trace` takes.
Span = tuple[str, str, bool, float, float]


class InstructionClock:
    """Collects the spans of one iteration's instructions and hands them to `hook` (module
    docstring). `device`: where the chunks run (CUDA events there, wall clock elsewhere)."""

    def __init__(self, hook: InstructionHook, *, device: torch.device) -> None:
        self.hook = hook
        self.cuda = torch.device(device).type == "cuda"
        self._spans: list[tuple[int, Sequence[Instruction], Any, Any]] = []
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._origin.synchronize()  # once per iteration: anchors GPU times on the wall clock
            self._origin_wall = time.time()

    def mark(self) -> Any:
        """A point in time: a recorded CUDA event, or `time.time()`."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.time()

    def span(self, start: Any, instructions: Sequence[Instruction], *, first: int) -> None:
        """Close the span opened by `start` (a `mark()`) for `instructions`, the program's
        instructions from index `first` on."""
        self._spans.append((first, instructions, start, self.mark()))

    def flush(self) -> None:
        """Resolve every span (one synchronisation on CUDA) and call the hook, in order."""
        if self.cuda and self._spans:
            self._spans[-1][3].synchronize()
        for first, instructions, start, end in self._spans:
            t0, t1 = (self._wall(start), self._wall(end)) if self.cuda else (start, end)
            for index, ins in enumerate(instructions, start=first):
                self.hook(index, ins, t0, t1)
        self._spans.clear()

    def _wall(self, event: Any) -> float:
        return self._origin_wall + self._origin.elapsed_time(event) / 1e3


class SpanRecorder:
    """An `on_instruction` hook recording every Forward, Backward and BackwardWeight: `spans`
    (`Span`, labelled as the simulated trace does, `ir.compute_label`: "F vit0 mb3.1", a split
    backward's halves "BI ..." and "BW ...") and `ops` ((instruction, measured seconds)). Send/Recv/Wait and reductions are left
    out. Kept across iterations until `take()`, which returns and clears them."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.ops: list[tuple[Forward | Backward | BackwardWeight, float]] = []

    def __call__(self, index: int, ins: Instruction, start: float, end: float) -> None:
        del index
        if not isinstance(ins, (Forward, Backward, BackwardWeight)):
            return
        fwd = isinstance(ins, Forward)
        self.spans.append((compute_label(ins), ins.stage.module, fwd, start, end))
        self.ops.append((ins, end - start))

    def take(self) -> tuple[list[Span], list[tuple[Forward | Backward | BackwardWeight, float]]]:
        """(spans, ops) recorded since the last call."""
        out = (self.spans, self.ops)
        self.spans, self.ops = [], []
        return out


__all__ = ["InstructionClock", "InstructionHook", "Span", "SpanRecorder"]
