"""megatron-dip: DIP, a dynamic, modality-aware interleaved pipeline schedule for Megatron-Core.

Importing this package is cheap: megatron-core and torch are imported only by the parts that need
them (runtime, models, training). It does import `megatron_compat` (standard library only, a few
ms), so that megatron-core 0.19's triton stand-in is in place before any part of this package, or
anything imported after it, imports `megatron.core`.
"""

from megatron_dip import megatron_compat  # noqa: F401  (before megatron.core: triton stand-in)

__version__ = "0.1.0"
