"""Packing samples into microbatches, and splitting a global batch across data-parallel replicas.

This is THE packing: the data side builds its tensors with it and the planner forms its
microbatches with it, from metadata alone, so both always agree on which samples share a
microbatch and in which order their instances appear.

Capacity is a `PackingLimits`: any of text tokens (a VLM's packed sequence length, placeholders
included), instances (images, clips, audio segments of every media module), instance tokens
(ViT patches, DiT latent tokens, audio encoder tokens) and frames (clip duration). What a
model's microbatch holds is its loss module's modality's choice (`Modality.packing_caps`,
`batching.packing_limits`): a VLM packs to `seq_length` text tokens; a text-to-video model, as
in the paper, groups up to 8 clips per microbatch while their total duration stays within 16 s
(64 latent frames at 16 FPS with a 4x causal VAE).

Policies (both deterministic):

* "first_fit" (default): samples in data order, each into the first microbatch with room. It is
  online (a sample's placement depends only on the samples before it), so the data stream can
  count microbatches while it reads, and samples stay near their data position.
* "first_fit_decreasing": samples sorted by their largest share of any limit (ties in data
  order), then first fit. Usually fewer microbatches (tighter fill) at the price of reordering
  samples across the whole batch and needing the whole batch up front.

Inside a microbatch samples, and so instances, are always listed in data order; microbatches are
numbered by their first sample's data position. Samples of different sources
(`SampleMeta.source`, set when sources are blended per packed sequence) never share a
microbatch: a sample goes to the first microbatch of its own source with room.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np

from megatron_dip.data.sample import InstanceCounts, SampleMeta

logger = logging.getLogger(__name__)

PackingPolicy = Literal["first_fit", "first_fit_decreasing"]
OnOversize = Literal["error", "skip"]
_UNBOUNDED = np.iinfo(np.int64).max


@dataclass(frozen=True)
class PackingLimits:
    """Capacity of one microbatch; None means unbounded. At least one limit must be set.

    `seq_length`: text tokens per microbatch (a VLM's packed LLM sequence, placeholders
    included; for text-to-video all captions together). `max_instances`: media instances
    (images, clips, audio segments). `max_instance_tokens`: their tokens inside their modules
    (ViT patches, DiT latent tokens, ...). `max_frames`: frames of all instances (the
    clip-duration budget of text-to-video).
    """

    seq_length: int | None = None
    max_instances: int | None = None
    max_instance_tokens: int | None = None
    max_frames: int | None = None

    def __post_init__(self) -> None:
        values = self._values()
        if all(v is None for v in values):
            raise ValueError("PackingLimits needs at least one limit")
        if any(v is not None and v <= 0 for v in values):
            raise ValueError(f"packing limits must be positive: {self}")

    @classmethod
    def vlm(cls, *, seq_length: int, max_images: int | None = None) -> PackingLimits:
        """Packed LLM sequences of `seq_length` tokens (placeholders included)."""
        return cls(seq_length=seq_length, max_instances=max_images)

    @classmethod
    def t2v(
        cls,
        *,
        max_clips: int = 8,
        max_frames: int | None = 64,
        max_latent_tokens: int | None = None,
    ) -> PackingLimits:
        """Text-to-video microbatches: at most `max_clips` clips, `max_frames` latent frames in
        total (64 = 16 s at 16 FPS through a 4x causal VAE) and `max_latent_tokens`."""
        return cls(
            max_instances=max_clips, max_instance_tokens=max_latent_tokens, max_frames=max_frames
        )

    def _values(self) -> tuple[int | None, ...]:
        return (self.seq_length, self.max_instances, self.max_instance_tokens, self.max_frames)

    def as_array(self) -> np.ndarray:
        """The limits in `demand`'s order as int64, unbounded ones as int64 max."""
        return np.array([_UNBOUNDED if v is None else v for v in self._values()], dtype=np.int64)


def demand(meta: SampleMeta) -> np.ndarray:
    """What `meta` uses of each limit: int64 [text tokens, instances, instance tokens, frames]."""
    return np.array(_demand_row(meta), dtype=np.int64)


def _demand_row(meta: SampleMeta) -> tuple[int, int, int, int]:
    return (meta.text_tokens, meta.num_instances, meta.instance_tokens, meta.frames)


def oversize_reason(meta: SampleMeta, limits: PackingLimits) -> str | None:
    """Why `meta` fits in no microbatch under `limits`, or None when it fits."""
    names = ("text tokens", "instances", "instance tokens", "frames")
    for name, need, cap in zip(names, demand(meta), limits.as_array()):
        if need > cap:
            return (
                f"sample {meta.sample_id} has {need} {name}, more than a microbatch holds ({cap})"
            )
    return None


