"""The logging rank's outputs: the log line, TensorBoard scalars, planned-vs-measured Chrome
traces and the --dip-metrics-json lines.

Rank 0 writes one line per --log-interval, Megatron-LM style (averages over the interval):

    iteration 20/100 | consumed samples 640 | elapsed time per iteration (ms): 412.3 |
    learning rate: 9.0E-04 | global batch size: 8 | lm loss: 4.7812E+00 | grad norm: 0.812 |
    tokens/s: 2483 | TFLOP/s/GPU: 0.01 | planned/measured (ms): 398.0/405.1 |
    cost-model error: 6.2% (calibration v2) | bound efficiency: 87.3% |
    plans searched/greedy/inline: 12/6/2 | planner restarts: 0

"planned" is the simulator's iteration time of the last iteration's plan under the calibrated
cost model; "measured" that iteration's wall time on rank 0 (schedule only); "cost-model error" is
the calibrated cost model's miss on the measured compute time of the instructions that ran
(sum over modules of |predicted - measured| / measured, averaged over the interval; it falls once
the first calibration window is in), with the calibration version now in force; "bound efficiency"
is the busiest rank's measured compute time over the measured iteration time (1.0 = no bubbles).

--dip-metrics-json (`append_record`): one JSON line per iteration on the logging rank, for tools.

Each line holds what `tools/bench_schedules.py` tabulates: the measured schedule time (slowest
rank, barrier-free), the whole iteration's time, the loss, which kind of plan ran, and the compute
backend's fields (`backend.ComputeBackend.metrics`): the emulation scale, and under
--dip-emulate-compute the simulator's prediction of the emulated iteration (the plan simulated
with the cost model times the emulation scale, on the channel model the iteration ran on) and its
bubble-free bound (the busiest rank's compute).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("megatron_dip.training")


@dataclass
class IterationRecord:
    """What the loop hands the logger for one iteration (values identical on every rank)."""

    iteration: int
    loss: float
    lr: float
    grad_norm: float | None
    seconds: float  # whole iteration, rank 0
    schedule_seconds: float  # forward/backward schedule only, rank 0
    samples: int
    consumed: int  # samples consumed by the run so far, across resumes (Megatron's counter)
    tokens: int
    flops: float
    bound_efficiency: float
    variant: str
    planned_seconds: float | None = None
    skipped: int = 0
    truncated: int = 0  # samples whose text was cut (--dip-bad-samples truncate), so far
    cost_error: float | None = None  # calibrated cost model vs measured compute, relative
    calibration_version: int = 0


@dataclass
class IntervalLog:
    """Averages over the log interval, the line, and TensorBoard (module docstring)."""

    train_iters: int
    world_size: int
    global_batch: int
    tensorboard_dir: str | None = None
    records: list[IterationRecord] = field(default_factory=list)
    variants: Counter = field(default_factory=Counter)
    consumed_samples: int = 0
    restarts: int = 0
    _writer: object = None

    def __post_init__(self) -> None:
        if self.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=self.tensorboard_dir)
            except ImportError:
                logger.warning(
                    "--tensorboard-dir given but tensorboard is not installed: no scalars written"
                )

    def add(self, record: IterationRecord) -> None:
        self.records.append(record)
        self.variants[record.variant] += 1
        self.consumed_samples = record.consumed
        if self._writer is not None:
            self._scalars(record)

    def _scalars(self, r: IterationRecord) -> None:
        w, it = self._writer, r.iteration
        w.add_scalar("lm loss", r.loss, it)
        w.add_scalar("learning-rate", r.lr, it)
        if r.grad_norm is not None:
            w.add_scalar("grad-norm", r.grad_norm, it)
        w.add_scalar("iteration-time", r.seconds, it)
        w.add_scalar("dip/bound-efficiency", r.bound_efficiency, it)
        if r.cost_error is not None:
            w.add_scalar("dip/cost-model-error", r.cost_error, it)
        if r.planned_seconds is not None:
            w.add_scalar("dip/planned-iteration-time", r.planned_seconds, it)
            w.add_scalar("dip/measured-schedule-time", r.schedule_seconds, it)

    def line(self) -> str:
        """The log line for the records since the last call (and forget them)."""
        rs, self.records = self.records, []
        n = len(rs)
        last = rs[-1]
        seconds = sum(r.seconds for r in rs) / n
        norms = [r.grad_norm for r in rs if r.grad_norm is not None]
        tokens = sum(r.tokens for r in rs) / max(sum(r.seconds for r in rs), 1e-9)
        tflops = sum(r.flops for r in rs) / max(sum(r.seconds for r in rs), 1e-9)
        tflops /= self.world_size * 1e12
        planned = "n/a" if last.planned_seconds is None else f"{1e3 * last.planned_seconds:.1f}"
        errors = [r.cost_error for r in rs if r.cost_error is not None]
        error = f"{100 * sum(errors) / len(errors):.1f}%" if errors else "n/a"
        v = self.variants
        parts = [
            f"iteration {last.iteration:>6d}/{self.train_iters:>6d}",
            f"consumed samples: {self.consumed_samples:>10d}",
            f"elapsed time per iteration (ms): {1e3 * seconds:.1f}",
            f"learning rate: {last.lr:.6E}",
            f"global batch size: {self.global_batch:>4d}",
            f"lm loss: {sum(r.loss for r in rs) / n:.6E}",
            f"grad norm: {sum(norms) / len(norms):.3f}" if norms else "grad norm: n/a",
            f"tokens/s: {tokens:.0f}",
            f"TFLOP/s/GPU: {tflops:.3g}",
            f"planned/measured (ms): {planned}/{1e3 * last.schedule_seconds:.1f}",
            f"cost-model error: {error} (calibration v{last.calibration_version})",
            f"bound efficiency: {100 * sum(r.bound_efficiency for r in rs) / n:.1f}%",
            f"plans searched/greedy/inline: {v['searched']}/{v['greedy']}/{v['inline']}",
            f"planner restarts: {self.restarts}",
        ]
        if last.skipped:
            parts.append(f"skipped samples: {last.skipped}")
        if last.truncated:
            parts.append(f"truncated samples: {last.truncated}")
        return " | ".join(parts)

    def eval_line(self, iteration: int, loss: float, batches: int) -> str:
        if self._writer is not None:
            self._writer.add_scalar("lm loss validation", loss, iteration)
        return f"validation at iteration {iteration} ({batches} batches) | lm loss: {loss:.6E}"

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def write_trace(directory: str, iteration: int, sim, measured_by_rank: list[list[tuple]]) -> Path:
    """Planned (simulated) and measured timelines of one iteration, one Chrome trace file."""
    from megatron_dip.planner.trace import write_chrome_trace

    starts = [s[3] for spans in measured_by_rank for s in spans]
    zero = min(starts, default=0.0)
    measured = [
        [(label, module, fwd, start - zero, end - zero) for label, module, fwd, start, end in spans]
        for spans in measured_by_rank
    ]
    path = Path(directory) / f"iteration_{iteration:07d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_chrome_trace(sim, path, measured=measured)


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line to `path` (created with its directory)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
