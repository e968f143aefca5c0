"""The runtime: executes plans on Megatron-Core model chunks (never plans anything itself).

* `RankRuntime` (rank.py) is one rank's runtime for a run: each iteration it builds the
  transport, the batch source and the `Executor`, runs the plan and finishes the gradients;
* `Executor` (executor.py) runs one pipeline rank's program of a `Plan`;
* `Transport` (transport.py) is what the executor sends and receives through; `PipelineP2P`
  (p2p.py) implements it over an explicit torch.distributed pipeline process group;
* `SpanRecorder` (timing.py) records the compute instructions' spans through the timing hook;
* `dip_forward_backward` (forward_backward.py) has Megatron-Core's schedule signature, and
  `install` / `uninstall` switch Megatron's `get_forward_backward_func` to it and back;
* `StockPipeline` (stock.py) runs Megatron-Core's own schedules on the same chunks;
* `wrap_chunks_ddp` (ddp.py) wraps chunks in Megatron-Core's DDP with explicit groups.

Attributes load on first access, so `import megatron_dip.runtime` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Executor": "executor",
    "ExecutorConfig": "executor",
    "IterationResult": "executor",
    "run_program": "executor",
    "RankRuntime": "rank",
    "Transport": "transport",
    "TransportFactory": "transport",
    "SpanRecorder": "timing",
    "ChannelGroups": "p2p",
    "P2PConfig": "p2p",
    "PipelineP2P": "p2p",
    "MessageError": "errors",
    "PipelineCommError": "errors",
    "PipelineTimeoutError": "errors",
    "PlanRejectedError": "errors",
    "LossConfig": "loss",
    "BatchSource": "data",
    "SampleBatchSource": "data",
    "StockPipeline": "stock",
    "DipSchedule": "forward_backward",
    "dip_forward_backward": "forward_backward",
    "install": "forward_backward",
    "uninstall": "forward_backward",
    "installed": "forward_backward",
    "wrap_chunks_ddp": "ddp",
    "DataParallelGroups": "ddp",
}

__all__ = [
    "Executor",
    "ExecutorConfig",
    "IterationResult",
    "run_program",
    "RankRuntime",
    "Transport",
    "TransportFactory",
    "SpanRecorder",
    "ChannelGroups",
    "P2PConfig",
    "PipelineP2P",
    "MessageError",
    "PipelineCommError",
    "PipelineTimeoutError",
    "PlanRejectedError",
    "LossConfig",
    "BatchSource",
    "SampleBatchSource",
    "StockPipeline",
    "DipSchedule",
    "dip_forward_backward",
    "install",
    "uninstall",
    "installed",
    "wrap_chunks_ddp",
    "DataParallelGroups",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
