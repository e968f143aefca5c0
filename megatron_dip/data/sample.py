"""Multimodal samples and the metadata the planner sees of them.

A `Sample` holds arrays (numpy, so the data side needs no torch); `SampleMeta` is what the planner
may know before any array exists: token counts only.

Conventions shared by the data side, the planner and the models (each modality's own file in
`megatron_dip.modalities` states the details of its kind):

* `text` holds the token ids of the whole sample: for a VLM (or any LLM with producers) the
  sample's sequence, with one run of a producer's placeholder id per instance, as long as the
  tokens that instance occupies in the LLM (`InstanceCounts.placeholders`); for text-to-video
  the caption. `labels_mask[j] = 1` marks token j as a next-token prediction target (see
  `modalities.llm.loss_targets`); no labels_mask = every token a target.
* `media[module]` lists the arrays of that module's instances, in order: ViT images float32
  [C, H, W], DiT latent clips float32 [T, C, h, w] (one per sample), audio log-mel segments
  float32 [mel bins, frames].
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from megatron_dip.modalities import InstanceCounts
from megatron_dip.modalities.llm import loss_targets
from megatron_dip.modelspec import IMAGE_TOKEN, PAD_TOKEN

__all__ = [
    "IMAGE_TOKEN",
    "PAD_TOKEN",
    "BatchMeta",
    "InstanceCounts",
    "ModuleInstances",
    "Sample",
    "SampleMeta",
    "loss_targets",
]

_NONE = InstanceCounts()


class ModuleInstances(Mapping[str, InstanceCounts]):
    """An immutable, hashable mapping module name -> `InstanceCounts`, sorted by name (so equal
    contents compare, hash and print equal however they were built); modules without instances
    are left out."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, InstanceCounts] | None = None) -> None:
        pairs = tuple(sorted((str(k), v) for k, v in (items or {}).items() if len(v)))
        for name, counts in pairs:
            if not isinstance(counts, InstanceCounts):
                raise TypeError(f"instances of {name!r} must be InstanceCounts, got {counts!r}")
        self._items = pairs

    def __getitem__(self, name: str) -> InstanceCounts:
        for key, value in self._items:
            if key == name:
                return value
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ModuleInstances):
            return self._items == other._items
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"ModuleInstances({dict(self._items)!r})"


@dataclass(frozen=True)
class SampleMeta:
    """What the planner may see of one sample.

    `text_tokens`: all tokens of the text sequence (placeholders included; the caption for
    text-to-video). `instances[module]`: the `InstanceCounts` of each media module (tokens of
    each instance inside its module, placeholder tokens it occupies in its consumer, frames);
    a mapping is accepted and frozen.

    `loss_tokens`: the tokens of this sample that carry a loss, exactly as the models count them
    for the loss normalisation ("num_tokens" of the loss chunk). The data side always sets it;
    left out (None, hand-built metadata) it is estimated: the instance tokens of the modules
    with frames when there are any (a diffusion loss over latent tokens), else every text token
    but the first and the placeholders.

    `source`: the blended dataset the sample comes from when sources are blended per packed
    sequence (Megatron's `BlendedDataset`, an Energon blend of packed datasets): the packing
    puts only samples of the same source in one microbatch. None (mixed per sample) is a value
    like any other.
    """

    sample_id: int
    text_tokens: int
    instances: ModuleInstances = field(default_factory=ModuleInstances)
    loss_tokens: int | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.instances, ModuleInstances):
            object.__setattr__(self, "instances", ModuleInstances(self.instances))
        if self.loss_tokens is None:
            timed = [c for c in self.instances.values() if c.frames]
            if timed:
                estimate = sum(sum(c.tokens) for c in timed)
            else:
                estimate = max(0, self.text_tokens - self.placeholder_tokens - 1)
            object.__setattr__(self, "loss_tokens", estimate)

    def instances_of(self, module: str) -> InstanceCounts:
        """The instances of `module` (empty when the sample has none)."""
        return self.instances.get(module, _NONE)

    @property
    def num_instances(self) -> int:
        """Instances of every media module."""
        return sum(len(c) for c in self.instances.values())

    @property
    def instance_tokens(self) -> int:
        """Tokens of every media instance inside its module."""
        return sum(sum(c.tokens) for c in self.instances.values())

    @property
    def placeholder_tokens(self) -> int:
        """Text tokens that are producers' placeholders."""
        return sum(sum(c.placeholders) for c in self.instances.values())

    @property
    def frames(self) -> int:
        """Duration units of every instance (latent frames of clips)."""
        return sum(sum(c.frames) for c in self.instances.values())


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
    media: dict[str, list[np.ndarray]] = field(default_factory=dict)
    labels_mask: np.ndarray | None = None
    source: str | None = None  # the blended dataset (see `SampleMeta.source`)
    # Why its media were replaced by blanks of the planned shape and its loss weight set to zero
    # (an image that failed to decode under --dip-bad-samples skip); None for a good sample.
    bad: str | None = None
