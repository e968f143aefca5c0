"""When each chunk's data-parallel gradient reduction starts.

A chunk's gradients are final after *its own* last Backward in the program; its reduction can
start right then, overlapping the rest of the schedule (starting earlier is wrong, starting after
the schedule is slow). One constraint: all data-parallel replicas must issue the reductions of a
rank's chunks on the data-parallel group in the same order, because collectives on one group (one
NCCL communicator) are matched by issue order, and every replica runs its own plan, in which the
chunks' last backwards may come in different orders. So reductions are issued in a fixed
*canonical* order, identical on all replicas: consumer modules before producer modules (placement
order reversed), higher chunks before lower ones (the order in which pipelines usually finish). A
chunk's reduction starts after its own last Backward and after the reduction of the chunk before
it in that order. A chunk without any Backward in this plan (e.g. a ViT chunk of a replica whose
samples have no images) contributes zero gradients and is reduced as early as the order allows.

A plan may name the reduction points itself (`ReduceGrads` instructions, see
`schedule/backward_split.py`, which also owns the canonical order): then they are taken as
written (validation checked the order and that each follows its chunk's last weight gradient).
"""

from __future__ import annotations

from collections import defaultdict

from megatron_dip.schedule.backward_split import ChunkKey, canonical_reduction_order
from megatron_dip.schedule.ir import Backward, BackwardWeight, Placement, Program, ReduceGrads

__all__ = ["ChunkKey", "canonical_reduction_order", "grad_sync_points"]


def grad_sync_points(
    program: Program, placement: Placement, chunks: set[ChunkKey]
) -> dict[int, list[ChunkKey]]:
    """{instruction index: chunks whose reduction starts right after it}; index -1 = before
    the first instruction. A program with `ReduceGrads` instructions: each of `chunks` right
    after its instruction."""
    explicit = [
        (i, (ins.module, ins.chunk))
        for i, ins in enumerate(program.instructions)
        if isinstance(ins, ReduceGrads)
    ]
    if explicit:
        points: dict[int, list[ChunkKey]] = defaultdict(list)
        for i, key in explicit:
            if key in chunks:
                points[i].append(key)
        return dict(points)
    last: dict[ChunkKey, int] = {}
    for i, ins in enumerate(program.instructions):
        if isinstance(ins, (Backward, BackwardWeight)):  # a W always follows its B
            last[(ins.stage.module, ins.stage.chunk)] = i
    points: dict[int, list[ChunkKey]] = defaultdict(list)
    at = -1
    for key in canonical_reduction_order(placement, chunks):
        at = max(at, last.get(key, -1))
        points[at].append(key)
    return dict(points)
