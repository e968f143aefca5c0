"""Helpers, no tests: per-rank building blocks of the runtime's distributed scenarios, run
inside the worker processes of `distributed_harness.run_world`."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import test_runtime_setups as st
import torch
import torch.distributed as dist

from megatron_dip.cpu_support import seed_model_parallel_rng
from megatron_dip.modalities import build_chunk
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.init import global_param_name
from megatron_dip.parallel import ParallelShape
from megatron_dip.runtime.checks import unwrap_chunk
from megatron_dip.runtime.data import SampleBatchSource
from megatron_dip.runtime.ddp import DataParallelGroups, main_grads, wrap_chunks_ddp
from megatron_dip.runtime.executor import ExecutorConfig
from megatron_dip.runtime.p2p import ChannelGroups
from megatron_dip.runtime.stock import StockPipeline
from megatron_dip.schedule import (
    Backward,
    Forward,
    Placement,
    Plan,
    build_segment_plan,
    plan_from_bytes,
    plan_to_bytes,
)
from megatron_dip.schedule.engine import PlanError
from megatron_dip.schedule.ir import ReduceGrads


@dataclass
class Groups:
    """This rank's process groups for one layout."""

    pp: dist.ProcessGroup
    tp: dist.ProcessGroup
    single: dist.ProcessGroup
    dp: dist.ProcessGroup | None = None
    extra: dict = field(default_factory=dict)

    def model_groups(self) -> ModelGroups:
        return ModelGroups(tp=self.tp, cp=self.single)


def make_groups(
    world_size: int, layouts: Sequence[Sequence[int]]
) -> list[dist.ProcessGroup | None]:
    """Create the groups `layouts` (lists of ranks), same order everywhere; None where absent."""
    me = dist.get_rank()
    mine: list[dist.ProcessGroup | None] = []
    for ranks in layouts:
        g = dist.new_group(list(ranks))
        mine.append(g if me in ranks else None)
    return mine


def singles(world_size: int) -> dist.ProcessGroup:
    """Every rank's singleton group; returns this rank's."""
    gs = make_groups(world_size, [[r] for r in range(world_size)])
    return gs[dist.get_rank()]


def pick(groups: Sequence[dist.ProcessGroup | None]) -> dist.ProcessGroup:
    return next(g for g in groups if g is not None)


def build_chunks(
    batch: st.Batch, placement: Placement, groups: Groups, *, shape: ParallelShape | None = None
) -> list[torch.nn.Module]:
    seed_model_parallel_rng(st.CFG.seed, tp_rank=groups.tp.rank())
    return [
        build_chunk(
            batch.model,
            c,
            num_chunks=placement.module(c.module).num_chunks,
            config=st.CFG,
            groups=groups.model_groups(),
            shape=shape,
        )
        for c in placement.chunks_on_rank(groups.pp.rank())
    ]


