"""How well activation offload's copies overlap compute, measured with CUDA events.

`transfer_overlap` times, on the current device, a chain of matrix products alone, the copy
out and back of `megabytes` of saved activations through `runtime.offload.ActivationOffload`
alone (pinned host buffers, side stream), and both issued together the way the executor does
(packing while the products run, prefetching after them). It reports the host-link bandwidth
achieved in each direction (to set against `DeviceSpec.host_link_share`) and the overlap: the
share of the shorter of the two that disappeared when they ran together (1.0: fully hidden).
On a CPU the same code runs with plain copies and host timers (no overlap to expect).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megatron_dip.runtime.offload import ActivationOffload, copy_stream


def _timed(device: torch.device, run: Callable[[], object]) -> float:
    """Seconds `run` takes on `device` (CUDA events on the current stream, host time else),
    the copies it left on offload's side streams included (the end waits for them: a copy out
    alone is never waited for by the current stream)."""
    if device.type != "cuda":
        started = time.perf_counter()
        run()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    run()
    current = torch.cuda.current_stream(device)
    for reload in (False, True):
        current.wait_stream(copy_stream(device, reload=reload))
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def transfer_overlap(
    device: torch.device, *, megabytes: int = 256, matmuls: int = 20, size: int = 4096
) -> dict:
    """The measurements of the module docstring, as a dict of numbers."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    saved = torch.randn(megabytes * 2**20 // 2, dtype=torch.bfloat16, device=device)
    a = torch.randn(size, size, dtype=dtype, device=device)

    def compute() -> None:
        x = a
        for _ in range(matmuls):
            x = torch.tanh(x @ a)

    def copies(record: ActivationOffload, then: Callable[[], None] | None = None) -> None:
        handle = record.pack(saved)
        if then is not None:
            then()
        record.prefetch()
        got = record.unpack(handle)
        if not torch.equal(got, saved):
            raise RuntimeError("offload round trip changed the tensor")

    compute()  # warm-up: kernels, allocator, the pinned pool
    copies(ActivationOffload.for_device(device))
    alone = _timed(device, compute)
    copy_out = _timed(device, lambda: ActivationOffload.for_device(device).pack(saved))
    both_ways = _timed(device, lambda: copies(ActivationOffload.for_device(device)))
    together = _timed(device, lambda: copies(ActivationOffload.for_device(device), compute))
    hidden = alone + both_ways - together
    nbytes = saved.numel() * saved.element_size()
    return {
        "device": str(device),
        "offloaded_mb": megabytes,
        "compute_s": alone,
        "copy_out_s": copy_out,
        "round_trip_s": both_ways,
        "together_s": together,
        "d2h_gb_per_s": nbytes / copy_out / 1e9,
        "round_trip_gb_per_s": 2 * nbytes / both_ways / 1e9,
        "overlap": max(0.0, hidden) / min(alone, both_ways),
    }