@dataclass(frozen=True)
class PackedMicrobatch:
    """One microbatch: its samples in data order, and totals derived from them."""

    index: int
    samples: tuple[SampleMeta, ...]

    @property
    def sample_ids(self) -> tuple[int, ...]:
        """The samples' ids, in data order."""
        return tuple(s.sample_id for s in self.samples)

    @property
    def text_tokens(self) -> int:
        """Tokens of the packed sequence before padding (VLM) or of all captions (T2V)."""
        return sum(s.text_tokens for s in self.samples)

    @property
    def sample_text_tokens(self) -> tuple[int, ...]:
        """Text length per sample: the documents of a packed sequence, in order."""
        return tuple(s.text_tokens for s in self.samples)

    @property
    def instances_per_sample(self) -> tuple[int, ...]:
        """Media instances of each sample, in data order."""
        return tuple(s.num_instances for s in self.samples)

    @property
    def num_instances(self) -> int:
        """Media instances in the microbatch."""
        return sum(s.num_instances for s in self.samples)

    @property
    def frames(self) -> int:
        """Frames of every instance in the microbatch (latent frames of clips)."""
        return sum(s.frames for s in self.samples)

    def instances_of(self, module: str) -> InstanceCounts:
        """The instances of `module` in data order (instance k is the module's k-th)."""
        counts = [s.instances_of(module) for s in self.samples]
        return InstanceCounts(
            tuple(t for c in counts for t in c.tokens),
            tuple(t for c in counts for t in c.placeholders),
            tuple(t for c in counts for t in c.frames),
        )


class Packing(Sequence[PackedMicrobatch]):
    """The result of `pack_microbatches`: a sequence of microbatches plus the skipped sample ids."""

    def __init__(self, microbatches: Sequence[PackedMicrobatch], skipped: Sequence[int]) -> None:
        self.microbatches: tuple[PackedMicrobatch, ...] = tuple(microbatches)
        self.skipped: tuple[int, ...] = tuple(skipped)

    @overload
    def __getitem__(self, i: int) -> PackedMicrobatch: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[PackedMicrobatch]: ...
    def __getitem__(self, i):
        return self.microbatches[i]

    def __len__(self) -> int:
        return len(self.microbatches)

    def __repr__(self) -> str:
        return f"Packing({len(self)} microbatches, skipped={list(self.skipped)})"


class FirstFitPacker:
    """Online first-fit: samples are added in data order, each to the first bin with room.

    Remaining capacities live in one int64 array (grown by doubling), so finding the first bin
    is one vectorised scan per sample; packing thousands of samples takes milliseconds. A bin
    holds samples of one `SampleMeta.source` only (its first sample's).
    """

    def __init__(self, limits: PackingLimits) -> None:
        self.limits = limits
        self._cap = limits.as_array()
        self._left = np.empty((16, len(self._cap)), dtype=np.int64)
        self._source = np.empty(16, dtype=np.int64)  # each bin's source, as a code
        self._codes: dict[str | None, int] = {}
        self._bins: list[list[SampleMeta]] = []

    @property
    def num_bins(self) -> int:
        """Bins (microbatches) opened so far."""
        return len(self._bins)

    def place(self, meta: SampleMeta) -> int:
        """The bin `meta` would go to (`num_bins` = a new one). Raises if it fits nowhere."""
        return self._place(meta, demand(meta))

    def add(self, meta: SampleMeta, need: np.ndarray | None = None) -> int:
        """Add `meta` to the bin `place` chooses; returns that bin. `need` may pass a
        precomputed `demand(meta)`."""
        need = demand(meta) if need is None else need
        b = self._place(meta, need)
        if b == len(self._bins):
            if b == len(self._left):
                self._left = np.concatenate([self._left, np.empty_like(self._left)])
                self._source = np.concatenate([self._source, np.empty_like(self._source)])
            self._left[b] = self._cap
            self._source[b] = self._code(meta.source)
            self._bins.append([])
        self._left[b] -= need
        self._bins[b].append(meta)
        return b

    def _place(self, meta: SampleMeta, need: np.ndarray) -> int:
        if (need > self._cap).any():
            raise ValueError(oversize_reason(meta, self.limits))
        n = len(self._bins)
        room = (self._left[:n] >= need).all(axis=1) & (self._source[:n] == self._code(meta.source))
        fits = np.flatnonzero(room)
        return int(fits[0]) if fits.size else n

    def _code(self, source: str | None) -> int:
        return self._codes.setdefault(source, len(self._codes))

    def bins(self) -> list[list[SampleMeta]]:
        """Each bin's samples, in the order they were added."""
        return [list(b) for b in self._bins]


