"""One iteration's forward and backward on this rank: a DIP plan on the executor, or Megatron-Core's
own schedule on the stock placement; both timed per compute operation.

Measured spans are (label, module, is_forward, start, end) with wall-clock seconds (`time.time()`,
comparable across the ranks of a node), the shape `planner.trace.write_chrome_trace` takes.
DIP spans come from the executor's per-instruction hook; stock spans from timing Megatron-Core's
`forward_step` / `backward_step` (the schedule functions themselves run unmodified).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from megatron_dip.runtime.data import SampleBatchSource
from megatron_dip.runtime.executor import Executor, ExecutorConfig
from megatron_dip.runtime.loss import LossConfig
from megatron_dip.runtime.stock import StockPipeline, StockStage
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import Backward, Forward, Plan

from .build import LocalModel
from .planning import tensor_fn
from .setup import ParallelContext
from .validate import RunSpec

Span = tuple[str, str, bool, float, float]


@dataclass
class StepResult:
    """What one rank's schedule produced."""

    reports: list[dict[str, torch.Tensor]]
    spans: list[Span]
    started: float
    ended: float
    # (module, is_forward, measured seconds, stage) per DIP compute instruction
    ops: list[tuple] = field(default_factory=list)

    @property
    def busy(self) -> float:
        return sum(end - start for *_, start, end in self.spans)

    def loss_totals(self) -> tuple[float, float]:
        """(sum of per-microbatch loss sums, loss tokens) of the reports on this rank."""
        loss, tokens = 0.0, 0.0
        for report in self.reports:
            for value in report.values():
                loss += float(value[0])
                tokens += float(value[1])
        return loss, tokens


class TimedExecutor(Executor):
    """The runtime's executor, recording the wall-clock span of each Forward/Backward."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spans: list[Span] = []
        self.ops: list[tuple] = []

    @contextlib.contextmanager
    def _traced(self, index: int, ins) -> Iterator[None]:
        if not isinstance(ins, (Forward, Backward)):
            with super()._traced(index, ins):
                yield
            return
        start = time.time()
        with super()._traced(index, ins):
            yield
        end = time.time()
        fwd = isinstance(ins, Forward)
        s = ins.stage
        label = f"{'F' if fwd else 'B'} {s.module}{s.chunk} mb{s.microbatch}.{s.sub}"
        self.spans.append((label, s.module, fwd, start, end))
        self.ops.append((ins, end - start))


def _sources(spec: RunSpec, plan: Plan, samples: dict[int, list], device) -> SampleBatchSource:
    return SampleBatchSource(
        model=spec.model,
        plan=plan,
        samples=samples,
        seq_length=spec.config.train.seq_length,
        seed=spec.config.train.seed,
        device=device,
    )


def run_dip(
    spec: RunSpec,
    ctx: ParallelContext,
    model: LocalModel,
    plan: Plan,
    samples: dict[int, list],
) -> StepResult:
    """Execute this rank's program of `plan` (training or, for a forward-only plan, evaluation)."""
    per_token = spec.config.model.calculate_per_token_loss
    if plan.forward_only:  # no gradients: run the bare chunks, no DDP
        chunks = model.inner
        loss = LossConfig(per_token=per_token, reduction_averages=True)
    else:
        chunks = model.chunks
        loss = LossConfig(per_token=per_token)
    executor = TimedExecutor(
        plan=plan,
        chunks=chunks,
        placement=spec.placement,
        pp_group=ctx.pp,
        batches=_sources(spec, plan, samples, ctx.device),
        tensor_fn=tensor_fn(spec, plan),
        config=ExecutorConfig(loss=loss, validate=False),
        channels=ctx.channels,
    )
    started = time.time()
    result = executor.run()
    return StepResult(result.reports, executor.spans, started, time.time(), executor.ops)


@contextlib.contextmanager
def _timed_megatron_steps(spans: list[Span]) -> Iterator[None]:
    """Time Megatron-Core's forward_step / backward_step calls (restored afterwards)."""
    from megatron.core.pipeline_parallel import schedules

    forward, backward = schedules.forward_step, schedules.backward_step

    def timed_forward(*args, **kwargs):
        stage = kwargs.get("model", args[2] if len(args) > 2 else None)
        start = time.time()
        out = forward(*args, **kwargs)
        module = stage.units[0][0] if isinstance(stage, StockStage) else "stage"
        spans.append((f"F {module}", module, True, start, time.time()))
        return out

    def timed_backward(*args, **kwargs):
        start = time.time()
        out = backward(*args, **kwargs)
        spans.append(("B", "stage", False, start, time.time()))
        return out

    schedules.forward_step, schedules.backward_step = timed_forward, timed_backward
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = forward, backward


def run_stock(
    spec: RunSpec,
    ctx: ParallelContext,
    model: LocalModel,
    plan: Plan,
    samples: dict[int, list],
    *,
    forward_only: bool = False,
) -> StepResult:
    """Megatron-Core's own 1F1B / interleaved schedule on this rank's stock chunks; gradients
    are reduced over data parallelism after the schedule (the stages are not DDP modules)."""
    pipe = StockPipeline(
        chunks=model.chunks,
        all_stage_units=spec.stage_units,
        dataflow=Dataflow(plan.placement, plan.submicrobatches, plan.dependencies),
        microbatches=[m.index for m in plan.microbatches],
        batches=_sources(spec, plan, samples, ctx.device),
        tensor_fn=tensor_fn(spec, plan),
        pp_group=ctx.pp,
        single_group=ctx.single,
        # PP=2 interleaved + batched p2p swaps activations and gradients (MEGATRON-ON-CPU.md).
        batch_p2p=not (len(spec.stage_units[0]) > 1 and spec.pipeline_parallel == 2),
        per_token=spec.config.model.calculate_per_token_loss,
    )
    spans: list[Span] = []
    started = time.time()
    with contextlib.ExitStack() as stack:
        for c in model.ddp:
            stack.enter_context(c.no_sync())
        stack.enter_context(_timed_megatron_steps(spans))
        reports = pipe.run(forward_only=forward_only)
    if not forward_only:
        for c in model.ddp:
            c.start_grad_sync()
        for c in model.ddp:
            c.finish_grad_sync()
    return StepResult(list(reports or []), spans, started, time.time())


def scale_gradients(model: LocalModel, factor: float) -> None:
    """Multiply every reduced gradient by `factor` (Megatron's per-token loss finalisation)."""
    for c in model.ddp:
        c.scale_gradients(factor)


def samples_by_microbatch(stream, batch, plan: Plan) -> dict[int, Sequence]:
    """The samples of each of `plan`'s microbatches (only this replica's are loaded)."""
    ids = [i for m in plan.microbatches for i in m.sample_ids]
    loaded = {s.sample_id: s for s in stream.samples(batch, ids)}
    return {m.index: [loaded[i] for i in m.sample_ids] for m in plan.microbatches}
