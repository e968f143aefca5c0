"""Where each local tensor of a chunk lies in the global, placement-free checkpoint tensors.

Megatron-Core's `dist_checkpointing` saves a `ShardedTensor` per local tensor: a key naming the
global tensor, the global shape and this tensor's offset in it, and a replica id (0 on exactly
one copy of every element: the copy that is written). This module derives them for any chunk
from what a parameter already carries, so a checkpoint depends neither on the placement (which
rank holds which layers), nor on TP, DP or the optimizer:

* key: the global parameter name (`init.global_param_name`: module, GLOBAL layer index, local
  path), e.g. "llm.layers.5.mlp.linear_fc1.weight";
* global shape and offset: from Megatron's tensor-parallel attributes (`tensor_model_parallel`,
  `partition_dim`, set by `common.mark_tensor_parallel_weights`); a gated MLP's fc1 is [gate; up]
  on every TP rank, and its global tensor is [all gates; all ups] (the layout of Megatron-Core's
  `apply_swiglu_sharded_factory`: the gate half of TP rank r is fragment r of 2*TP along dim 0,
  the up half fragment TP + r), expressed as two views of the parameter, so a load writes into
  the parameter in place;
* replica id (Megatron's (PP, TP, DP) convention): (1, ., .) on the last chunk's copy of a tied
  LLM embedding (the first chunk's copy is written), TP rank for a parameter every TP rank holds
  whole (norms, row-parallel biases, sequence-parallel and replicated parameters), and the
  data-parallel rank for the model weights every replica holds.

A `ParamLayout` also cuts a FLAT range of the local tensor (Megatron's distributed optimizer
keeps each data-parallel rank's contiguous range of every parameter's flattened shard) into the
few hyper-rectangles it covers, so optimizer state is saved in the same global coordinates as the
weights: each rank writes only the elements it holds, and any other layout or optimizer reads
back the elements it needs. Knows no modality kind.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .init import global_param_name, is_gated_fc1


@dataclass(frozen=True)
class Segment:
    """Local rows [local_start, local_start + length) along the partition dim lie at global rows
    [global_start, global_start + length)."""

    local_start: int
    length: int
    global_start: int


@dataclass(frozen=True)
class ParamLayout:
    """Where one local parameter tensor lies in its global tensor (module docstring)."""

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dim: int  # the dim the segments cut (0 for tensors every TP rank holds whole)
    segments: tuple[Segment, ...]
    alias: int  # 1: a duplicate copy (a tied embedding's second copy), never written
    tp_replica: int  # this TP rank for tensors every TP rank holds whole, else 0

    def replica_id(self, data_parallel: int) -> tuple[int, int, int]:
        """Megatron's (PP, TP, DP) replica id of this copy; `data_parallel`: 0 for state that
        each data-parallel rank holds a distinct part of (the distributed optimizer's)."""
        return (self.alias, self.tp_replica, data_parallel)

    def tensors(self, key: str, data: torch.Tensor, *, data_parallel: int) -> list:
        """ShardedTensors of `data` (a tensor of the local shape: the parameter or its plain
        optimizer state) under `key`, on the regular grid of TP fragments."""
        from megatron.core.dist_checkpointing import ShardedTensor

        if tuple(data.shape) != self.local_shape:
            raise ValueError(f"{key}: local shape {tuple(data.shape)}, expected {self.local_shape}")
        replica = self.replica_id(data_parallel)
        if data.dim() == 0:
            return [ShardedTensor.from_rank_offsets(key, data, replica_id=replica)]
        out = []
        for s in self.segments:
            part = data.narrow(self.dim, s.local_start, s.length)
            grid = (self.dim, s.global_start // s.length, self.global_shape[self.dim] // s.length)
            offsets = (grid,) if grid[2] > 1 else ()
            out.append(ShardedTensor.from_rank_offsets(key, part, *offsets, replica_id=replica))
        return out

    def flat_tensors(self, key: str, flat: torch.Tensor, *, start: int) -> list:
        """ShardedTensors of `flat`, elements [start, start + len(flat)) of the flattened local
        tensor (a distributed-optimizer shard), one per hyper-rectangle it covers; views of
        `flat`, off the regular grid. Data-parallel replica 0: every element lives on one rank."""
        from megatron.core.dist_checkpointing import ShardedTensor

        if flat.dim() != 1:
            raise ValueError(f"{key}: a flat range must be 1-D, got shape {tuple(flat.shape)}")
        replica = self.replica_id(0)
        out = []
        for offset, shape, first in flat_blocks(self.local_shape, start, start + flat.numel()):
            block = flat[first - start : first - start + math.prod(shape)].view(shape)
            for global_offset, part in self._global_parts(offset, block):
                out.append(
                    ShardedTensor(
                        key,
                        part,
                        part.dtype,
                        tuple(part.shape),
                        self.global_shape,
                        global_offset,
                        None,
                        replica,
                    )
                )
        return out

    def _global_parts(
        self, offset: tuple[int, ...], block: torch.Tensor
    ) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
        """(global offset, view) of the pieces of a local block, cut at segment borders."""
        if block.dim() == 0:
            yield (), block
            return
        lo, hi = offset[self.dim], offset[self.dim] + block.shape[self.dim]
        for s in self.segments:
            start, end = max(lo, s.local_start), min(hi, s.local_start + s.length)
            if start >= end:
                continue
            moved = list(offset)
            moved[self.dim] = s.global_start + start - s.local_start
            yield tuple(moved), block.narrow(self.dim, start - lo, end - start)


def flat_blocks(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Hyper-rectangles (offset, shape, first flat index) that cover flat elements [start, end)
    of a row-major tensor of `shape`, in order: at most 2 * ndim - 1 of them."""
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)

    def row(r: int, a: int, b: int) -> list:
        return [
            ((r, *o), (1, *s), r * inner + f) for o, s, f in flat_blocks(tuple(shape[1:]), a, b)
        ]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:]), r0 * inner))
    if c1:
        out += row(r1, 0, c1)
    return out


def _segments(
    chunk, local_name: str, param: torch.Tensor, tp_rank: int, tp_size: int
) -> tuple[int, tuple[Segment, ...], int]:
    """(dim, segments, global size along dim) of a parameter (module docstring)."""
    if param.dim() == 0:
        return 0, (), 0
    if not getattr(param, "tensor_model_parallel", False):
        n = param.shape[0]
        return 0, (Segment(0, n, 0),), n
    dim = param.partition_dim
    n = param.shape[dim]
    if not is_gated_fc1(chunk, local_name):
        return dim, (Segment(0, n, tp_rank * n),), n * tp_size
    half = n // 2
    gate = Segment(0, half, tp_rank * half)
    up = Segment(half, half, (tp_size + tp_rank) * half)
    return dim, (gate, up), n * tp_size


def param_layout(chunk, local_name: str, param: torch.Tensor) -> ParamLayout:
    """The `ParamLayout` of parameter `local_name` of `chunk` (a `ModelChunk` or any module
    with a `chunk` spec and optional `groups`, `global_aliases`, `tied_embedding_weight`)."""
    groups = getattr(chunk, "groups", None)
    tp_rank, tp_size = (groups.tp_rank, groups.tp_size) if groups is not None else (0, 1)
    dim, segments, size = _segments(chunk, local_name, param, tp_rank, tp_size)
    shape = list(param.shape)
    if shape:
        shape[dim] = size
    tied = getattr(chunk, "tied_embedding_weight", None)
    copy = tied() if tied is not None and chunk.chunk.index != 0 else None
    sharded_tp = bool(getattr(param, "tensor_model_parallel", False))
    return ParamLayout(
        key=global_param_name(chunk, local_name),
        local_shape=tuple(param.shape),
        global_shape=tuple(shape),
        dim=dim,
        segments=segments,
        alias=int(copy is param),
        tp_replica=0 if sharded_tp else tp_rank,
    )


def chunk_layouts(chunk) -> dict[str, ParamLayout]:
    """{local parameter name: ParamLayout} of every parameter of `chunk`."""
    return {name: param_layout(chunk, name, p) for name, p in chunk.named_parameters()}


def chunk_sharded_state_dict(
    chunk, *, prefix: str = "", data_parallel_rank: int = 0
) -> dict[str, object]:
    """{prefix + local name: ShardedTensor or [ShardedTensor, ...]} of the chunk's parameters
    (views of them: a load fills them in place), keyed globally (module docstring)."""
    out: dict[str, object] = {}
    for name, p in chunk.named_parameters():
        layout = param_layout(chunk, name, p)
        tensors = layout.tensors(layout.key, p.detach(), data_parallel=data_parallel_rank)
        out[prefix + name] = tensors[0] if len(tensors) == 1 else tensors
    return out


def chunks_sharded_state_dict(chunks, *, data_parallel_rank: int = 0) -> dict[str, dict]:
    """{"<module><chunk index>": chunk_sharded_state_dict(chunk)} of unwrapped chunks (one
    process's chunks of a model)."""
    return {
        f"{c.chunk.module}{c.chunk.index}": chunk_sharded_state_dict(
            c, data_parallel_rank=data_parallel_rank
        )
        for c in chunks
    }
