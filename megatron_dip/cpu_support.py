"""The one place that makes Megatron-Core run without a GPU (docs/design.md, "Megatron-Core on a CPU").

Megatron-Core assumes CUDA in a handful of places: receive buffers and scratch buffers on
`torch.cuda.current_device()`, `torch.cuda.synchronize()` after batched p2p, CUDA streams in the
DDP wrapper, `device="cuda"` tensors in the stock schedules and a CUDA RNG tracker. On a machine
without CUDA, `apply_cpu_fixes()` redirects exactly those to the CPU; with CUDA it does nothing.
Nothing else in megatron-dip special-cases the CPU: code allocates on
`torch.cuda.current_device()`, which these fixes make mean "cpu".

Both functions are idempotent and cheap to call again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_STATE: dict[str, Any] = {"applied": False, "mode": None}


def cuda_available() -> bool:
    """True when this process can use CUDA (then no CPU fix is applied)."""
    return torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    # An int device means a CUDA ordinal in Megatron's code (`device=torch.cuda.current_device()`).
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _tensor_type(func, args: tuple, kwargs: dict) -> Any:
    """`Tensor.type()` naming a CPU tensor as its CUDA type ("torch.cuda.FloatTensor");
    `Tensor.type("torch.cuda.X")` converting to "torch.X" (the CPU type)."""
    if len(args) == 1 and not kwargs:
        name = func(*args)
        if name.startswith("torch.") and not name.startswith(("torch.cuda.", "torch.sparse.")):
            return "torch.cuda." + name[len("torch.") :]
        return name
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    if isinstance(target, str) and target.startswith("torch.cuda."):
        target = "torch." + target[len("torch.cuda.") :]
        if len(args) > 1:
            args = (args[0], target, *args[2:])
        else:
            kwargs["dtype"] = target
    return func(*args, **kwargs)


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA devices to the CPU in every torch call; `Tensor.cuda()` returns the tensor.

    Needed because the stock schedules create `torch.zeros([], device="cuda")` directly, and
    Megatron's optimizers accept only parameters whose `Tensor.type()` is a CUDA type
    ("torch.cuda.FloatTensor"): a CPU tensor reports its CUDA type name here.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _DummyStream:
    """Stands in for `torch.cuda.Stream`: on the CPU every operation is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _DummyEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _DummyEvent:
    """Stands in for `torch.cuda.Event`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _current_device() -> str:
    return "cpu"


def _no_op(*args: Any, **kwargs: Any) -> None:
    del args, kwargs


def _dummy_stream(*args: Any, **kwargs: Any) -> _DummyStream:
    del args, kwargs
    return _DummyStream()


def _stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    del stream
    return contextlib.nullcontext()


def apply_cpu_fixes() -> bool:
    """Apply every CPU fix (module docstring) when CUDA is absent; return whether they are on.

    * a `CudaToCpuMode` torch-function mode is entered for the rest of the process (stock
      schedules allocate `device="cuda"` tensors; `Tensor.cuda()` becomes a no-op);
    * `torch.cuda.current_device()` returns "cpu" (P2PCommunicator's receive buffers, Megatron's
      global scratch buffer, parameters allocated by Megatron's linear layers);
    * `torch.cuda.synchronize()` is a no-op (called after batched p2p);
    * `torch.cuda.current_stream/default_stream/Stream/stream/Event` return dummies (DDP wrapper);
    * `Tensor.type()` names CPU tensors by their CUDA type (Megatron's optimizers, distributed
      optimizer and gradient clipping check for "torch.cuda.FloatTensor").

    Torch-function modes are per thread: call this from the thread that runs the schedule.
    With CUDA available nothing is changed and False is returned. Calling it again is harmless.
    """
    if cuda_available():
        return False
    if _STATE["applied"]:
        return True
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _no_op
    torch.cuda.current_stream = _dummy_stream
    torch.cuda.default_stream = _dummy_stream
    torch.cuda.Stream = _DummyStream
    torch.cuda.Event = _DummyEvent
    torch.cuda.stream = _stream_context
    mode = CudaToCpuMode()
    # Entered and never exited: the stock schedules run anywhere after start-up.
    mode.__enter__()
    _STATE.update(applied=True, mode=mode)
    logger.info("CUDA is not available: Megatron-Core CPU fixes applied")
    return True


@contextlib.contextmanager
def cuda_to_cpu_suspended() -> Iterator[None]:
    """Run the block without the `CudaToCpuMode` torch-function mode (when it is the innermost
    mode of this thread; else nothing changes). A mode makes every torch call, and every Python
    function torch checks for overrides (autograd, point-to-point calls), dispatch through
    Python first: DIP's executor, which never names a CUDA device, runs its instructions faster
    without it. Megatron's own schedules keep the mode (they allocate on "cuda")."""
    mode = _STATE["mode"]
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


def cpu_fixes_applied() -> bool:
    """True once `apply_cpu_fixes()` changed this process."""
    return bool(_STATE["applied"])


def seed_model_parallel_rng(
    seed: int, *, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0
) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker with explicit ranks.

    On CPU `model_parallel_cuda_manual_seed` would read CUDA RNG states; its inference tracker
    is a no-op tracker (Megatron's attention still enters the tracker, so the call is not
    skippable) and torch's CPU generator is seeded directly. With CUDA it is the normal call.
    The ranks are passed explicitly so that Megatron's `parallel_state` is never consulted.
    """
    from megatron_dip import megatron_compat  # installs import fixes before megatron.core

    random = megatron_compat.tensor_parallel_random()
    on_cpu = not cuda_available()
    if on_cpu:
        apply_cpu_fixes()
    random.model_parallel_cuda_manual_seed(
        seed,
        inference_rng_tracker=on_cpu,
        tp_rank=tp_rank,
        ep_rank=ep_rank,
        etp_rank=etp_rank,
        # A tracker made earlier without inference_rng_tracker would read CUDA RNG states.
        force_reset_rng=on_cpu,
    )
    if on_cpu:
        torch.manual_seed(seed)
