"""Choosing sub-microbatch sizes: the smallest size that keeps the device efficient.

The split itself (sub-microbatches and their dependencies, from metadata) is
`batching.split`, shared with the runtime and the reference models.
"""

from __future__ import annotations


def choose_sub_size(
    cost_model,
    module: str,
    *,
    tokens_per_instance: int,
    max_size: int = 64,
    threshold: float = 0.95,
) -> int:
    """Smallest sub-microbatch size whose efficiency keeps `threshold` of the peak efficiency."""
    curve = [
        cost_model.efficiency(module, instances=b, tokens_per_instance=tokens_per_instance)
        for b in range(1, max_size + 1)
    ]
    peak = max(curve)
    return next(b for b, e in enumerate(curve, start=1) if e >= threshold * peak)


def split_modules(model) -> list:
    """The modules split into sub-microbatches of a chosen size (all but those whose modality
    runs the whole microbatch at once, the LLM)."""
    from ..modalities import modality_of

    return [m for m in model.modules if not modality_of(m).whole_microbatch]
