"""megatron-dip: DIP, a dynamic, modality-aware interleaved pipeline schedule for Megatron-Core.

Importing this package is cheap: megatron-core and torch are imported only by the parts that need
them (runtime, models, training).
"""

__version__ = "0.1.0"
