"""Multimodal samples and the metadata the planner sees of them.

A `Sample` holds tensors (as numpy arrays, so the data side needs no torch); `SampleMeta` is what
the planner may know before any tensor exists: token counts only.

Conventions shared by the data side, the planner and the models:

* VLM sample: `text` holds the token ids of the whole sample, with one run of `IMAGE_TOKEN` per
  image, as long as that image's LLM token count (ViT patches / merge^2). `images[i]` is a
  float32 [C, H, W] array, H and W multiples of patch_size * merge. `labels_mask[j] = 1` means
  token j is a next-token prediction TARGET: the loss sits at position j - 1, whose output
  predicts token j. 0 marks tokens nobody is trained to predict (prompts); image placeholders
  are never targets (must be 0), and neither is token 0 (nothing precedes it within the sample;
  packed samples never predict across their boundaries). No labels_mask = every token a target.
  `loss_targets` applies these rules.
* Text-to-video sample: `text` is the caption, `images[0]` one latent clip float32 [T, C, h, w]
  (h, w multiples of the DiT patch size). The diffusion loss covers the clip's latent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IMAGE_TOKEN = 1  # placeholder id, reserved in every tokenizer we build
PAD_TOKEN = 0


@dataclass(frozen=True)
class SampleMeta:
    """What the planner may see of one sample.

    `vision_tokens[i]`: tokens of image/clip i inside its vision module (ViT patches, DiT latent
    tokens); `llm_tokens[i]`: tokens it occupies in the LLM sequence (VLM only, else 0).
    `text_tokens`: all tokens of the text sequence (image placeholders included for VLMs; the
    caption for text-to-video). `frames[i]`: latent frames of clip i (diffusion only, else
    empty); text-to-video packing budgets clip duration in these.

    `loss_tokens`: the tokens of this sample that carry a loss, exactly as the models count them
    for the loss normalisation ("num_tokens" of the loss chunk): VLM, the next-token targets
    (`loss_targets`); text-to-video, every latent token of the clip (the DiT's flow-matching
    loss is averaged over them). The data side always sets it; left out (None, hand-built
    metadata), it is estimated as every non-placeholder text token but the first when `frames`
    is empty, else `sum(vision_tokens)`, and is an int after construction.
    """

    sample_id: int
    text_tokens: int
    vision_tokens: tuple[int, ...] = ()
    llm_tokens: tuple[int, ...] = ()
    frames: tuple[int, ...] = ()
    loss_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.loss_tokens is None:
            if self.frames:
                estimate = sum(self.vision_tokens)
            else:
                estimate = max(0, self.text_tokens - sum(self.llm_tokens) - 1)
            object.__setattr__(self, "loss_tokens", estimate)

    @property
    def num_instances(self) -> int:
        return len(self.vision_tokens)


@dataclass(frozen=True)
class BatchMeta:
    """The metadata of one global batch (all data-parallel replicas), in data order."""

    iteration: int
    samples: tuple[SampleMeta, ...]

    @property
    def num_samples(self) -> int:
        return len(self.samples)


@dataclass
class Sample:
    """One training sample with its arrays (see the module docstring for the conventions)."""

    sample_id: int
    text: np.ndarray
    images: list[np.ndarray] = field(default_factory=list)
    labels_mask: np.ndarray | None = None


def loss_targets(text: np.ndarray, labels_mask: np.ndarray | None = None) -> np.ndarray:
    """Boolean [len(text)]: whether token j is a next-token prediction target.

    True where `labels_mask` is 1 (every token without a mask), except token 0 and image
    placeholders (see the module docstring). Position j - 1 of the LLM carries the loss of
    target j; the LLM's loss-token count of the sample is the number of True entries.
    """
    text = np.asarray(text)
    targets = text != IMAGE_TOKEN
    if labels_mask is not None:
        targets &= np.asarray(labels_mask) != 0
    targets[:1] = False
    return targets
