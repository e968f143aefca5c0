"""Activation offload of one chunk forward: the saved tensors of some layers go to host memory.

The plan's `MemoryPolicy.offload` K names the chunk's layers [start, start + K) (after block
recomputation's checkpointed layers). While one of them runs its forward, autograd's
`saved_tensors_hooks` hand every tensor it saves to an `ActivationOffload`:

* pack: the tensor is copied into a host buffer (pinned where CUDA exists) on a side copy
  stream that first waits for the compute stream, an event marks the end of the copy, and the
  device tensor is released once the copy stream is done with it (`record_stream`), so the
  allocator can reuse the memory while compute goes on. Reloads run on a second side stream
  (the PCIe link is full duplex: a reload need not queue behind later copies out; the schedule
  engine times one copy channel per direction);
* `prefetch()` (the executor calls it as the chunk's backward starts): the tensors of the last
  offloaded layer (the first the backward needs) are copied back on the reload stream, once
  their copy out is done, with an event per tensor;
* each layer after the offloaded ones (`PacingLayer`) starts the next offloaded layer's reload
  once the backward is through it (its input's gradient is computed, its saved tensors freed),
  so the reloads run on the reload stream while the backward frees about as many layers' bytes
  as they bring back;
* unpack: the compute stream waits for that tensor's reload event (reloading it now if no
  prefetch ran); the first unpack of a layer's tensors starts the reload of the layer before
  it, if not yet started (past what the layers after the offloaded ones pace), so the reloaded
  bytes stay within about one layer of what the backward has freed (what the memory model
  assumes: offloaded bytes leave the device from the forward, or from the end of their copy
  out, to the chunk's backward, whose compute the reloads overlap; the cost model prices those
  reloads, `offload_copies.reload_waits`, and the schedule engine the copy channels).

Parameters and leaves that require grad are not packed (they stay on the device for the whole
step: the weights, the received messages the runtime keeps for sending their gradients).
On CPU the same path runs with plain copies and no streams, so the values autograd sees are
copies of the saved tensors: the exactness tests on CPU cover the packing and reloading.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Slot:
    """One offloaded tensor: its host copy, the copy-out event, and the reloaded device tensor."""

    host: torch.Tensor
    device: torch.device
    layer: int  # which offloaded layer (in forward order) saved it
    copied: Any = None  # torch.cuda.Event of the copy out (None on CPU)
    reloaded: torch.Tensor | None = None
    ready: Any = None  # torch.cuda.Event of the reload (None on CPU)


@dataclass
class ActivationOffload:
    """The offloaded saved tensors of one chunk forward (module docstring)."""

    stream: Any = None  # the side stream of the copies out (CUDA), None on CPU
    reload_stream: Any = None  # the side stream of the reloads (CUDA), None on CPU
    slots: list[_Slot] = field(default_factory=list)
    offloaded_bytes: int = 0
    layers: int = 0  # offloaded layers that ran their forward so far
    _reloading: set = field(default_factory=set)  # layers whose reload was started

    @classmethod
    def for_device(cls, device: torch.device) -> ActivationOffload:
        """An empty record whose copies run on `copy_stream(device, ...)`."""
        return cls(stream=copy_stream(device), reload_stream=copy_stream(device, reload=True))

    def pack(self, t: torch.Tensor) -> Any:
        """Autograd's pack hook: `t` itself when it stays on the device, else its slot index."""
        if not isinstance(t, torch.Tensor) or (t.is_leaf and t.requires_grad):
            return t
        if self.stream is None:
            host = torch.empty_like(t, device="cpu")
            host.copy_(t)
            slot = _Slot(host, t.device, self.layers - 1)
        else:
            slot = self._copy_out(t)
        self.slots.append(slot)
        self.offloaded_bytes += t.untyped_storage().nbytes() if t.numel() else 0
        return len(self.slots) - 1

    def _copy_out(self, t: torch.Tensor) -> _Slot:
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        t.record_stream(self.stream)  # the allocator reuses `t` only after the copy
        return _Slot(host, t.device, self.layers - 1, copied=event)

    def begin_layer(self) -> None:
        """The next tensors packed belong to the next offloaded layer."""
        self.layers += 1

    def prefetch(self, layer: int | None = None) -> None:
        """Start copying back the tensors of offloaded `layer` (default: the last one, the
        first the backward needs; asynchronously on CUDA). Once per layer."""
        layer = self.layers - 1 if layer is None else layer
        if layer < 0 or layer in self._reloading:
            return
        self._reloading.add(layer)
        for slot in self.slots:
            if slot.layer == layer:
                self._reload(slot)

    def prefetch_next(self, *_: Any) -> None:
        """Start the reload of the last offloaded layer not reloading yet (the one the backward
        needs next); a tensor hook (`PacingLayer`), so it takes and ignores a gradient."""
        pending = [layer for layer in range(self.layers) if layer not in self._reloading]
        if pending:
            self.prefetch(pending[-1])

    def _reload(self, slot: _Slot) -> None:
        if slot.reloaded is not None:
            return
        if self.stream is None:
            slot.reloaded = slot.host.to(slot.device, copy=True)
            return
        stream = self.reload_stream or self.stream
        with torch.cuda.stream(stream):
            stream.wait_event(slot.copied)
            slot.reloaded = slot.host.to(slot.device, non_blocking=True)
            slot.ready = torch.cuda.Event()
            slot.ready.record(stream)

    def unpack(self, packed: Any) -> torch.Tensor:
        """Autograd's unpack hook: the tensor back on its device."""
        if isinstance(packed, torch.Tensor):
            return packed
        slot = self.slots[packed]
        self.prefetch(slot.layer)
        self.prefetch(slot.layer - 1)  # the layer the backward needs next
        self._reload(slot)
        tensor = slot.reloaded
        if slot.ready is not None:
            torch.cuda.current_stream(slot.device).wait_event(slot.ready)
            tensor.record_stream(torch.cuda.current_stream(slot.device))
        return tensor

    def hooks(self) -> contextlib.AbstractContextManager:
        """The `saved_tensors_hooks` context that offloads what autograd saves inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


_STREAMS: dict[tuple[torch.device, bool], Any] = {}


def copy_stream(device: torch.device, *, reload: bool = False) -> Any:
    """The side stream offload copies out (or, with `reload`, the reloads) run on (one each per
    CUDA device); None off CUDA."""
    if device.type != "cuda":
        return None
    key = (device, reload)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]


class _RecordedLayer(torch.nn.Module):
    """A chunk's layer wrapped for an `ActivationOffload` (the same parameters; what the
    chunk's loop reads of a layer passed through)."""

    def __init__(self, layer: torch.nn.Module, record: ActivationOffload) -> None:
        super().__init__()
        self.member = layer
        self._record = record

    @property
    def config(self) -> Any:
        """The layer's Megatron config (what the chunk's loop may read of a layer)."""
        return self.member.config

    @property
    def layer_number(self) -> int:
        """The layer's global 1-based number (the chunk's loop asks it for per-layer options)."""
        return self.member.layer_number


