"""Rotary frequency variants of real checkpoints: Llama 3.1's "llama3" scaling and Qwen2-VL's
multimodal rotary (M-RoPE) positions.

`rotary_table` builds the angle table from positions; these functions change its
frequencies (`llama3_scaled`) or choose, per frequency slot, which position axis it rotates with
(`mrope_table`), so that a chunk's attention equals the Hugging Face model's.
"""

from __future__ import annotations

import math

import torch

from megatron_dip.modelspec import RopeScaling


def llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies after Llama 3.1's scaling (Meta's `apply_scaling`, Hugging Face's
    `_compute_llama3_parameters`): long wavelengths slowed by `factor`, short ones unchanged,
    the band between interpolated by position in wavelength."""
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


def mrope_table(
    positions: torch.Tensor, *, head_dim: int, base: float, sections: tuple[int, ...], dtype
) -> torch.Tensor:
    """Rotary angles [S, 1, 1, head_dim] of Qwen2-VL's M-RoPE for positions [S, 3] (temporal,
    height, width): frequency slot j of head_dim / 2 has the 1-D frequency base^(-2j/head_dim)
    and rotates with axis a, where slots [0, s0) take the temporal axis, the next s1 the height
    and the last s2 the width (`sections`). Text tokens carry equal positions on all axes, so
    there M-RoPE equals the 1-D rotary embedding."""
    slots = head_dim // 2
    if positions.shape[1] == 1:  # text only: the same position on every axis
        positions = positions.expand(-1, len(sections))
    if sum(sections) != slots:
        raise ValueError(f"mrope sections {sections} must sum to head_dim / 2 = {slots}")
    j = torch.arange(slots, device=positions.device)
    inv_freq = base ** (-j.to(torch.float64) / slots)
    axis = torch.repeat_interleave(
        torch.arange(len(sections), device=positions.device),
        torch.tensor(sections, device=positions.device),
    )
    angles = positions[:, axis].to(torch.float64) * inv_freq[None, :]
    table = torch.cat([angles, angles], dim=-1)
    return table[:, None, None, :].to(dtype)


def rotary_table(
    positions: torch.Tensor,
    *,
    head_dim: int,
    base: float,
    dtype: torch.dtype,
    scaling: RopeScaling | None = None,
    layout: str = "interleaved",
) -> torch.Tensor:
    """Rotary angles [S, 1, 1, head_dim] for positions [S, A] over A axes.

    Frequency slot j (of head_dim / 2) rotates with axis j mod A at frequency
    base^(-(j div A) / slots_per_axis): A = 1 is the usual 1-D rotary embedding, A = 2 and 3 give
    the 2-D (ViT) and 3-D (DiT) variants. The layout [freqs, freqs] is what Megatron's
    non-interleaved `apply_rotary_pos_emb` expects. `scaling` (1-D only): Llama 3.1's frequency
    scaling (`llama3_scaled`). `layout` "blocked": slot j rotates with axis j div
    slots_per_axis at frequency base^(-(j mod slots_per_axis) / slots_per_axis) instead (the
    same frequencies, grouped by axis: Qwen2-VL's vision tower).
    """
    slots = head_dim // 2
    axes = positions.shape[1]
    j = torch.arange(slots, device=positions.device)
    per_axis = -(-slots // axes)
    axis, index = (j // per_axis, j % per_axis) if layout == "blocked" else (j % axes, j // axes)
    inv_freq = base ** (-index.to(torch.float64) / per_axis)
    if scaling is not None:
        if axes != 1:
            raise ValueError("rope scaling applies to 1-D rotary positions only")
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = positions[:, axis].to(torch.float64) * inv_freq[None, :]
    table = torch.cat([angles, angles], dim=-1)
    return table[:, None, None, :].to(dtype)


def rotary_of(arch, positions: torch.Tensor, *, head_dim: int, base: float, dtype):
    """The rotary table of a module with `modelspec.Architecture` `arch` for its positions:
    M-RoPE where it has sections, else `rotary_table` with its scaling and layout."""
    if arch.mrope_sections is not None:
        return mrope_table(
            positions, head_dim=head_dim, base=base, sections=arch.mrope_sections, dtype=dtype
        )
    return rotary_table(
        positions,
        head_dim=head_dim,
        base=base,
        dtype=dtype,
        scaling=arch.rope_scaling,
        layout=arch.rotary_layout,
    )
