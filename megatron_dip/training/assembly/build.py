"""This rank's model chunks, built from the placement and wrapped in Megatron-Core's DDP.

Every rank builds exactly the chunks the placement puts on its pipeline rank, through the run's
compute backend (`backend.py`: Megatron-Core layers from `build_chunk`, with weights drawn from
global parameter names, so every layout and schedule starts identical; or emulated chunks). Chunks
with trainable parameters get one Megatron-Core `DistributedDataParallel` wrapper each (the DIP
executor starts each chunk's reduction at its own last backward); frozen chunks stay unwrapped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_dip.models.init import global_param_name
from megatron_dip.models.sharded import ParamLayout, chunk_layouts, chunks_sharded_state_dict
from megatron_dip.runtime.checks import unwrap_chunk
from megatron_dip.runtime.ddp import wrap_chunks_ddp

from ..config.run import RunSpec
from .backend import ComputeBackend
from .setup import ParallelContext

logger = logging.getLogger(__name__)


@dataclass
class LocalModel:
    """This rank's chunks: as the schedules run them (`chunks`, DDP-wrapped where trainable)."""

    chunks: list[torch.nn.Module]

    @property
    def inner(self) -> list[torch.nn.Module]:
        """The unwrapped `ModelChunk`s."""
        return [unwrap_chunk(c) for c in self.chunks]

    @property
    def ddp(self) -> list[torch.nn.Module]:
        return [c for c in self.chunks if hasattr(c, "zero_grad_buffer")]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(global name, parameter) of every parameter on this rank (trainable or not)."""
        out = []
        for chunk in self.inner:
            for local, p in chunk.named_parameters():
                out.append((global_param_name(chunk, local), p))
        return out

    def param_layouts(self) -> dict[int, ParamLayout]:
        """{id(parameter): where it lies in the global checkpoint tensors} of this rank."""
        out = {}
        for chunk in self.inner:
            params = dict(chunk.named_parameters())
            for local, layout in chunk_layouts(chunk).items():
                out[id(params[local])] = layout
        return out

    def sharded_state_dict(self, *, data_parallel_rank: int) -> dict:
        """The weights of every chunk on this rank as dist_checkpointing ShardedTensors keyed by
        global parameter name (`models.sharded`; emulated chunks too)."""
        return chunks_sharded_state_dict(self.inner, data_parallel_rank=data_parallel_rank)

    def zero_grad(self) -> None:
        for c in self.ddp:
            c.zero_grad_buffer()
        for chunk in self.inner:
            for p in chunk.parameters():
                p.grad = None


def ddp_config(spec: RunSpec):
    """Megatron-Core DDP settings: asynchronous reductions started by the schedule."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        use_distributed_optimizer=spec.distributed_optimizer,
        bucket_size=None,
        grad_reduce_in_fp32=spec.dtype != "float32",
        # Parameters whose layers delay their weight GEMMs get their hooks on the layer
        # (`runtime/delayed_wgrad.py`); no other parameter is affected.
        delay_wgrad_compute=spec.delays_weight_gradients,
    )


def build_model(spec: RunSpec, ctx: ParallelContext, *, backend: ComputeBackend) -> LocalModel:
    """Build (with `backend`), initialise and wrap this rank's chunks (module docstring)."""
    chunks = backend.build_chunks(ctx)
    for chunk in chunks:
        chunk.config.calculate_per_token_loss = spec.training.per_token_loss
    trainable = [c for c in chunks if any(p.requires_grad for p in c.parameters())]
    wrapped = dict(
        zip(
            map(id, trainable),
            wrap_chunks_ddp(trainable, groups=ctx.groups, ddp_config=ddp_config(spec)),
        )
    )
    local = LocalModel([wrapped.get(id(c), c) for c in chunks])
    count = sum(p.numel() for _, p in local.named_parameters())
    logger.info(
        "rank %d (pp %d): %d chunk(s) %s, %.2f M parameters",
        ctx.rank,
        ctx.pp_rank,
        len(chunks),
        [f"{c.chunk.module}{c.chunk.index}" for c in chunks],
        count / 1e6,
    )
    return local
