"""Helpers, no tests: the dense-mask attention the packed attention is checked against.

Before packed sequences, every attention of the models ran Megatron-Core's local, unfused
`DotProductAttention` on a boolean [1, 1, Sq, Sk] mask (True = masked) built from the segment
ids: within one's segment (padding among itself), causal for the text modules, DiT clip tokens
to their own caption's rows of "cond" (padding tokens to row 0). Those masks are kept here, as
the reference only: `dense_reference()` makes every chunk built and run inside it take that
path again (the sbhd layout, Megatron's own rotary and masked softmax, no packed-sequence
parameters), so comparing a run inside it with one outside compares the packed attention with
the dense-mask implementation it replaces.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_dip.models import attention


def dense_self_mask(segments: torch.Tensor) -> torch.Tensor:
    """[1, 1, S, S], True = masked: attend only within one's segment (padding -1 to itself)."""
    return (segments[:, None] != segments[None, :])[None, None]


def dense_cross_mask(cond_index: torch.Tensor, batch) -> torch.Tensor:
    """[1, 1, S, rows]: clip tokens see their own caption's rows of "cond"; padding row 0."""
    rows = torch.repeat_interleave(cond_index, batch.caption_lengths[cond_index])
    segments = batch.segments
    caption = torch.where(
        segments >= 0, batch.clip_caption[segments.clamp(min=0)], torch.full_like(segments, -2)
    )
    mask = caption[:, None] != rows[None, :]
    mask[segments < 0, 0] = False
    return mask[None, None]


def causal_mask(n: int, device) -> torch.Tensor:
    """[n, n], True above the diagonal."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


class DenseMaskAttention(DotProductAttention):
    """Megatron's local unfused attention on the dense mask, made causal when the layer spec
    says so (its masked softmax adds the causal part only without a mask)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
        kind = attn_mask_type or self.attn_mask_type
        if kind in (AttnMaskType.causal, AttnMaskType.padding_causal):
            attention_mask = attention_mask | causal_mask(query.shape[0], query.device)
        return super().forward(query, key, value, attention_mask, **kwargs)


def _dense_backend(backend, *, kernel: str = "auto"):
    del kernel
    return dataclasses.replace(backend, core_attention=DenseMaskAttention)


def _dense_self(segments: torch.Tensor) -> dict:
    return {"attention_mask": dense_self_mask(segments), "packed_seq_params": None}


def _dense_cross(*, segments, clip_caption, caption_lengths, cond_index, cond):
    class _Batch:  # what dense_cross_mask reads
        pass

    batch = _Batch()
    batch.segments, batch.clip_caption, batch.caption_lengths = (
        segments,
        clip_caption,
        caption_lengths,
    )
    mask = dense_cross_mask(cond_index.to(segments.device), batch)
    return cond, {"attention_mask": mask, "packed_seq_params": None}


@contextlib.contextmanager
def dense_reference():
    """Inside: chunks built (and run) take the dense-mask path of the module docstring."""
    saved = (
        attention.packed_backend,
        attention.self_attention_kwargs,
        attention.cross_attention_inputs,
    )
    attention.packed_backend = _dense_backend
    attention.self_attention_kwargs = _dense_self
    attention.cross_attention_inputs = _dense_cross
    try:
        yield
    finally:
        (
            attention.packed_backend,
            attention.self_attention_kwargs,
            attention.cross_attention_inputs,
        ) = saved


def implied_mask(params, *, causal: bool) -> torch.Tensor:
    """[Sq, Sk] boolean mask (True = masked) that packed-sequence parameters describe: query
    segment i attends to key segment i (causally when `causal`)."""
    q = torch.diff(params.cu_seqlens_q.cpu()).tolist()
    k = torch.diff(params.cu_seqlens_kv.cpu()).tolist()
    q_ids = torch.repeat_interleave(torch.arange(len(q)), torch.tensor(q, dtype=torch.int64))
    k_ids = torch.repeat_interleave(torch.arange(len(k)), torch.tensor(k, dtype=torch.int64))
    mask = q_ids[:, None] != k_ids[None, :]
    if causal:
        mask |= causal_mask(len(q_ids), "cpu")
    return mask
