"""From a `Sample`'s arrays to the `SampleMeta` the planner sees, with validation.

The token arithmetic lives here once, so that generators, readers and the planner agree:

* VLM image [C, H, W]: ViT patches = (H / patch) * (W / patch); LLM tokens = patches / merge^2
  (H and W must be multiples of patch * merge, so the merge is exact).
* Diffusion clip [T, C, h, w] (latent): DiT tokens = T * (h / patch) * (w / patch).
* Loss tokens (`SampleMeta.loss_tokens`): VLM, the next-token targets of `sample.loss_targets`;
  diffusion, the clip's DiT tokens.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from megatron_dip.data.sample import IMAGE_TOKEN, Sample, SampleMeta, loss_targets
from megatron_dip.modelspec import ModuleKind, ModuleSpec, MultimodalSpec

ModelKind = Literal["vlm", "diffusion"]


def model_kind(model: MultimodalSpec) -> ModelKind:
    """ "vlm" for a ViT feeding an LLM, "diffusion" for a text encoder feeding a DiT."""
    kinds = {m.kind for m in model.modules}
    if ModuleKind.VIT in kinds and ModuleKind.LLM in kinds:
        return "vlm"
    if ModuleKind.DIT in kinds and ModuleKind.TEXT_ENCODER in kinds:
        return "diffusion"
    raise ValueError(f"model {model.name!r}: the data side knows ViT+LLM and text encoder+DiT")


def vision_module(model: MultimodalSpec) -> ModuleSpec:
    """The module whose instances are images or clips (the ViT or the DiT)."""
    kind = ModuleKind.VIT if model_kind(model) == "vlm" else ModuleKind.DIT
    return next(m for m in model.modules if m.kind is kind)


def text_module(model: MultimodalSpec) -> ModuleSpec:
    """The module that reads token ids (the LLM or the text encoder)."""
    kind = ModuleKind.LLM if model_kind(model) == "vlm" else ModuleKind.TEXT_ENCODER
    return next(m for m in model.modules if m.kind is kind)


def image_tokens(*, height: int, width: int, vit: ModuleSpec) -> tuple[int, int]:
    """(ViT patches, LLM tokens) of an image of `height` x `width` pixels.

    Raises ValueError unless both sides are positive multiples of patch_size * merge.
    """
    unit = vit.patch_size * vit.merge
    if height <= 0 or width <= 0 or height % unit or width % unit:
        raise ValueError(
            f"image {height}x{width} is not a multiple of patch*merge = {unit} pixels per side"
        )
    patches = (height // vit.patch_size) * (width // vit.patch_size)
    return patches, patches // (vit.merge * vit.merge)


def clip_tokens(*, frames: int, height: int, width: int, dit: ModuleSpec) -> int:
    """DiT tokens of a latent clip of `frames` x `height` x `width` (latent units).

    Raises ValueError unless frames > 0 and both sides are positive multiples of the patch size.
    """
    p = dit.patch_size
    if frames <= 0 or height <= 0 or width <= 0 or height % p or width % p:
        raise ValueError(
            f"latent clip {frames}x{height}x{width} needs frames > 0 and sides that are "
            f"multiples of the DiT patch size {p}"
        )
    return frames * (height // p) * (width // p)


def sample_meta(sample: Sample, *, model: MultimodalSpec) -> SampleMeta:
    """The metadata of `sample` under `model`, after checking the sample's conventions.

    Raises ValueError naming the sample id when the arrays break the conventions of
    `megatron_dip.data.sample` (wrong ranks or channels, sizes off the patch grid, placeholder
    runs that disagree with the images, token ids outside the vocabulary, ...).
    """
    try:
        text = _check_text(sample, text_module(model).vocab_size)
        if model_kind(model) == "vlm":
            return _vlm_meta(sample, text, vision_module(model))
        return _diffusion_meta(sample, text, vision_module(model))
    except ValueError as err:
        raise ValueError(f"sample {sample.sample_id}: {err}") from None


def _check_text(sample: Sample, vocab_size: int) -> np.ndarray:
    text = np.asarray(sample.text)
    if text.ndim != 1 or not np.issubdtype(text.dtype, np.integer):
        raise ValueError(f"text must be a 1-D integer array, got {text.dtype} {text.shape}")
    if text.size and (text.min() < 0 or text.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}), got [{text.min()}, {text.max()}]"
        )
    if sample.labels_mask is not None and np.shape(sample.labels_mask) != text.shape:
        raise ValueError(
            f"labels_mask has shape {np.shape(sample.labels_mask)}, text has {text.shape}"
        )
    return text


def _vlm_meta(sample: Sample, text: np.ndarray, vit: ModuleSpec) -> SampleMeta:
    patches, llm = [], []
    for i, image in enumerate(sample.images):
        if image.ndim != 3 or image.shape[0] != vit.in_channels:
            raise ValueError(
                f"image {i} must be [{vit.in_channels}, H, W], got shape {tuple(image.shape)}"
            )
        try:
            p, t = image_tokens(height=image.shape[1], width=image.shape[2], vit=vit)
        except ValueError as err:
            raise ValueError(f"image {i}: {err}") from None
        patches.append(p)
        llm.append(t)
    _check_placeholders(text, llm)
    if sample.labels_mask is not None and np.any(
        np.asarray(sample.labels_mask)[text == IMAGE_TOKEN]
    ):
        raise ValueError("labels_mask marks image placeholder tokens as loss tokens")
    loss = int(loss_targets(text, sample.labels_mask).sum())
    return SampleMeta(
        sample.sample_id, int(text.size), tuple(patches), tuple(llm), loss_tokens=loss
    )


def _check_placeholders(text: np.ndarray, llm_tokens: list[int]) -> None:
    """Each run of IMAGE_TOKEN must hold whole images, in order (adjacent images merge runs)."""
    needed = sum(llm_tokens)
    if needed > text.size:
        raise ValueError(
            f"its {len(llm_tokens)} images need {needed} LLM tokens but the sequence has "
            f"only {text.size} tokens"
        )
    is_image = np.concatenate(([0], (text == IMAGE_TOKEN).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(is_image))
    runs = (edges[1::2] - edges[::2]).tolist()
    if sum(runs) != needed:
        raise ValueError(
            f"{sum(runs)} image placeholder tokens in the text, but its {len(llm_tokens)} "
            f"images need {needed}"
        )
    image = 0
    for r, run in enumerate(runs):
        covered = 0
        while covered < run:
            covered += llm_tokens[image]
            image += 1
        if covered != run:
            raise ValueError(
                f"placeholder run {r} has {run} tokens, which does not match the sizes of "
                f"images up to {image - 1} (image {image - 1} needs {llm_tokens[image - 1]})"
            )


def _diffusion_meta(sample: Sample, text: np.ndarray, dit: ModuleSpec) -> SampleMeta:
    if len(sample.images) != 1:
        raise ValueError(f"a text-to-video sample has one latent clip, got {len(sample.images)}")
    clip = sample.images[0]
    if clip.ndim != 4 or clip.shape[1] != dit.in_channels:
        raise ValueError(
            f"latent clip must be [T, {dit.in_channels}, h, w], got shape {tuple(clip.shape)}"
        )
    if text.size == 0:
        raise ValueError("the caption is empty")
    if np.any(text == IMAGE_TOKEN):
        raise ValueError("a caption must not contain IMAGE_TOKEN")
    t, _, h, w = clip.shape
    tokens = clip_tokens(frames=t, height=h, width=w, dit=dit)
    return SampleMeta(
        sample.sample_id, int(text.size), (tokens,), (0,), (int(t),), loss_tokens=tokens
    )
