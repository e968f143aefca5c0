"""From a `Sample`'s arrays to the `SampleMeta` the planner sees, with validation.

The token arithmetic lives in the modalities, once (`Modality.instance_counts`: ViT patches and
LLM tokens of an image, DiT tokens and frames of a latent clip, audio encoder tokens of a
segment; `Modality.sample_loss_tokens`: the loss module's count), so that generators, readers
and the planner agree. This module applies them to every module of a model and checks what is
common to all: token ids within the vocabulary, a labels_mask of the text's shape, no arrays for
a module the model does not have.
"""

from __future__ import annotations

import numpy as np

from megatron_dip.modalities import media_modules, modality_of, text_module
from megatron_dip.modelspec import MultimodalSpec

from .sample import Sample, SampleMeta


def sample_meta(sample: Sample, *, model: MultimodalSpec) -> SampleMeta:
    """The metadata of `sample` under `model`, after checking the sample's conventions.

    Raises ValueError naming the sample id when the arrays break the conventions of
    `megatron_dip.data.sample` (wrong ranks or channels, sizes off the patch grid, placeholder
    runs that disagree with the instances, token ids outside the vocabulary, ...).
    """
    try:
        text = _check_text(sample, text_module(model).vocab_size)
        media = {m.name for m in media_modules(model)}
        unknown = sorted(set(sample.media) - media)
        if unknown:
            raise ValueError(f"arrays for {unknown}, which the model {model.name!r} does not have")
        instances = {}
        for spec in model.modules:
            modality = modality_of(spec)
            modality.check_sample(spec, model, sample)
            counts = modality.instance_counts(spec, model, sample)
            if counts is not None:
                instances[spec.name] = counts
        loss = model.loss_module
        tokens = modality_of(loss).sample_loss_tokens(loss, model, sample)
    except ValueError as err:
        raise ValueError(f"sample {sample.sample_id}: {err}") from None
    return SampleMeta(
        sample.sample_id, int(text.size), instances, loss_tokens=tokens, source=sample.source
    )


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
