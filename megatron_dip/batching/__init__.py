"""From batch metadata to the work of every replica, and what crosses chunk boundaries.

Torch-free, below the planner, the runtime and the reference models, which all need it:
`split` (sub-microbatches and their dependencies), `layout` (`layout_batch`: batch -> replicas
-> microbatches -> sub-microbatches -> totals, and the one `packing_limits`), `messages` (the
message shapes), `arrays` (the same for samples with arrays).
"""

from .arrays import loss_tokens_of, split_samples
from .layout import (
    BatchLayout,
    LayoutConfig,
    ReplicaLayout,
    layout_batch,
    pack,
    packing_limits,
    resplit,
    split_microbatches,
)
from .messages import MessageShapes, message_nbytes, message_tensors
from .split import (
    WHOLE,
    MicrobatchWork,
    cross_module_dependencies,
    round_up,
    split_microbatch,
    split_sizes,
)

__all__ = [
    "WHOLE",
    "BatchLayout",
    "LayoutConfig",
    "MessageShapes",
    "MicrobatchWork",
    "ReplicaLayout",
    "cross_module_dependencies",
    "layout_batch",
    "loss_tokens_of",
    "message_nbytes",
    "message_tensors",
    "pack",
    "packing_limits",
    "resplit",
    "round_up",
    "split_microbatch",
    "split_microbatches",
    "split_samples",
    "split_sizes",
]