def pack_microbatches(
    samples: Sequence[SampleMeta],
    *,
    seq_length: int | None = None,
    max_instances_per_microbatch: int | None = None,
    limits: PackingLimits | None = None,
    policy: PackingPolicy = "first_fit",
    on_oversize: OnOversize = "error",
) -> Packing:
    """Pack `samples` (in data order) into microbatches; see the module docstring for policies.

    Give either `limits`, or `seq_length` (and optionally `max_instances_per_microbatch`) as a
    shorthand for `PackingLimits.vlm(...)`. A sample that fits in no microbatch raises
    ValueError naming it (`on_oversize="error"`), or is left out and listed in the result's
    `skipped` (`"skip"`, logged). Raises ValueError on empty input, on duplicate sample ids, and
    when every sample was skipped.
    """
    limits = _resolve_limits(seq_length, max_instances_per_microbatch, limits)
    if policy not in ("first_fit", "first_fit_decreasing"):
        raise ValueError(f"unknown packing policy {policy!r}")
    if not samples:
        raise ValueError("pack_microbatches: no samples to pack")
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError("pack_microbatches: duplicate sample ids in the input")
    kept, skipped = _drop_oversize(samples, limits, on_oversize)
    if not kept:
        raise ValueError(f"pack_microbatches: all {len(samples)} samples are oversize")
    position = {s.sample_id: k for k, s in enumerate(kept)}
    needs = _demands(kept)
    order = range(len(kept))
    if policy == "first_fit_decreasing":
        # Dominant share of the limits; the stable sort keeps ties in data order.
        share = (needs / limits.as_array().astype(np.float64)).max(axis=1)
        order = np.argsort(-share, kind="stable").tolist()
    packer = FirstFitPacker(limits)
    for k in order:
        packer.add(kept[k], needs[k])
    bins = [sorted(b, key=lambda m: position[m.sample_id]) for b in packer.bins()]
    bins.sort(key=lambda b: position[b[0].sample_id])
    return Packing([PackedMicrobatch(i, tuple(b)) for i, b in enumerate(bins)], skipped)


def _resolve_limits(
    seq_length: int | None, max_instances: int | None, limits: PackingLimits | None
) -> PackingLimits:
    if limits is not None:
        if seq_length is not None or max_instances is not None:
            raise ValueError("give either limits or seq_length/max_instances_per_microbatch")
        return limits
    if seq_length is None:
        raise ValueError("pack_microbatches needs limits or seq_length")
    return PackingLimits.vlm(seq_length=seq_length, max_images=max_instances)


def _drop_oversize(
    samples: Sequence[SampleMeta], limits: PackingLimits, on_oversize: OnOversize
) -> tuple[list[SampleMeta], list[int]]:
    if on_oversize not in ("error", "skip"):
        raise ValueError(f"on_oversize must be 'error' or 'skip', got {on_oversize!r}")
    over = (_demands(samples) > limits.as_array()).any(axis=1)
    if not over.any():
        return list(samples), []
    kept, skipped = [], []
    for meta, bad in zip(samples, over.tolist()):
        if not bad:
            kept.append(meta)
            continue
        reason = oversize_reason(meta, limits)
        if on_oversize == "error":
            raise ValueError(reason)
        logger.warning("skipping oversize sample: %s", reason)
        skipped.append(meta.sample_id)
    return kept, skipped


def _demands(samples: Sequence[SampleMeta]) -> np.ndarray:
    """`demand` of every sample as one int64 [n, 4] array."""
    return np.array([_demand_row(m) for m in samples], dtype=np.int64).reshape(len(samples), 4)


def split_replicas(
    samples: Sequence[SampleMeta],
    *,
    num_replicas: int,
    cost: Callable[[SampleMeta], float],
) -> list[list[SampleMeta]]:
    """Balance `samples` across data-parallel replicas by estimated `cost`.

    Greedy LPT: samples by decreasing cost (ties in data order) each go to the replica with the
    least cost so far (ties to the replica with fewer samples, then the lowest index, so
    zero-cost samples spread out too), which is deterministic and within 4/3 of the
    optimal makespan. Each replica's list is returned in data order. Raises ValueError when
    there are fewer samples than replicas (a replica without data cannot take part in the
    step) or a cost is negative or not finite.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if len(samples) < num_replicas:
        raise ValueError(f"{len(samples)} samples cannot feed {num_replicas} replicas")
    costs = [float(cost(s)) for s in samples]
    for s, c in zip(samples, costs):
        if not np.isfinite(c) or c < 0:
            raise ValueError(f"sample {s.sample_id}: cost {c} must be finite and >= 0")
    heap = [(0.0, 0, r) for r in range(num_replicas)]
    owner = [0] * len(samples)
    for k in sorted(range(len(samples)), key=lambda k: -costs[k]):
        load, count, r = heapq.heappop(heap)
        owner[k] = r
        heapq.heappush(heap, (load + costs[k], count + 1, r))
    return [[s for s, o in zip(samples, owner) if o == r] for r in range(num_replicas)]
