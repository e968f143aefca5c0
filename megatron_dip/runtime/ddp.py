"""Data parallelism through Megatron-Core's `DistributedDataParallel`, one wrapper per chunk.

Each model chunk of a rank gets its own DDP wrapper (own gradient buffer and buckets), so each
chunk's reduction can start on its own, at the chunk's last Backward in the plan (the executor
drives `no_sync` / `start_grad_sync` / `finish_grad_sync`; see `gradsync.py` for the order).
Process groups are passed explicitly; nothing is read from Megatron's `parallel_state`.

The executor keeps `overlap_grad_reduce=True` semantics (asynchronous reductions started by
the executor, waited for at the end); Megatron's own per-parameter "grad ready" counting is not
used because every Backward runs under `no_sync`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_dip.parallel.groups import RunGroups, run_collection

from .checks import unwrap_chunk


@dataclass(frozen=True)
class DataParallelGroups:
    """The groups one rank's DDP wrappers use, for groups made outside a run (a training run
    passes its `parallel.groups.RunGroups`, which has the same `collection()`).

    `dp`: the data-parallel group (same pipeline and tensor rank in every replica). `tp`, `pp`:
    this rank's tensor- and pipeline-parallel groups. `single`: a group holding only this rank
    (stands in for expert parallelism, which these models do not use). `mp`: the model-parallel
    group (the optimizer's; DDP does not read it).
    """

    dp: torch.distributed.ProcessGroup
    tp: torch.distributed.ProcessGroup
    pp: torch.distributed.ProcessGroup
    single: torch.distributed.ProcessGroup
    mp: torch.distributed.ProcessGroup | None = None

    def collection(self):
        """Megatron's `ProcessGroupCollection` for the DDP wrapper (parallel/groups.py)."""
        return run_collection(dp=self.dp, tp=self.tp, pp=self.pp, mp=self.mp, single=self.single)


def default_ddp_config():
    """DDP settings the executor expects: asynchronous reductions, no distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=False, bucket_size=None
    )


def wrap_chunks_ddp(
    chunks: Sequence[torch.nn.Module], *, groups: DataParallelGroups | RunGroups, ddp_config=None
) -> list[torch.nn.Module]:
    """Wrap every chunk in Megatron-Core's DDP (call in the same order on every rank).

    `ddp_config` must keep `overlap_grad_reduce=True` (the executor starts each chunk's
    reduction itself). Zero the buffers with `zero_grad_buffer()` before each iteration, as
    Megatron's training loop does.
    """
    from megatron.core.distributed import DistributedDataParallel

    config = ddp_config or default_ddp_config()
    if not config.overlap_grad_reduce:
        raise ValueError("the executor starts reductions itself: use overlap_grad_reduce=True")
    wrapped = []
    for chunk in chunks:
        inner = unwrap_chunk(chunk)
        wrapped.append(
            DistributedDataParallel(
                config=inner.config,
                ddp_config=config,
                module=chunk,
                disable_bucketing=False,
                pg_collection=groups.collection(),
            )
        )
    return wrapped


def main_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Local parameter name -> reduced gradient (`main_grad` under DDP, else `.grad`)."""
    inner = unwrap_chunk(module)
    out = {}
    for name, p in inner.named_parameters():
        if not p.requires_grad:
            continue
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = g
    return out


def reduce_sequence_parallel_grads(chunks: Sequence[torch.nn.Module]) -> int:
    """Sum over the tensor-parallel group the gradients of parameters marked `sequence_parallel`.

    Under sequence parallelism such parameters (norm weights and biases, row-parallel biases)
    see only this rank's sequence shard, so each rank holds a partial gradient; Megatron sums
    them in `finalize_model_grads` (`_allreduce_layernorm_grads`). Call once per iteration on
    every rank of each chunk's TP group (`chunk.groups.tp`, the explicit group), after the
    backward and the data-parallel reduction, before the optimizer step; the TP ranks of one
    pipeline rank hold the same chunks in the same order. Uses `main_grad` under DDP. One
    coalesced all-reduce per group; returns the number of gradients reduced.
    """
    pending: dict[int, tuple[torch.distributed.ProcessGroup, list[torch.Tensor]]] = {}
    for chunk in chunks:
        inner = unwrap_chunk(chunk)
        groups = getattr(inner, "groups", None)
        if groups is None or groups.tp_size == 1:
            continue
        for p in inner.parameters():
            if not p.requires_grad or not getattr(p, "sequence_parallel", False):
                continue
            g = getattr(p, "main_grad", None)
            if g is None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = p.grad
            pending.setdefault(id(groups.tp), (groups.tp, []))[1].append(g)
    count = 0
    for group, grads in pending.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=group)
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()
        count += len(grads)
    return count
