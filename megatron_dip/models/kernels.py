"""Which attention and norm kernels the chunks run, as the memory model needs to know.

Torch-free at import (the planner's configuration is resolved before any process group exists);
torch and Transformer Engine are looked at only for a CUDA run. The names are those of
`modalities.costs.Kernels`: attention "flash" (Transformer Engine's THD attention, torch's
FlashAttention varlen kernel) or "segments" (`models.attention.PackedAttention` running torch
SDPA segment by segment), and whether RMSNorm is a fused kernel (Transformer Engine's, torch's
CUDA one) or torch's composite (CPU).
"""

from __future__ import annotations

_SIXTEEN_BITS = ("bfloat16", "float16")


def resolve_kernels(
    *, cuda: bool, dtype: str, attention: str = "auto", use_te: bool | None = None
) -> tuple[str, bool]:
    """(attention kernel, fused RMSNorm) of chunks built with `ModelConfig(dtype, attention,
    use_te)` on a CUDA machine or not (`PackedAttention.resolved_kernel` decides the same way
    at run time)."""
    if not cuda:  # varlen needs CUDA (validation refuses it on the CPU)
        return "segments", False
    from megatron_dip import megatron_compat

    te = megatron_compat.resolve_use_te(use_te)
    if attention == "segments":
        kernel = "segments"
    elif attention == "varlen" or (attention == "auto" and te):
        kernel = "flash"
    else:
        from . import attention as packed

        kernel = "flash" if dtype in _SIXTEEN_BITS and packed.varlen_available() else "segments"
    return kernel, te or _torch_fused_rms_norm()


def _torch_fused_rms_norm() -> bool:
    """Whether torch's RMSNorm runs a fused CUDA kernel (torch >= 2.8 has one)."""
    import torch

    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA"))
    except (AttributeError, RuntimeError):
        return False
