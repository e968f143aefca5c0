"""Hand-built sample metadata for tests: a VLM sample (images for the "vit" module) or a
text-to-video sample (one clip for the "dit" module), in the shapes the data side produces."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dip.data.sample import InstanceCounts, SampleMeta


def vlm_meta(
    sample_id: int,
    text: int,
    patches: Sequence[int] = (),
    llm: Sequence[int] = (),
    *,
    module: str = "vit",
    loss_tokens: int | None = None,
) -> SampleMeta:
    """A sample of `text` tokens (placeholders included) with images of `patches` ViT patches
    taking `llm` placeholder tokens each."""
    counts = {module: InstanceCounts(tuple(patches), tuple(llm))} if patches else {}
    return SampleMeta(sample_id, text, counts, loss_tokens=loss_tokens)


def t2v_meta(
    sample_id: int,
    text: int,
    tokens: int,
    frames: int | None = None,
    *,
    module: str = "dit",
    loss_tokens: int | None = None,
) -> SampleMeta:
    """A caption of `text` tokens with one latent clip of `tokens` DiT tokens over `frames`
    (None: no duration given)."""
    counts = {module: InstanceCounts((tokens,), (), () if frames is None else (frames,))}
    return SampleMeta(sample_id, text, counts, loss_tokens=loss_tokens)
