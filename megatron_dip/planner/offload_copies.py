"""How the copies of an offloaded chunk are timed against its compute, as the runtime makes them.

Activation offload (`MemoryPolicy.offload`, priced by `CostModel.stage_cost` through
`offload_copies`): the saved tensors of K layers go to host memory on a copy stream during the
chunk's forward and come back during its backward, before the backward reaches them. The copy
gets the GPU's share of its host link (`DeviceSpec.host_link_share`: the GPUs under one PCIe
switch copy at once) and competes there with the chunk's own pipeline messages, which cross the
same PCIe link to the NIC. As the runtime does it (`runtime/offload.py`): the copy out never
blocks the compute stream, so it delays nothing, but the bytes it has not copied when the forward
ends are still on the device (counted in `activation_bytes`); the reload blocks. The runtime
prefetches the last offloaded layer as the backward starts and one more each time the backward
has freed a layer after the offloaded ones (so the reloaded bytes stay within about one layer of
what the backward freed), or, past those, as the backward reaches the layer after it
(`reload_waits`): the first reload must hide behind the backwards of the layers after the
offloaded ones, the later ones queue behind it on the reload stream. The copies occupy the
rank's copy streams in order, one per direction (`StageCost.copy_out` / `reload`): the schedule
engine times those channels, and the wait for the first reload there (`reload_stall` here is the
chunk-local estimate the planner's own passes use), and the simulator holds what a queued copy
out has not moved yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadCopies:
    """The copies of one chunk's offload (`offload_copies`): the `StageCost` fields of the same
    names (`CostModel` copies them there), the waits for later layers' reloads (`later_stall`,
    part of the backward), the bytes the copy out leaves on the device at the forward's end
    (`residual`, part of `activation_bytes`) and one offloaded layer's bytes."""

    copy_out: float
    copy_lead: float
    reload: float
    reload_window: float
    reload_stall: float
    later_stall: float
    residual: float
    layer_bytes: float
    moved: float = 0.0


NO_COPIES = OffloadCopies(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def offload_copies(
    *,
    layers: int,
    start: int,
    offloaded: int,
    moved: float,
    message: float,
    link: float,
    fwd_layer: float,
    bwd_layer: float,
    paced: bool = True,
) -> OffloadCopies:
    """The copies of a chunk of `layers` layers that offloads `offloaded` of them from layer
    `start` on (`moved` bytes in all) over a host link of `link` bytes per second, beside its
    pipeline message (`message`: its link seconds with the latency), each layer's forward
    `fwd_layer` and backward `bwd_layer` seconds (module docstring). Each direction's link time
    holds the offloaded bytes and the message. The copy out starts after the first offloaded
    layer's forward and delays nothing; what it has not copied by the forward's end (a linear
    drain) stays on the device. The reloads, one layer each (the first with the message), as
    `reload_waits` times them (`paced=False`: chained one layer ahead)."""
    copy_out = moved / link + message
    out_window = max(0, layers - start - 1) * fwd_layer
    residual = moved * max(0.0, 1.0 - out_window / copy_out) if copy_out > 0 else 0.0
    layer = moved / max(1, offloaded) / link
    after = max(0, layers - start - offloaded)
    # offloaded 0: the message alone
    waits = reload_waits(max(1, offloaded), after, layer, message, bwd_layer, paced=paced)
    return OffloadCopies(
        copy_out=copy_out,
        copy_lead=(start + 1) * fwd_layer,
        reload=layer + message,
        reload_window=after * bwd_layer,
        reload_stall=waits[0],
        later_stall=sum(waits[1:]),
        residual=residual,
        layer_bytes=moved / max(1, offloaded),
        moved=moved,
    )


def reload_waits(
    k: int, after: int, layer: float, message: float, bwd_l: float, *, paced: bool = True
) -> list[float]:
    """Seconds the backward of a chunk waits for each of its `k` offloaded layers' reloads
    (the last offloaded layer first), `after` layers after them, each reload `layer` link
    seconds (the first also the `message`'s), each layer's backward `bwd_l`; time 0 is the
    backward's start. As `runtime/offload.py` issues them on its one reload stream: the i-th
    as the backward has freed i of the layers after the offloaded ones (i <= `after`) or as
    the backward starts the offloaded layer after it, whichever comes first (`paced=False`:
    only the latter, issue 24g's runtime); each queues behind the one before it."""
    waits: list[float] = []
    ready = reached = 0.0  # the last reload's end; when the backward started its layer
    clock = after * bwd_l  # when the backward reaches the next offloaded layer, before waiting
    for i in range(k):
        issue = 0.0 if i == 0 else reached
        if paced and 0 < i <= after:
            issue = min(issue, i * bwd_l)
        ready = max(issue, ready) + layer + (message if i == 0 else 0.0)
        waits.append(max(0.0, ready - clock))
        reached = clock + waits[-1]
        clock = reached + bwd_l
    return waits


__all__ = ["NO_COPIES", "OffloadCopies", "offload_copies", "reload_waits"]
