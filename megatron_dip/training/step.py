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
from megatron_dip.runtime.executor import ExecutorConfig
from megatron_dip.runtime.loss import LossConfig
from megatron_dip.runtime.p2p import P2PConfig
from megatron_dip.runtime.rank import RankRuntime
from megatron_dip.runtime.stock import StockPipeline, StockStage
from megatron_dip.runtime.timing import Span, SpanRecorder
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import Plan, Recompute

from .build import LocalModel
from .planning import tensor_fn
from .setup import ParallelContext
from .validate import RunSpec


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


def _sources(spec: RunSpec, plan: Plan, samples: dict[int, list], device):
    """Where the chunks get their inputs: the samples' tensors, or under --dip-emulate-compute
    the durations the cost model gives the plan's sub-microbatches (`samples` are metadata)."""
    if spec.emulate_scale is not None:
        from megatron_dip.emulation import EmulatedBatchSource, EmulationConfig

        return EmulatedBatchSource(
            plan=plan,
            cost_model=spec.cost_model,
            config=EmulationConfig(scale=spec.emulate_scale),
            loss_tokens={mb: [s.loss_tokens for s in metas] for mb, metas in samples.items()},
        )
    return SampleBatchSource(
        model=spec.model,
        plan=plan,
        samples=samples,
        seq_length=spec.config.train.seq_length,
        seed=spec.config.train.seed,
        device=device,
    )


def _tensor_fn(spec: RunSpec, plan: Plan):
    """What the built chunks send for each message of `plan`."""
    if spec.emulate_scale is not None:
        from megatron_dip.emulation import emulated_tensor_fn

        return emulated_tensor_fn
    return tensor_fn(spec, plan)


def _executed(spec: RunSpec, plan: Plan) -> Plan:
    """The plan as the executor runs it: emulated chunks exchange tiny stand-in messages (the
    original plan keeps the real sizes, which the emulated transfers take the time of)."""
    if spec.emulate_scale is not None:
        from megatron_dip.emulation import emulated_plan

        return emulated_plan(plan)
    return plan


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
    recorder, original = SpanRecorder(), plan
    runtime = RankRuntime(
        placement=spec.placement,
        pp_group=ctx.pp,
        chunks=chunks,
        # The sources read the plan as planned (under emulation: the real message sizes).
        batches=lambda *, plan, samples, device: _sources(spec, original, samples, device),
        tensor_fn_for=lambda _: _tensor_fn(spec, original),
        # Every blocking pipeline wait is bounded by --dip-comm-timeout-s (so are the process
        # groups, setup.init_distributed).
        config=ExecutorConfig(
            loss=loss, validate=False, p2p=P2PConfig(timeout_s=spec.config.dip.dip_comm_timeout_s)
        ),
        channels=ctx.channels,
        # The plan verdict is agreed over tensor-parallel peers and replicas too (every rank of
        # the job runs this step).
        tp_group=ctx.tp,
        replica_group=ctx.dp,
        on_instruction=recorder,
    )
    result = runtime.run(_executed(spec, plan), samples)
    spans, ops = recorder.take()
    return StepResult(result.reports, spans, result.started, result.ended, ops)


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
    """Megatron-Core's own 1F1B / interleaved schedule on this rank's stock chunks, with
    Megatron's activation recomputation (--recompute-granularity) inside the stages. With
    --overlap-grad-reduce the schedule drives the data-parallel reduction through Megatron-LM's
    DDP hooks (overlapped with the backward); otherwise it runs after the schedule."""
    recompute = spec.config.model.recompute_granularity
    overlap = spec.config.parallel.overlap_grad_reduce and not forward_only
    pipe = StockPipeline(
        chunks=model.chunks,
        all_stage_units=spec.stage_units,
        dataflow=Dataflow(plan.placement, plan.submicrobatches, plan.dependencies),
        microbatches=[m.index for m in plan.microbatches],
        batches=_sources(spec, plan, samples, ctx.device),
        tensor_fn=_tensor_fn(spec, plan),
        pp_group=ctx.pp,
        single_group=ctx.single,
        # PP=2 interleaved + batched p2p swaps activations and gradients (MEGATRON-ON-CPU.md).
        batch_p2p=not (len(spec.stage_units[0]) > 1 and spec.pipeline_parallel == 2),
        per_token=spec.config.model.calculate_per_token_loss,
        recompute=Recompute(recompute) if recompute else Recompute.NONE,
        overlap_grad_reduce=overlap,
    )
    spans: list[Span] = []
    started = time.time()
    with contextlib.ExitStack() as stack:
        if not overlap:
            for c in model.ddp:
                stack.enter_context(c.no_sync())
        stack.enter_context(_timed_megatron_steps(spans))
        reports = pipe.run(forward_only=forward_only)
    if not forward_only and not overlap:
        for c in model.ddp:
            c.start_grad_sync()
        for c in model.ddp:
            c.finish_grad_sync()
    return StepResult(list(reports or []), spans, started, time.time())


def scale_gradients(model: LocalModel, factor: float) -> None:
    """Multiply every reduced gradient by `factor` (Megatron's per-token loss finalisation)."""
    for c in model.ddp:
        c.scale_gradients(factor)


def samples_by_microbatch(
    stream, batch, plan: Plan, *, metadata_only: bool = False
) -> dict[int, Sequence]:
    """The samples of each of `plan`'s microbatches (only this replica's are loaded); with
    `metadata_only` (emulated compute) their `SampleMeta`s, nothing is loaded."""
    ids = [i for m in plan.microbatches for i in m.sample_ids]
    if metadata_only:
        loaded = {s.sample_id: s for s in batch.samples}
    else:
        loaded = {s.sample_id: s for s in stream.samples(batch, ids)}
    return {m.index: [loaded[i] for i in m.sample_ids] for m in plan.microbatches}
