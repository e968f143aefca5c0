"""The run's parallel shape and its process groups.

`shape.ParallelShape`: the frozen sizes of a run (TP, SP, CP, PP, DP, VP, dtype, sequence
length) and what follows from them, computed once; `grid`: which global ranks form each group
(Megatron-LM's default rank order), torch-free; `groups`: the process groups themselves, the one
place of the package that creates any. `shape` and `grid` import nothing of ours, so every layer
(planner, batching, schedule users, runtime, models, training) can take a `ParallelShape`.
"""

from __future__ import annotations

from .shape import ONE_PROCESS, ParallelShape, ShapeError, sequence_parallel_in_effect

__all__ = ["ONE_PROCESS", "ParallelShape", "ShapeError", "sequence_parallel_in_effect"]
