"""The compute backend of a run, chosen once (`select_backend`): Megatron-Core chunks that compute
(`RealCompute`), or emulated chunks that sleep the cost model's time (`EmulatedCompute`,
--dip-emulate-compute; `megatron_dip.emulation`).

A backend supplies exactly what differs between the two; the model builder, the step and the
loop call it and never ask which one runs:

* `build_chunks(ctx)`: this rank's chunks, as the placement puts them on its pipeline rank;
* `samples_for(stream, batch, plan)`: each microbatch's samples (loaded, or only their metadata);
* `batch_source(plan=, samples=, device=)`: the chunks' inputs (a `RankRuntime` batch-source
  factory; the stock adapter uses it too);
* `tensor_fn(plan)`: what the chunks send for each message of `plan` (the stock adapter packs it);
* `checked_shapes(plan)`: the message shapes DIP's executor holds `plan` to;
* `transport`: the `TransportFactory` of DIP's executor;
* `predicted(plan, channel=, calibration=)`: the simulator's prediction of an iteration of `plan`
  on the channel model it ran on (None when the backend cannot predict it yet);
* `metrics(plan, sim=, channel=)`: the backend's fields of a --dip-metrics-json line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from megatron_dip.batching import MessageShapes
from megatron_dip.modalities import build_chunk
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.config import ModelConfig
from megatron_dip.planner.simulator import SimResult, simulate
from megatron_dip.runtime.checks import TensorFn
from megatron_dip.runtime.data import BatchSource, SampleBatchSource
from megatron_dip.runtime.p2p import PipelineP2P
from megatron_dip.runtime.rank import Samples
from megatron_dip.runtime.transport import TransportFactory
from megatron_dip.schedule.engine import ChannelFn
from megatron_dip.schedule.ir import Plan

from ..config.run import RunSpec
from .setup import ParallelContext


class ComputeBackend(Protocol):
    """What a run's chunks are and how they are fed and timed (module docstring)."""

    transport: TransportFactory

    def build_chunks(self, ctx: ParallelContext) -> list[torch.nn.Module]: ...

    def samples_for(self, stream: Any, batch: Any, plan: Plan) -> dict[int, list]: ...

    def batch_source(
        self, *, plan: Plan, samples: Samples, device: torch.device
    ) -> BatchSource: ...

    def tensor_fn(self, plan: Plan) -> TensorFn: ...

    def checked_shapes(self, plan: Plan) -> TensorFn | None: ...

    def predicted(
        self, plan: Plan, *, channel: ChannelFn, calibration: Any
    ) -> SimResult | None: ...

    def metrics(self, plan: Plan, *, sim: SimResult | None, channel: ChannelFn) -> dict: ...


def select_backend(spec: RunSpec) -> ComputeBackend:
    """The run's backend: emulated under --dip-emulate-compute, real otherwise."""
    if spec.emulate_scale is not None:
        return EmulatedCompute(spec, scale=spec.emulate_scale)
    return RealCompute(spec)


def _by_microbatch(plan: Plan, found: Mapping[int, Any]) -> dict[int, list]:
    return {m.index: [found[i] for i in m.sample_ids] for m in plan.microbatches}


def model_config(spec: RunSpec) -> ModelConfig:
    """Build-time options of the chunks from the flags."""
    return ModelConfig(
        seed=spec.training.seed,
        dtype=spec.dtype,
        init_std=spec.training.init_std,
        attention=spec.training.attention,
        delay_wgrad=spec.delays_weight_gradients,
    )


def megatron_chunks(spec: RunSpec, ctx: ParallelContext) -> list[torch.nn.Module]:
    """This rank's chunks of Megatron-Core layers (the real compute backend's)."""
    config = model_config(spec)
    # Ranks holding a middle chunk of a tied module never reduce its copies: their own group.
    run = ctx.groups
    groups = ModelGroups(tp=run.tp, cp=run.cp, embedding=run.embedding or run.single)
    return [
        build_chunk(
            spec.model,
            c,
            num_chunks=spec.placement.module(c.module).num_chunks,
            config=config,
            groups=groups,
            shape=spec.shape,
        )
        for c in spec.placement.chunks_on_rank(ctx.pp_rank)
    ]


def tensor_fn(spec: RunSpec, plan: Plan):
    """The built model's message shapes for the sub-microbatches of `plan`."""
    return MessageShapes(spec.model, spec.shape).for_lookup(plan.submicrobatch)


