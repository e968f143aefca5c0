"""Where an offloaded stage's reload starts: as the rank starts the compute instruction before
its backward.

The runtime reloads a chunk's offloaded activations (`MemoryPolicy.offload`) on its copy
stream while the rank computes; the backward waits only for what has not come back yet. Started
as the backward starts, the reload can only overlap the backwards of the layers after the
offloaded ones; started one compute instruction earlier, it overlaps that instruction too, and
the reloaded bytes are on the device from then on. One rule, read off the program alone, for
the runtime that starts the reloads, the engine that times them and the memory models that hold
their bytes: the reload of a backward (fused or the input half of a split one) starts at the
compute instruction before it, unless that is the same stage's forward (nothing is offloaded
before the forward ends: the backward's own start then). A backward starts its own reload
(where none started earlier) before the next one's, which its own need comes first.
"""

from __future__ import annotations

from collections.abc import Sequence

from .ir import Backward, BackwardWeight, Forward, Instruction


def reload_points(instructions: Sequence[Instruction]) -> dict[int, int]:
    """{index of a compute instruction: index of the backward whose reload starts with it}
    (compute instructions: forwards, backwards and their halves)."""
    points: dict[int, int] = {}
    previous = -1
    for i, ins in enumerate(instructions):
        if not isinstance(ins, (Forward, Backward, BackwardWeight)):
            continue
        if isinstance(ins, Backward) and previous >= 0:
            before = instructions[previous]
            if not (isinstance(before, Forward) and before.stage == ins.stage):
                points[previous] = i
        previous = i
    return points
