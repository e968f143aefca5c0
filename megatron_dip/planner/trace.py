"""Timelines of an iteration and their Chrome/Perfetto trace export.

A timeline is, per pipeline rank, a sequence of compute spans `(label, module, is_forward, start,
end)` in seconds. Simulated timelines carry more fields (`Span`); measured ones (from the runtime)
may be plain 5-tuples, so planned and measured iterations can be written into one trace and
compared side by side in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from ..schedule.engine import ExecutionResult
from ..schedule.ir import Forward, Plan, compute_label

__all__ = [
    "HasTimeline",
    "Span",
    "Timeline",
    "chrome_trace_events",
    "plan_timeline",
    "write_chrome_trace",
]


class Span(NamedTuple):
    """One compute instruction's execution; the first five fields are the measured-trace shape."""

    label: str  # "F vit3 mb2.1": kind, module and chunk, microbatch.sub-microbatch
    module: str
    is_forward: bool
    start: float  # seconds
    end: float
    chunk: int = -1
    microbatch: int = -1
    sub: int = -1
    recompute: str = "none"


Timeline = Sequence[Sequence[tuple]]  # per rank: Span or (label, module, is_forward, start, end)


class HasTimeline(Protocol):
    """What carries a timeline of its own (a `simulator.SimResult`): the simulator uses this
    module, so this module names only the shape it reads."""

    timeline: Timeline


def plan_timeline(plan: Plan, execution: ExecutionResult) -> tuple[tuple[Span, ...], ...]:
    """The compute spans of `execution` (an `execute_programs` result of `plan`'s programs)."""
    ranks = []
    for program, spans in zip(plan.programs, execution.spans):
        row = []
        for index, start, end in spans:
            ins = program.instructions[index]
            fwd = isinstance(ins, Forward)
            s = ins.stage
            recompute = ins.memory.label if fwd else "none"
            row.append(
                Span(
                    compute_label(ins),
                    s.module,
                    fwd,
                    start,
                    end,
                    s.chunk,
                    s.microbatch,
                    s.sub,
                    recompute,
                )
            )
        ranks.append(tuple(row))
    return tuple(ranks)


def chrome_trace_events(
    timeline: Timeline, *, process: str = "rank", pid_offset: int = 0
) -> list[dict]:
    """Chrome trace events: one process per rank (named `process` + rank), one "X" event per
    span, timestamps in microseconds, category fwd/bwd, stage details in args."""
    events: list[dict] = []
    for rank, spans in enumerate(timeline):
        pid = pid_offset + rank
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"name": f"{process} {rank}"},
            }
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        for span in spans:
            label, module, is_forward, start, end = span[:5]
            args = {"module": module, "rank": rank}
            if isinstance(span, Span):
                args.update(
                    chunk=span.chunk,
                    microbatch=span.microbatch,
                    sub=span.sub,
                    recompute=span.recompute,
                )
            events.append(
                {
                    "name": label,
                    "cat": "fwd" if is_forward else "bwd",
                    "ph": "X",
                    "pid": pid,
                    "tid": 0,
                    "ts": start * 1e6,
                    "dur": (end - start) * 1e6,
                    "args": args,
                }
            )
    return events


def _as_timeline(source: HasTimeline | tuple[Plan, ExecutionResult] | Timeline) -> Timeline:
    if hasattr(source, "timeline"):
        return source.timeline  # a simulation (`simulator.SimResult`)
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], Plan):
        return plan_timeline(*source)
    return source  # type: ignore[return-value]


def write_chrome_trace(
    source: HasTimeline | tuple[Plan, ExecutionResult] | Timeline,
    path: str | Path,
    *,
    measured: Timeline | None = None,
) -> Path:
    """Write a Chrome/Perfetto trace JSON of `source` (a `SimResult`, a `(plan, execution)` pair
    or a timeline) to `path`; `measured`, if given, is added as processes "measured rank r"
    below the planned ones. Returns the path written."""
    planned = _as_timeline(source)
    events = chrome_trace_events(planned, process="planned rank" if measured else "rank")
    if measured is not None:
        events += chrome_trace_events(measured, process="measured rank", pid_offset=len(planned))
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
