"""Emulated compute: real plans, messages and autograd on chunks that sleep the cost model's time.

Used by `--dip-emulate-compute` and `tools/bench_schedules.py` to compare DIP with Megatron-Core's
stock schedules on an emulated cluster of CPU processes (see `timing.py`, `chunk.py`).
"""

from .chunk import EmulatedChunk, build_emulated_chunks, emulated_config
from .timing import (
    EmulatedBatchSource,
    EmulationConfig,
    emulated_plan,
    emulated_tensor_fn,
    message_bytes,
    message_spec,
)

__all__ = [
    "EmulatedBatchSource",
    "EmulatedChunk",
    "EmulationConfig",
    "build_emulated_chunks",
    "emulated_config",
    "emulated_plan",
    "emulated_tensor_fn",
    "message_bytes",
    "message_spec",
]