def grads_of(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """Global name -> (gradient as numpy, TP sharding info or None)."""
    out = {}
    for c in chunks:
        inner = unwrap_chunk(c)
        params = dict(inner.named_parameters())
        tp = inner.groups.tp_size
        for name, g in main_grads(c).items():
            p = params[name]
            shard = None
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                glu = inner.module_spec.layer.gated_mlp and "linear_fc1." in name
                shard = (int(p.partition_dim), glu, inner.groups.tp_rank, tp)
            out[global_name(inner, name)] = (g.detach().numpy().copy(), shard)
    return out


def global_name(chunk, local: str) -> str:
    return global_param_name(chunk, local)


def last_backwards(plan: Plan, rank: int) -> dict[tuple[str, int], int]:
    """Index of each chunk's last Backward in this rank's program."""
    last = {}
    for i, ins in enumerate(plan.program(rank).instructions):
        if isinstance(ins, Backward):
            last[(ins.stage.module, ins.stage.chunk)] = i
    return last


def count_recompute(plan: Plan, rank: int) -> dict[str, int]:
    modes: dict[str, int] = {}
    for ins in plan.program(rank).instructions:
        if isinstance(ins, Forward):
            modes[ins.memory.method.value] = modes.get(ins.memory.method.value, 0) + 1
    return modes


def _trained_chunks(
    batch: st.Batch,
    placement: Placement,
    groups: Groups,
    *,
    ddp: bool,
    shape: ParallelShape | None = None,
) -> list[torch.nn.Module]:
    chunks = build_chunks(batch, placement, groups, shape=shape)
    if ddp:
        dpg = DataParallelGroups(dp=groups.dp, tp=groups.tp, pp=groups.pp, single=groups.single)
        chunks = wrap_chunks_ddp(chunks, groups=dpg)
        for c in chunks:
            c.zero_grad_buffer()
    return chunks


def run_dropin(
    batch: st.Batch,
    placement: Placement,
    plan: Plan,
    groups: Groups,
    *,
    pipelines: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """DIP installed as Megatron-Core's schedule (`forward_backward.installed`) and called as
    Megatron-LM calls it: `get_forward_backward_func()` from `megatron.core.pipeline_parallel`,
    then the returned function with `train_step`'s keywords, the plans coming from the
    schedule's plan provider: first a forward-only evaluation (as Megatron-LM's `evaluate`),
    then the training iteration of `plan`, on DDP-wrapped chunks. The `DipSchedule` names the
    replica group (plan agreement), per-pair channels of `pipelines` (every pipeline of the job)
    and a span recorder (timing)."""
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    from megatron_dip.runtime.forward_backward import DipSchedule, installed
    from megatron_dip.runtime.p2p import PipelineP2P
    from megatron_dip.runtime.timing import SpanRecorder

    chunks = _trained_chunks(batch, placement, groups, ddp=True)
    transports: list[PipelineP2P] = []
    recorder = SpanRecorder()

    def transport(**kwargs: Any) -> PipelineP2P:
        transports.append(PipelineP2P(**kwargs))
        return transports[-1]

    evaluation = _forward_only(batch, placement, plan)
    plans = iter([evaluation, plan])
    schedule = DipSchedule(
        model=batch.model,
        placement=placement,
        pp_group=groups.pp,
        seed=st.SEED,
        plan_provider=lambda: next(plans),
        shape=ParallelShape(dtype=st.CFG.dtype),
        tensor_fn=batch.tensor_fn,
        tp_group=groups.tp,
        replica_group=groups.dp,
        channels=ChannelGroups(groups.pp, pipelines=pipelines),
        on_instruction=recorder,
        transport=transport,
    )
    original = pipeline_parallel.get_forward_backward_func
    with installed(schedule):
        replaced = [
            getattr(m.get_forward_backward_func, "__dip__", False)
            for m in (pipeline_parallel, schedules)
        ]
        evaluated = _as_megatron_lm_calls_it(batch, chunks, forward_only=True)
        eval_spans, _ = recorder.take()
        reports = _as_megatron_lm_calls_it(batch, chunks, forward_only=False)
    program = plan.program(groups.pp.rank()).instructions
    spans, ops = recorder.take()
    return {
        "grads": grads_of(chunks),
        "reports": [r["lm loss"].numpy() for r in reports],
        "eval_reports": [r["lm loss"].numpy() for r in evaluated],
        "eval_timed": len(eval_spans),
        "eval_forwards": sum(
            isinstance(i, Forward) for i in evaluation.program(groups.pp.rank()).instructions
        ),
        "objective": None,
        "installed": replaced,
        "restored": pipeline_parallel.get_forward_backward_func is original,
        "spans": [label for label, *_ in spans],
        "compute": [str(i) for i in program if isinstance(i, (Forward, Backward))],
        "timed": [str(ins) for ins, _ in ops],
        "channels": sorted({t.channel.__name__ for t in transports}),
        "messages": [t.messages_posted for t in transports],
    }


def _forward_step_func(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("DIP's chunks compute their own loss: forward_step_func is not called")


def _as_megatron_lm_calls_it(
    batch: st.Batch, chunks: Sequence[torch.nn.Module], *, forward_only: bool
) -> list[dict[str, torch.Tensor]]:
    """Megatron-LM's `train_step` (and, forward-only, `evaluate`): the schedule function from
    `get_forward_backward_func()`, called with its keywords."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward_func = get_forward_backward_func()
    return forward_backward_func(
        forward_step_func=_forward_step_func,
        data_iterator=iter(batch.microbatches),
        model=list(chunks),
        num_microbatches=len(batch.microbatches),
        seq_length=st.SEQ,
        micro_batch_size=1,
        decoder_seq_length=None,
        forward_only=forward_only,
        adjust_tensor_shapes_fn=None,
    )


def _forward_only(batch: st.Batch, placement: Placement, plan: Plan) -> Plan:
    """The forward-only segment plan of `plan`'s batch and replica (an evaluation step)."""
    evaluation = build_segment_plan(
        placement=placement,
        microbatches=batch.infos,
        submicrobatches=batch.subs,
        dependencies=batch.deps,
        totals=batch.totals,
        tensors=batch.tensor_fn(),
        forward_only=True,
    )
    return replace(evaluation, replica=plan.replica)


def _runtime(batch: st.Batch, placement: Placement, chunks, groups: Groups, *, config, channels):
    """This rank's `RankRuntime` of `chunks`, on one communicator per pair of ranks with
    `channels`."""
    return st.rank_runtime(
        batch,
        placement,
        chunks,
        pp_group=groups.pp,
        config=config,
        channels=ChannelGroups(groups.pp) if channels else None,
    )


def run_executor(
    batch: st.Batch,
    placement: Placement,
    plan: Plan,
    groups: Groups,
    *,
    config: ExecutorConfig | None = None,
    ddp: bool = False,
    channels: bool = False,
    shape: ParallelShape | None = None,
) -> dict[str, Any]:
    chunks = _trained_chunks(batch, placement, groups, ddp=ddp, shape=shape)
    runtime = _runtime(batch, placement, chunks, groups, config=config, channels=channels)
    result = runtime.run(plan, batch.by_index)
    return {
        "grads": grads_of(chunks),
        "reports": [r["lm loss"].numpy() for r in result.reports],
        "objective": result.objective,
        "freed_bytes": result.freed_bytes,
        "leftovers": result.leftovers,
        "messages": result.messages,
        "recompute": count_recompute(plan, groups.pp.rank()),
        "grad_sync": result.grad_sync_started,
        "last_backward": last_backwards(plan, groups.pp.rank()),
        "reduce": [
            (i, (ins.module, ins.chunk))
            for i, ins in enumerate(plan.program(groups.pp.rank()).instructions)
            if isinstance(ins, ReduceGrads)
        ],
        "length": len(plan.program(groups.pp.rank())),
        "sequence_parallel_params": sum(
            bool(getattr(p, "sequence_parallel", False))
            for c in chunks
            for p in unwrap_chunk(c).parameters()
        ),
        "hidden_rows": sorted(
            {
                t.shape[0]
                for ins in plan.program(groups.pp.rank()).instructions
                if hasattr(ins, "tensors") and ins.key.producer.module == ins.key.consumer.module
                for t in ins.tensors
                if t.name == "hidden"
            }
        ),
    }


def run_held(
    batch: st.Batch,
    placement: Placement,
    plan: Plan,
    groups: Groups,
    *,
    deallocate: bool,
    channels: bool = False,
) -> dict[str, Any]:
    """`plan` on this rank's `RankRuntime` with sent outputs freed or kept
    (`ExecutorConfig.deallocate_sent_outputs`), on one communicator per pair of ranks with
    `channels`, the activation bytes it holds measured after every instruction
    (`memory_probe.HeldActivations`), next to the rank's peak the simulator's memory model gives
    (`activation_peaks`, stored activations and message buffers, priced with the kernels the CPU
    runs)."""
    from megatron_dip.memory_probe import HeldActivations
    from megatron_dip.planner.cost_model import CPU_KERNELS, CostModel
    from megatron_dip.planner.devices import get_device
    from megatron_dip.planner.simulator import activation_peaks, message_peaks

    chunks = _trained_chunks(batch, placement, groups, ddp=False)
    config = ExecutorConfig(deallocate_sent_outputs=deallocate)
    runtime = _runtime(batch, placement, chunks, groups, config=config, channels=channels)
    executor = runtime._executor(plan, batch.by_index)  # the executor RankRuntime.run runs
    with HeldActivations(executor) as held:
        result = executor.run()
    cost = CostModel(batch.model, get_device("h100"), dtype_bytes=8, kernels=CPU_KERNELS)  # float64
    return {
        "grads": grads_of(chunks),
        "objective": result.objective,
        "peak": held.peak,
        "modelled_peak": activation_peaks(plan, cost)[groups.pp.rank()],
        "message_peak": held.message_peak,
        "modelled_message_peak": message_peaks(plan)[groups.pp.rank()],
        "freed_bytes": result.freed_bytes,
    }


def run_stock(
    batch: st.Batch, placement: Placement, units, groups: Groups, *, batch_p2p: bool
) -> dict[str, Any]:
    chunks = build_chunks(batch, placement, groups)
    dummy = st.segment_plan(batch, placement)  # only for the SampleBatchSource's sub table
    source = SampleBatchSource(
        model=batch.model, plan=dummy, samples=batch.by_index, seq_length=st.SEQ, seed=st.SEED
    )
    from megatron_dip.schedule import Dataflow

    pipe = StockPipeline(
        chunks=chunks,
        all_stage_units=units,
        dataflow=Dataflow(placement, batch.subs, batch.deps),
        microbatches=[i.index for i in batch.infos],
        batches=source,
        tensor_fn=batch.tensor_fn(),
        pp_group=groups.pp,
        single_group=groups.single,
        batch_p2p=batch_p2p,
    )
    reports = pipe.run()
    return {
        "grads": grads_of(chunks),
        "reports": [r["lm loss"].numpy() for r in reports],
        "objective": None,
    }


def broadcast_plan(make: Callable[[], Plan], group: dist.ProcessGroup) -> Plan:
    """Build a plan on the group's first rank only and ship it (searched plans may differ)."""
    src = dist.get_global_rank(group, 0)
    box = [plan_to_bytes(make()) if group.rank() == 0 else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return plan_from_bytes(box[0])


def expect_rejection(run: Callable[[], Any]) -> dict[str, Any]:
    """Run something that must be refused before communicating; return the error text."""
    try:
        run()
    except (PlanError, ValueError) as e:
        return {"rejected": type(e).__name__, "message": str(e)}
    return {"rejected": None, "message": ""}


def reference(batch_all: Sequence[Sequence], kind: str, single: dist.ProcessGroup) -> dict:
    from megatron_dip.reference import reference_loss_and_grads

    loss, grads = reference_loss_and_grads(
        st.model_of(kind),
        [list(mb) for mb in batch_all],
        seed=st.SEED,
        seq_length=st.SEQ,
        groups=ModelGroups(tp=single, cp=single),
        config=st.CFG,
    )
    return {"loss": loss, "grads": {k: v.numpy().copy() for k, v in grads.items()}}


def guarded(name: str, results: dict, fn: Callable[[], Any]) -> None:
    """Run one scenario; a failure is re-raised with the scenario's name (the harness then
    stops every rank: peers of a failed rank would wait forever)."""
    try:
        results[name] = fn()
    except Exception as e:
        raise RuntimeError(f"scenario {name!r} failed: {e}\n{traceback.format_exc()}") from e
