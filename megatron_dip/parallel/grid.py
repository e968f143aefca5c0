"""Which global ranks form each process group of a run (torch-free, no group is created).

Megatron-LM's default rank order, "tp-cp-ep-dp-pp" (`initialize_model_parallel(order=...)`, the
dimension order of Megatron-Core's `HyperCommGrid`): the rank is a mixed-radix number whose
fastest digit is the tensor-parallel rank, then the context-, data- and pipeline-parallel ranks,

    global rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank)),

so tensor-parallel peers are neighbours (one node) and pipeline stages are furthest apart. A group
over some dimensions holds the ranks that differ only in those dimensions; groups are listed by
the index of the other dimensions, and each group's ranks in increasing order (as Megatron's
`RankGenerator` lists them; tests/test_parallel.py compares).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .shape import ParallelShape

ORDER = ("tp", "cp", "dp", "pp")  # fastest digit first


class Coordinates(NamedTuple):
    """A rank's index along every dimension of the grid."""

    tp: int
    cp: int
    dp: int
    pp: int


def _sizes(shape: ParallelShape) -> tuple[int, ...]:
    return tuple(getattr(shape, d) for d in ORDER)


def coordinates(rank: int, shape: ParallelShape) -> Coordinates:
    """The coordinates of global rank `rank` (0 <= rank < shape.world_size)."""
    if not 0 <= rank < shape.world_size:
        raise ValueError(f"rank {rank} is outside a world of {shape.world_size}")
    digits = []
    for size in _sizes(shape):
        digits.append(rank % size)
        rank //= size
    return Coordinates(*digits)


def global_rank(shape: ParallelShape, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
    """The global rank at the given coordinates."""
    rank = 0
    for index, size in reversed(list(zip((tp, cp, dp, pp), _sizes(shape), strict=True))):
        if not 0 <= index < size:
            raise ValueError(f"coordinate {index} is outside a dimension of size {size}")
        rank = rank * size + index
    return rank


def _dims(dims: str | Iterable[str]) -> tuple[str, ...]:
    names = tuple(dims.split("-")) if isinstance(dims, str) else tuple(dims)
    unknown = set(names) - set(ORDER)
    if unknown or not names:
        raise ValueError(f"unknown grid dimensions {sorted(unknown)} (of {ORDER})")
    return names


def _product(shape: ParallelShape, names: Sequence[str]) -> list[dict[str, int]]:
    """Every combination of indices along `names`, the first name fastest."""
    ranges = [range(getattr(shape, n)) for n in reversed(names)]
    return [dict(zip(reversed(names), idx, strict=True)) for idx in itertools.product(*ranges)]


def group_ranks(shape: ParallelShape, dims: str | Iterable[str]) -> list[list[int]]:
    """The rank lists of every group spanning `dims` ("tp", "dp", "tp-pp", ...)."""
    inside = _dims(dims)
    outside = [d for d in ORDER if d not in inside]
    inner = [d for d in ORDER if d in inside]
    return [
        sorted(global_rank(shape, **fixed, **varying) for varying in _product(shape, inner))
        for fixed in _product(shape, outside)
    ]


def stage_ranks(shape: ParallelShape, stages: Sequence[int]) -> list[list[int]]:
    """For every pipeline (one per TP, CP, DP index), the global ranks of its pipeline ranks
    `stages` (e.g. the stages holding the copies of a tied embedding: Megatron's embedding
    group), in the order of the pipeline groups."""
    return [[pipeline[p] for p in stages] for pipeline in group_ranks(shape, "pp")]


def channel_pairs(pipelines: Sequence[Sequence[int]]) -> list[tuple[int, int, int, list[int]]]:
    """(pipeline index, sender, receiver, sorted global ranks) of every ordered pair of distinct
    pipeline ranks of every pipeline: one two-rank channel per direction."""
    return [
        (i, a, b, sorted((ranks[a], ranks[b])))
        for i, ranks in enumerate(pipelines)
        for a in range(len(ranks))
        for b in range(len(ranks))
        if a != b
    ]


def single_ranks(shape: ParallelShape) -> list[list[int]]:
    """One group per rank, holding only it (stands in for the groups of absent dimensions)."""
    return [[r] for r in range(shape.world_size)]