class OffloadedLayer(_RecordedLayer):
    """One layer whose forward runs under an `ActivationOffload`'s hooks (a layer returning a
    tuple passes it on unchanged)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._record.begin_layer()
        with self._record.hooks():
            return self.member(*args, **kwargs)


class PacingLayer(_RecordedLayer):
    """A layer after a chunk's offloaded ones: once the backward is through it (the gradient
    of its input, the first positional argument or `hidden_states`, is computed), the next
    offloaded layer's reload starts (`ActivationOffload.prefetch_next`)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._record.prefetch_next)
        return self.member(*args, **kwargs)


@contextlib.contextmanager
def offloaded_layers(
    chunk: torch.nn.Module, start: int, count: int, record: ActivationOffload
) -> Iterator[None]:
    """`chunk.layers[start:start + count]` offloaded into `record` while inside, the layers
    after them pacing its reloads (`PacingLayer`; the layer list may already hold block
    recomputation's checkpointed groups, one per layer)."""
    original = chunk.layers
    layers = list(original)
    if start + count > len(layers):
        raise ValueError(
            f"offload of layers [{start}, {start + count}) in a chunk of {len(layers)} layers"
        )
    for i in range(start, start + count):
        layers[i] = OffloadedLayer(layers[i], record)
    for i in range(start + count, len(layers)):
        layers[i] = PacingLayer(layers[i], record)
    chunk.layers = torch.nn.ModuleList(layers)
    try:
        yield
    finally:
        chunk.layers = original
