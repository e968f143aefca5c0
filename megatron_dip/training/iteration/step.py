"""One iteration's forward and backward on this rank: a DIP plan through Megatron's drop-in
schedule function (`DipStep`: `runtime.forward_backward.dip_forward_backward`, the function users
install as Megatron-Core's `forward_backward_func`), or Megatron-Core's own schedule on the stock
placement (`run_stock`); both timed per compute operation, both on the run's compute backend
(`backend.py`: chunks, inputs, message shapes).

Measured spans are (label, module, is_forward, start, end) with wall-clock seconds (`time.time()`,
comparable across the ranks of a node), the shape `planner.trace.write_chrome_trace` takes.
DIP spans come from the runtime's `SpanRecorder` (its per-instruction hook); stock spans from
timing Megatron-Core's `forward_step` / `backward_step` (the schedule functions run unmodified).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron_dip.runtime.executor import ExecutorConfig
from megatron_dip.runtime.forward_backward import DipSchedule, dip_forward_backward
from megatron_dip.runtime.loss import LossConfig, per_token_scale
from megatron_dip.runtime.p2p import P2PConfig
from megatron_dip.runtime.stock import StockPipeline, StockStage
from megatron_dip.runtime.timing import Span, SpanRecorder
from megatron_dip.schedule.engine import ChannelFn, single_channel
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import Plan

from ..assembly.backend import ComputeBackend
from ..assembly.build import LocalModel
from ..assembly.setup import ParallelContext
from ..config.run import RunSpec


@dataclass
class StepResult:
    """What one rank's schedule produced."""

    reports: list[dict[str, torch.Tensor]]
    spans: list[Span]
    started: float
    ended: float
    # (instruction, measured seconds) per DIP compute instruction
    ops: list[tuple] = field(default_factory=list)
    # The channel model the messages travelled on (a simulation of the iteration uses it):
    # DIP's transport names its own; Megatron's schedules use one communicator per pipeline.
    channel: ChannelFn = single_channel

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


class DipStep:
    """This rank's DIP step: Megatron's drop-in (`runtime.forward_backward.dip_forward_backward`)
    called as Megatron-LM's `train_step` calls `forward_backward_func`, on two `DipSchedule`s
    assembled once per run: one for training plans on the DDP-wrapped chunks and one for
    forward-only plans on the bare chunks (no gradients, so no DDP). Both take the compute
    backend's batch sources, message shapes and transport, the run's channels, plan agreement
    groups and stall watch, and one `SpanRecorder` timing every compute instruction. What the
    training loop adds (plans from the planner, calibration, non-finite checks, stall phases)
    happens around the call, as Megatron-LM's loop does around its `forward_backward_func`."""

    def __init__(
        self, spec: RunSpec, ctx: ParallelContext, model: LocalModel, backend: ComputeBackend
    ) -> None:
        self.recorder = SpanRecorder()
        self.seq_length = spec.training.seq_length
        per_token = spec.training.per_token_loss
        self.schedules = {
            False: self._schedule(spec, ctx, backend, LossConfig(per_token=per_token)),
            True: self._schedule(
                spec, ctx, backend, LossConfig(per_token=per_token, reduction_averages=True)
            ),
        }
        self.chunks = {False: model.chunks, True: model.inner}

    def _schedule(
        self, spec: RunSpec, ctx: ParallelContext, backend: ComputeBackend, loss: LossConfig
    ) -> DipSchedule:
        return DipSchedule(
            model=spec.model,
            placement=spec.placement,
            pp_group=ctx.pp,
            seed=spec.training.seed,
            shape=spec.shape,
            # Every blocking pipeline wait is bounded by --dip-comm-timeout-s (so are the
            # process groups, setup.init_distributed).
            executor=ExecutorConfig(
                loss=loss,
                validate=False,
                p2p=P2PConfig(timeout_s=spec.runtime.comm_timeout_s),
            ),
            tensor_fn=backend.checked_shapes,
            batches=backend.batch_source,
            transport=backend.transport,
            channels=ctx.channels,
            # The plan verdict is agreed over tensor-parallel peers and replicas too (every rank
            # of the job runs this step).
            tp_group=ctx.tp,
            replica_group=ctx.dp,
            on_instruction=self.recorder,
            embedding_group=ctx.embedding,
            watch=ctx.watch,
        )

    def run(self, plan: Plan, samples: dict[int, list]) -> StepResult:
        """Execute this rank's program of `plan` (training or, forward-only, evaluation)."""
        schedule = self.schedules[plan.forward_only]
        dip_forward_backward(
            forward_step_func=None,
            data_iterator=iter([samples[mb.index] for mb in plan.microbatches]),
            model=self.chunks[plan.forward_only],
            num_microbatches=len(plan.microbatches),
            seq_length=self.seq_length,
            micro_batch_size=1,
            forward_only=plan.forward_only,
            schedule=schedule,
            plan=plan,
        )
        result = schedule.last_result
        spans, ops = self.recorder.take()
        return StepResult(
            result.reports, spans, result.started, result.ended, ops, channel=result.channel
        )


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
    backend: ComputeBackend,
    plan: Plan,
    samples: dict[int, list],
    *,
    forward_only: bool = False,
) -> StepResult:
    """Megatron-Core's own 1F1B / interleaved schedule on this rank's stock chunks, with
    Megatron's activation recomputation (--recompute-granularity) inside the stages. With
    --overlap-grad-reduce the schedule drives the data-parallel reduction through Megatron-LM's
    DDP hooks (overlapped with the backward); otherwise it runs after the schedule."""
    overlap = spec.overlap_grad_reduce and not forward_only
    pipe = StockPipeline(
        chunks=model.chunks,
        all_stage_units=spec.stage_units,
        dataflow=Dataflow(plan.placement, plan.submicrobatches, plan.dependencies),
        microbatches=[m.index for m in plan.microbatches],
        batches=backend.batch_source(plan=plan, samples=samples, device=ctx.device),
        tensor_fn=backend.tensor_fn(plan),
        pp_group=ctx.pp,
        single_group=ctx.single,
        # PP=2 interleaved + batched p2p swaps activations and gradients (docs/design.md, "Megatron-Core on a CPU").
        batch_p2p=not (len(spec.stage_units[0]) > 1 and spec.shape.pp == 2),
        per_token=spec.training.per_token_loss,
        memory=spec.recompute,
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
        with ctx.watch.phase("grad sync", group=ctx.dp, group_name="data-parallel group"):
            for c in model.ddp:
                c.start_grad_sync()
            for c in model.ddp:
                c.finish_grad_sync()
    if not forward_only and ctx.embedding is not None:
        from megatron_dip.models.chunk import reduce_tied_embedding_grads

        with ctx.watch.phase("grad sync", group=ctx.embedding, group_name="embedding group"):
            reduce_tied_embedding_grads(model.inner, group=ctx.embedding)
    return StepResult(list(reports or []), spans, started, time.time())


def scale_gradients(model: LocalModel, factor: float) -> None:
    """Multiply every reduced gradient by `factor` (Megatron's per-token loss finalisation)."""
    for c in model.ddp:
        c.scale_gradients(factor)


def finish_stock_gradients(spec: RunSpec, model: LocalModel, loss_tokens: float) -> None:
    """The stock path's per-token loss (--calculate-per-token-loss), as Megatron-LM finishes it
    after the schedule: the reduced gradients scaled by `runtime.loss.per_token_scale` of the
    global batch's `loss_tokens` (DIP weights its losses before the backward instead)."""
    if spec.training.per_token_loss:
        scale_gradients(model, per_token_scale(loss_tokens))
