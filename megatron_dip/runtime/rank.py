"""One rank's DIP runtime, assembled once per run; `run(plan, samples)` once per iteration.

A `RankRuntime` holds the parts of a run that never change: the placement and this rank's chunks,
the pipeline group, the tensor-parallel and replica groups the plan verdict is agreed over, the
per-pair `ChannelGroups`, the executor's options, the group of tied embeddings, the timing hook,
and three factories: the batch source of a plan's samples, the model's message shapes for a plan,
and the transport (`PipelineP2P` by default). Each iteration it builds a fresh transport, batch
source and `Executor` (which checks the plan and agrees on it before any message), runs the
program, and finishes the gradients that are not the executor's: tied input/output embeddings
summed over the embedding group.

Every DIP path runs through it: Megatron's drop-in (`forward_backward.dip_forward_backward` via
`DipSchedule.runtime`), which the training loop's step (`training.iteration.step.DipStep`) calls as
Megatron-LM does; emulated compute (emulated chunks, batch source and transport plugged into the
same factories) and the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_dip.schedule.ir import Placement, Plan

from .checks import TensorFn, chunks_device, unwrap_chunk
from .data import BatchSource
from .executor import Executor, ExecutorConfig
from .iteration import IterationResult
from .p2p import ChannelGroups, PipelineP2P
from .stalls import NoWatch, PhaseWatch
from .timing import InstructionHook
from .transport import TransportFactory

Samples = Mapping[int, Sequence[Any]]
# The message shapes the executor holds a plan to (None: nothing to check for this plan).
TensorFnFactory = Callable[[Plan], TensorFn | None]


class BatchSourceFactory(Protocol):
    """Builds the `BatchSource` of one plan on this rank (`SampleBatchSource` bound to the model,
    sequence length and seed is one)."""

    def __call__(self, *, plan: Plan, samples: Samples, device: torch.device) -> BatchSource: ...


class RankRuntime:
    """This rank's runtime for a run (module docstring).

    `chunks`: this rank's model chunks (possibly DDP-wrapped), as `placement` puts them on
    pipeline rank `pp_group.rank()`. `batches`: the batch source of a plan's samples.
    `tensor_fn_for`: the built model's message shapes for a plan (a plan with other shapes is
    refused); None: not checked. `transport`: builds each iteration's transport from the
    pipeline group, the chunks' device, `config.p2p` and `channels`. `channels`: one group per
    (sender, receiver) pair (None: every message on the pipeline group). `tp_group` /
    `replica_group`: the plan verdict is also agreed over them (every rank of those groups must
    then run the iteration). `embedding_group`: the ranks holding tied LLM embeddings (None:
    untied). `on_instruction`: the per-instruction timing hook (`timing.SpanRecorder`, ...).
    `watch`: the training loop's named phases (`stalls.PhaseWatch`), None outside training.
    `config`: the executor's options (default `ExecutorConfig()`).
    """

    def __init__(
        self,
        *,
        placement: Placement,
        pp_group: dist.ProcessGroup,
        chunks: Sequence[torch.nn.Module],
        batches: BatchSourceFactory,
        tensor_fn_for: TensorFnFactory | None = None,
        transport: TransportFactory = PipelineP2P,
        config: ExecutorConfig | None = None,
        channels: ChannelGroups | None = None,
        tp_group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
        embedding_group: dist.ProcessGroup | None = None,
        on_instruction: InstructionHook | None = None,
        watch: PhaseWatch | NoWatch | None = None,
    ) -> None:
        self.watch = watch
        self.placement = placement
        self.pp_group = pp_group
        self.chunks = list(chunks)
        self.device = chunks_device(self.chunks)
        self.batches = batches
        self.tensor_fn_for = tensor_fn_for
        self.transport = transport
        self.config = config if config is not None else ExecutorConfig()
        self.channels = channels
        self.tp_group = tp_group
        self.replica_group = replica_group
        self.embedding_group = embedding_group
        self.on_instruction = on_instruction

    def _executor(self, plan: Plan, samples: Samples) -> Executor:
        """A checked and agreed `Executor` of `plan` on a fresh transport and batch source
        (collective: every rank of the agreement groups builds its own)."""
        transport = self.transport(
            group=self.pp_group, device=self.device, config=self.config.p2p, channels=self.channels
        )
        return Executor(
            plan=plan,
            chunks=self.chunks,
            placement=self.placement,
            pp_group=self.pp_group,
            batches=self.batches(plan=plan, samples=samples, device=self.device),
            transport=transport,
            tensor_fn=self.tensor_fn_for(plan) if self.tensor_fn_for is not None else None,
            config=self.config,
            tp_group=self.tp_group,
            replica_group=self.replica_group,
            on_instruction=self.on_instruction,
            watch=self.watch,
        )

    def run(self, plan: Plan, samples: Samples) -> IterationResult:
        """Execute this rank's program of `plan` with the samples of each microbatch
        (`samples[mb]`, in order), then finish the gradients (tied embeddings)."""
        result = self._executor(plan, samples).run()
        if self.embedding_group is not None and not plan.forward_only:
            from megatron_dip.models.chunk import reduce_tied_embedding_grads

            reduce_tied_embedding_grads(
                [unwrap_chunk(c) for c in self.chunks], group=self.embedding_group
            )
        return result


__all__ = ["BatchSourceFactory", "RankRuntime", "Samples", "TensorFnFactory"]
