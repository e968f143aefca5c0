"""Emulated compute: real plans, messages and autograd on chunks that sleep the cost model's time.

Plugged into the runtime as implementations of its parts: chunks (`chunk.py`), the batch source
(`timing.EmulatedBatchSource`) and the transport (`transport.EmulatedTransport`); the training's
`--dip-emulate-compute` selects them (`training.assembly.backend.EmulatedCompute`), and the benchmark
(`megatron_dip.benchmark`, `tools/bench_schedules.py`) compares DIP with Megatron-Core's stock
schedules on such an emulated cluster of CPU processes. Nothing here imports the training.
"""

from .chunk import EmulatedChunk, build_emulated_chunks, emulated_config
from .timing import (
    EmulatedBatchSource,
    EmulationConfig,
    emulated_plan,
    emulated_tensor_fn,
    message_bytes,
    message_spec,
    stand_in,
)
from .transport import EmulatedTransport, emulated_p2p

__all__ = [
    "EmulatedBatchSource",
    "EmulatedChunk",
    "EmulatedTransport",
    "EmulationConfig",
    "build_emulated_chunks",
    "emulated_config",
    "emulated_p2p",
    "emulated_plan",
    "emulated_tensor_fn",
    "message_bytes",
    "message_spec",
    "stand_in",
]