class RealCompute:
    """Megatron-Core layers computing on the samples' tensors."""

    transport: TransportFactory = PipelineP2P

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    def build_chunks(self, ctx: ParallelContext) -> list[torch.nn.Module]:
        return megatron_chunks(self.spec, ctx)

    def samples_for(self, stream: Any, batch: Any, plan: Plan) -> dict[int, list]:
        """The samples of `plan`'s microbatches, loaded (only this replica's)."""
        ids = [i for m in plan.microbatches for i in m.sample_ids]
        return _by_microbatch(plan, {s.sample_id: s for s in stream.samples(batch, ids)})

    def batch_source(self, *, plan: Plan, samples: Samples, device: torch.device) -> BatchSource:
        train = self.spec.training
        return SampleBatchSource(
            model=self.spec.model,
            plan=plan,
            samples=samples,
            seq_length=train.seq_length,
            seed=train.seed,
            device=device,
        )

    def tensor_fn(self, plan: Plan) -> TensorFn:
        return tensor_fn(self.spec, plan)

    def checked_shapes(self, plan: Plan) -> TensorFn:
        return self.tensor_fn(plan)

    def predicted(self, plan: Plan, *, channel: ChannelFn, calibration: Any) -> SimResult | None:
        """`plan` simulated with the calibrated cost model (None while uncalibrated on CPU,
        where the data-sheet cost model says nothing about this machine)."""
        spec = self.spec
        if not (spec.cuda or calibration.covers(spec.model)):
            return None
        return simulate(plan, calibration.apply(spec.cost_model), channel=channel)

    def metrics(self, plan: Plan, *, sim: SimResult | None, channel: ChannelFn) -> dict:
        del plan, sim, channel
        return {"emulate_scale": None}


class EmulatedCompute:
    """Emulated chunks sleeping the cost model's time x `scale` for their real input; messages
    are tiny stand-ins (the emulated transport) taking the planned bytes' transfer time."""

    def __init__(self, spec: RunSpec, *, scale: float) -> None:
        from megatron_dip.emulation import EmulationConfig, emulated_p2p

        self.spec, self.scale = spec, scale
        self.config = EmulationConfig(scale=scale)
        self.transport: TransportFactory = emulated_p2p

    def build_chunks(self, ctx: ParallelContext) -> list[torch.nn.Module]:
        from megatron_dip.emulation import build_emulated_chunks

        return build_emulated_chunks(self.spec.model, self.spec.placement, rank=ctx.pp_rank)

    def samples_for(self, stream: Any, batch: Any, plan: Plan) -> dict[int, list]:
        """The `SampleMeta`s of `plan`'s microbatches: emulated chunks load nothing."""
        del stream
        return _by_microbatch(plan, {s.sample_id: s for s in batch.samples})

    def batch_source(self, *, plan: Plan, samples: Samples, device: torch.device) -> BatchSource:
        """Durations of the cost model for `plan`'s sub-microbatches (`samples`: metadata)."""
        from megatron_dip.emulation import EmulatedBatchSource

        del device
        return EmulatedBatchSource(
            plan=plan,
            cost_model=self.spec.cost_model,
            config=self.config,
            loss_tokens={mb: [s.loss_tokens for s in metas] for mb, metas in samples.items()},
        )

    def tensor_fn(self, plan: Plan) -> TensorFn:
        from megatron_dip.emulation import emulated_tensor_fn

        del plan
        return emulated_tensor_fn

    def checked_shapes(self, plan: Plan) -> None:
        """Nothing to hold the plan to: its shapes are the real model's (they price the
        transfers), and the transport carries stand-ins, which it checks itself."""
        del plan

    def predicted(self, plan: Plan, *, channel: ChannelFn, calibration: Any) -> SimResult:
        """`plan` simulated as the emulated run executes it: the cost model times the scale
        (taken by construction, so no calibration applies)."""
        from megatron_dip.emulation.timing import ScaledCostModel

        del calibration
        return simulate(plan, ScaledCostModel(self.spec.cost_model, self.scale), channel=channel)

    def metrics(self, plan: Plan, *, sim: SimResult | None, channel: ChannelFn) -> dict:
        """The scale, the simulator's prediction and its bubble-free bound."""
        sim = sim or self.predicted(plan, channel=channel, calibration=None)
        return {"emulate_scale": self.scale, "predicted_s": sim.iteration_time,
                "bound_s": sim.lower_bound}  # fmt: skip


__all__ = ["ComputeBackend", "EmulatedCompute", "RealCompute", "select_backend"]
