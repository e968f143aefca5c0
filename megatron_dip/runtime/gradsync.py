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
"""

from __future__ import annotations

from collections import defaultdict

from megatron_dip.schedule.ir import Backward, Placement, Program

ChunkKey = tuple[str, int]


def canonical_reduction_order(placement: Placement, chunks: set[ChunkKey]) -> list[ChunkKey]:
    """The order in which the reductions of `chunks` are issued (see the module docstring)."""
    order = [(m.name, c.index) for m in reversed(placement.modules) for c in reversed(m.chunks)]
    return [k for k in order if k in chunks]


def grad_sync_points(
    program: Program, placement: Placement, chunks: set[ChunkKey]
) -> dict[int, list[ChunkKey]]:
    """{instruction index: chunks whose reduction starts right after it}; index -1 = before
    the first instruction."""
    last: dict[ChunkKey, int] = {}
    for i, ins in enumerate(program.instructions):
        if isinstance(ins, Backward):
            last[(ins.stage.module, ins.stage.chunk)] = i
    points: dict[int, list[ChunkKey]] = defaultdict(list)
    at = -1
    for key in canonical_reduction_order(placement, chunks):
        at = max(at, last.get(key, -1))
        points[at].append(key)
    return dict(points)
