"""Multimodal samples and the metadata the planner sees of them.

A `Sample` holds tensors (as numpy arrays, so the data side needs no torch); `SampleMeta` is what
the planner may know before any tensor exists: token counts only.

Conventions shared by the data side, the planner and the models:

* VLM sample: `text` holds the token ids of the whole sample, with one run of `IMAGE_TOKEN` per
  image, as long as that image's LLM token count (ViT patches / merge^2). `images[i]` is a
  float32 [C, H, W] array, H and W multiples of patch_size * merge. `labels_mask[j]` tells whether
  token j carries a loss (1) or not (0: image placeholders, prompts).
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
    """

    sample_id: int
    text_tokens: int
    vision_tokens: tuple[int, ...] = ()
    llm_tokens: tuple[int, ...] = ()
    frames: tuple[int, ...] = ()

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
