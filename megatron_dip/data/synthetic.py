"""Seeded synthetic multimodal data with paper-like distributions.

A `MixtureSpec` (`data.mixtures`) describes data in token units, independent of the model. The
model fixes the pixel and latent sizes (patch size, merge, DiT patch), so one mixture serves the
paper-scale simulation and the tiny CPU models alike; `MixtureSpec.scaled` shrinks all token
counts by about a factor for tiny runs. A mixture blended per sequence stamps each sample with
its source's name (`SampleMeta.source`), which keeps packed sequences single-source.

Two outputs come from ONE seeded stream:

* `generate_meta` — metadata only, vectorised, for the planner/simulator at paper scale;
* `generate_samples` — real numpy arrays following `megatron_dip.data.sample`'s conventions.

The stream is split in blocks of `BLOCK` samples; block b's structure (source, lengths, counts)
comes from the seed sequence (seed, 0, b) and sample i's contents from (seed, 1, i). Any range of
samples is thus reproducible on its own, and `sample_meta(generate_samples(...)[k])` equals
`generate_meta(...)[k]` by construction (the tests check it).

Presets (`MIXTURES`): "laion" (one image, 5-60 caption tokens: a packed 8192 sequence holds up to
~47 images of 169 tokens), "obelics" (interleaved documents, 300-3000 text tokens, 0-6 images),
"mixed" (both, half the samples each), "mixed-blend" (both, half the packed sequences each, every
sequence from one source), "text-only"; "omni" (for an LLM fed by a ViT and an audio
encoder: captioned images, speech of 2-30 s with its transcript, audio-visual questions with
both, interleaved documents); for diffusion "t2v" (clips of 2-16 s at 16 FPS, a causal VAE with
4x temporal and 8x spatial compression, 256p in three aspect ratios, captions of 20-200 tokens)
and "t2i" (512p still images, one latent frame); "t2v-mixed" / "t2v-blend" blend the two per
sample / per microbatch. Text lengths and durations are log-uniform:
short items dominate, as in web data. A VLM mixture's instances are images of the model's "vit"
module, a diffusion mixture's are clips of its "dit" module; audio segments go to its "audio"
module, placed before everything else of their sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from megatron_dip.data.mixtures import (
    MIXTURES,
    MixtureKind,
    MixtureSpec,
    SourceSpec,
    get_mixture,
)
from megatron_dip.data.sample import InstanceCounts, Sample, SampleMeta
from megatron_dip.modalities import modality, text_module
from megatron_dip.modalities.audio import frames_for_seconds
from megatron_dip.modalities.llm import placeholder_ids
from megatron_dip.modalities.vit import image_tokens
from megatron_dip.modelspec import ModuleSpec, MultimodalSpec

BLOCK = 1024
_STRUCTURE, _CONTENT = 0, 1
_FIRST_TEXT_ID = 2  # 0 = PAD and 1 = IMAGE_TOKEN never appear as text

__all__ = [
    "MIXTURES",
    "MixtureSpec",
    "SourceSpec",
    "SyntheticSource",
    "generate_meta",
    "generate_samples",
    "get_mixture",
]


@dataclass(frozen=True)
class _Structure:
    """Per-sample draws of a range of samples (arrays of equal length)."""

    source: np.ndarray
    text: np.ndarray  # text tokens without placeholders (VLM) / caption tokens
    instances: np.ndarray
    frames: np.ndarray  # latent frames per clip (diffusion), 1 for still images
    grid: np.ndarray  # index into its source's frame grids (diffusion)
    lead: np.ndarray  # VLM: the sample's images start with one (before any audio)
    audio: np.ndarray  # audio segments (zeros when the mixture has no audio)
    audio_seconds: np.ndarray  # [n, max segments] duration of each audio segment

    def __len__(self) -> int:
        return len(self.source)

    def columns(self) -> list[np.ndarray]:
        """The arrays, in field order (views, not copies)."""
        return [getattr(self, f.name) for f in fields(self)]

    def part(self, lo: int, hi: int) -> _Structure:
        """Samples [lo, hi) of this range."""
        return _Structure(*(a[lo:hi] for a in self.columns()))


def _log_uniform(u: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Integers in [lo, hi], log-uniformly distributed, from uniforms `u` in [0, 1)."""
    x = np.exp(np.log(lo) + u * (np.log(hi + 1.0) - np.log(lo)))
    return np.clip(np.floor(x), lo, hi).astype(np.int64)


def _per_source(src: Sequence[SourceSpec], source: np.ndarray, get) -> tuple[np.ndarray, ...]:
    """Each sample's value of `get(s)` (a pair) for its source, as two arrays."""
    pairs = [get(s) for s in src]
    return tuple(np.array([p[k] for p in pairs])[source] for k in (0, 1))


def _draw_block(mixture: MixtureSpec, seed: int, block: int) -> _Structure:
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_STRUCTURE, block)))
    src = mixture.sources
    weights = np.cumsum(mixture.draw_weights())
    source = np.minimum(np.searchsorted(weights, rng.random(BLOCK), side="right"), len(src) - 1)
    t_lo, t_hi = _per_source(src, source, lambda s: s.text_tokens)
    text = _log_uniform(rng.random(BLOCK), t_lo.astype(float), t_hi.astype(float))
    i_lo, i_hi = _per_source(src, source, lambda s: s.instances)
    instances = i_lo + np.floor(rng.random(BLOCK) * (i_hi - i_lo + 1)).astype(np.int64)
    # Interleaved images sit before distinct text positions, so there must be enough text.
    interleaved = np.array([s.layout == "interleaved" for s in src])[source]
    text = np.where(interleaved, np.maximum(text, instances), text)
    video = np.array([s.seconds is not None for s in src])[source]
    s_lo, s_hi = _per_source(src, source, lambda s: s.seconds or (1.0, 1.0))
    seconds = np.exp(np.log(s_lo) + rng.random(BLOCK) * (np.log(s_hi) - np.log(s_lo)))
    raw_frames = np.maximum(1, np.rint(seconds * mixture.fps)).astype(np.int64)
    frames = np.where(video, 1 + (raw_frames - 1) // mixture.temporal_compression, 1)
    sizes = np.array([len(mixture.grids_of(s)) for s in src])[source]
    grid = np.floor(rng.random(BLOCK) * sizes).astype(np.int64)
    # Whether an interleaved document opens with an image: position 0 is among the n distinct
    # image positions in [0, text) with probability n / text (drawn last: earlier draws keep).
    opens = rng.random(BLOCK) * text < instances
    lead = (instances > 0) & (~interleaved | opens)
    audio, audio_seconds = _draw_audio(mixture, rng, source)
    return _Structure(source, text, instances, frames, grid, lead, audio, audio_seconds)


def _draw_audio(mixture: MixtureSpec, rng: np.random.Generator, source: np.ndarray):
    """Audio segments per sample and their durations (log-uniform); drawn after every other
    draw, and only for mixtures with audio, so the other mixtures' streams are unchanged."""
    if not mixture.has_audio:
        return np.zeros(BLOCK, dtype=np.int64), np.zeros((BLOCK, 0))
    src = mixture.sources
    a_lo, a_hi = _per_source(src, source, lambda s: s.audio)
    audio = a_lo + np.floor(rng.random(BLOCK) * (a_hi - a_lo + 1)).astype(np.int64)
    d_lo, d_hi = _per_source(src, source, lambda s: s.audio_seconds)
    most = max(s.audio[1] for s in src)
    u = rng.random((BLOCK, most))
    seconds = np.exp(np.log(d_lo)[:, None] + u * (np.log(d_hi) - np.log(d_lo))[:, None])
    return audio, seconds


def _structure(mixture: MixtureSpec, seed: int, start: int, stop: int) -> _Structure:
    """Draws of samples [start, stop), assembled from the blocks that hold them."""
    if start < 0 or stop < start:
        raise ValueError(f"bad sample range [{start}, {stop})")
    parts = []
    for block in range(start // BLOCK, (stop - 1) // BLOCK + 1 if stop > start else 0):
        lo = max(start, block * BLOCK) - block * BLOCK
        hi = min(stop, (block + 1) * BLOCK) - block * BLOCK
        parts.append(_draw_block(mixture, seed, block).part(lo, hi))
    if not parts:
        empty = [np.zeros(0, dtype=np.int64)] * 5
        return _Structure(
            *empty, np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64), np.zeros((0, 0))
        )
    return _Structure(*(np.concatenate(cols) for cols in zip(*(p.columns() for p in parts))))


@dataclass(frozen=True)
class _Sizes:
    """What the model makes of the mixture's token units."""

    kind: MixtureKind
    vocab: int
    reserved: tuple[int, ...]  # placeholder ids >= _FIRST_TEXT_ID that text never uses
    media: ModuleSpec | None  # the ViT (VLM) or the DiT (diffusion)
    image_side: int  # VLM image side in pixels
    patches: int  # VLM ViT patches per image
    llm: int  # VLM LLM tokens per image
    grids: tuple[tuple[tuple[int, int], ...], ...]  # diffusion: per source, DiT tokens per side
    audio: ModuleSpec | None  # the audio encoder, when the mixture has audio
    sources: tuple[str | None, ...]  # per source, what `SampleMeta.source` says


def _module_of_kind(model: MultimodalSpec, kind: str, mixture: MixtureSpec) -> ModuleSpec:
    found = model.modules_of_kind(kind)
    if not found:
        raise ValueError(
            f"mixture {mixture.name!r} needs a module of kind {kind!r}; model {model.name!r} "
            f"has {[m.kind for m in model.modules]}"
        )
    return found[0]


def _sizes(mixture: MixtureSpec, model: MultimodalSpec, image_size: int | None) -> _Sizes:
    vocab = text_module(model).vocab_size
    audio = _module_of_kind(model, "audio", mixture) if mixture.has_audio else None
    reserved = tuple(sorted(set(placeholder_ids(model, text_module(model).name)) - {0, 1}))
    blended = mixture.blend == "sequence"
    names = tuple(s.name if blended else None for s in mixture.sources)
    if vocab - len(reserved) <= _FIRST_TEXT_ID:
        raise ValueError(f"vocabulary of {vocab} leaves no ids for text")
    if mixture.kind == "vlm":
        vit = _module_of_kind(model, "vit", mixture)
        unit = vit.patch_size * vit.merge
        g = mixture.image_grid if image_size is None else _exact(image_size, unit, "image")
        patches, llm = image_tokens(height=g * unit, width=g * unit, vit=vit)
        return _Sizes("vlm", vocab, reserved, vit, g * unit, patches, llm, (), audio, names)
    dit = _module_of_kind(model, "dit", mixture)
    grids = tuple(mixture.grids_of(s) for s in mixture.sources)
    if image_size is not None:
        g = _exact(image_size, mixture.spatial_compression * dit.patch_size, "frame")
        # One square grid in every slot: the per-sample grid draws index a source's grids, so
        # the stream's structure (and every other draw) stays that of the mixture.
        grids = tuple(((g, g),) * len(gs) for gs in grids)
    return _Sizes("diffusion", vocab, reserved, dit, 0, 0, 0, grids, audio, names)


def _exact(pixels: int, unit: int, what: str) -> int:
    if pixels <= 0 or pixels % unit:
        raise ValueError(f"{what} size {pixels} must be a positive multiple of {unit} pixels")
    return pixels // unit


def _audio_frames(sz: _Sizes, st: _Structure, k: int) -> list[int]:
    """Mel frames of each audio segment of sample k."""
    n = int(st.audio[k])
    return [frames_for_seconds(sz.audio, float(x)) for x in st.audio_seconds[k, :n]]


def _audio_counts(sz: _Sizes, st: _Structure, k: int) -> InstanceCounts:
    audio = modality(sz.audio.kind)
    tokens = [f // sz.audio.patch_size for f in _audio_frames(sz, st, k)]
    return InstanceCounts(tuple(tokens), tuple(audio.consumer_rows(sz.audio, t) for t in tokens))


def _metas(st: _Structure, sz: _Sizes, start: int) -> list[SampleMeta]:
    if sz.kind == "vlm":
        text = (st.text + st.instances * sz.llm).tolist()
        # Every word is a target except a first token that is a word (`_sample`'s labels_mask);
        # audio segments, when there are any, open the sample.
        loss = (st.text - ~(st.lead | (st.audio > 0))).tolist()
        out = []
        for k, n in enumerate(st.instances.tolist()):
            media = {sz.media.name: InstanceCounts((sz.patches,) * n, (sz.llm,) * n)}
            if st.audio[k]:
                counts = _audio_counts(sz, st, k)
                media[sz.audio.name] = counts
                text[k] += sum(counts.placeholders)
            source = sz.sources[st.source[k]]
            out.append(SampleMeta(start + k, text[k], media, loss_tokens=loss[k], source=source))
        return out
    per_frame = [sz.grids[s][g][0] * sz.grids[s][g][1] for s, g in zip(st.source, st.grid)]
    tokens = (st.frames * np.array(per_frame, dtype=np.int64)).tolist()
    text, frames = st.text.tolist(), st.frames.tolist()
    name = sz.media.name
    return [
        SampleMeta(
            start + k,
            text[k],
            {name: InstanceCounts((tokens[k],), (), (frames[k],))},
            loss_tokens=tokens[k],
            source=sz.sources[st.source[k]],
        )
        for k in range(len(st))
    ]


def generate_meta(
    mixture: MixtureSpec | str,
    *,
    model: MultimodalSpec,
    num_samples: int,
    seed: int,
    start: int = 0,
    scale: float = 1.0,
    image_size: int | None = None,
) -> list[SampleMeta]:
    """Metadata of samples [start, start + num_samples) of the seeded stream; ids are positions.

    `scale` applies `MixtureSpec.scaled`; `image_size` (pixels) overrides the image side (VLM)
    or the square frame side (diffusion). Vectorised: 10k samples take a few tens of ms.
    """
    mix = (get_mixture(mixture) if isinstance(mixture, str) else mixture).scaled(scale)
    sizes = _sizes(mix, model, image_size)
    return _metas(_structure(mix, seed, start, start + num_samples), sizes, start)


def generate_samples(
    mixture: MixtureSpec | str,
    *,
    model: MultimodalSpec,
    num_samples: int,
    seed: int,
    start: int = 0,
    scale: float = 1.0,
    image_size: int | None = None,
) -> list[Sample]:
    """Samples [start, start + num_samples) with arrays; their metadata equals `generate_meta`'s.

    VLM: token ids in [2, vocab) (placeholder ids excluded) with one placeholder run per image
    (and per audio segment, first), float32 images [C, H, W] and mel segments [mels, frames],
    labels_mask 1 on text and 0 on placeholders. Diffusion: caption ids, one float32 latent clip
    [T, C, h, w], no labels_mask (the loss covers the latent tokens).
    """
    mix = (get_mixture(mixture) if isinstance(mixture, str) else mixture).scaled(scale)
    sizes = _sizes(mix, model, image_size)
    st = _structure(mix, seed, start, start + num_samples)
    return [_sample(mix, sizes, st, k, start + k, seed) for k in range(len(st))]


def _words(rng: np.random.Generator, n: int, sz: _Sizes, zipf: float) -> np.ndarray:
    """`n` text ids in [2, vocab) that are no placeholder id (the reserved ones are skipped)."""
    high = sz.vocab - len(sz.reserved)
    if zipf > 0:
        weights = np.arange(1, high - _FIRST_TEXT_ID + 1, dtype=np.float64) ** -zipf
        ids = _FIRST_TEXT_ID + rng.choice(weights.size, size=n, p=weights / weights.sum())
    else:
        ids = rng.integers(_FIRST_TEXT_ID, high, size=n, dtype=np.int64)
    for r in sz.reserved:  # ascending: shift every id at or above a reserved one past it
        ids = ids + (ids >= r)
    return ids


def _sample(mix: MixtureSpec, sz: _Sizes, st: _Structure, k: int, index: int, seed: int) -> Sample:
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_CONTENT, index)))
    words = _words(rng, int(st.text[k]), sz, mix.word_zipf)
    media: dict[str, list[np.ndarray]] = {}
    source = sz.sources[int(st.source[k])]
    if sz.kind == "diffusion":
        h, w = sz.grids[int(st.source[k])][int(st.grid[k])]
        p = sz.media.patch_size
        shape = (int(st.frames[k]), sz.media.in_channels, h * p, w * p)
        media[sz.media.name] = [rng.standard_normal(shape, dtype=np.float32)]
        return Sample(index, words, media, source=source)
    n = int(st.instances[k])
    if mix.sources[int(st.source[k])].layout == "interleaved":
        # n distinct image positions in [0, words): whether 0 is one was drawn with the
        # structure (`lead`), the others are uniform in [1, words).
        lead = int(st.lead[k])
        rest = 1 + rng.choice(words.size - 1, size=n - lead, replace=False)
        cuts = np.sort(np.concatenate([np.zeros(lead, dtype=np.int64), rest]))
    else:
        cuts = np.zeros(n, dtype=np.int64)
    run = np.full(sz.llm, _placeholder(sz.media), dtype=np.int64)
    pieces = np.split(words, cuts)
    text = np.concatenate([x for i, p in enumerate(pieces) for x in ((run, p) if i else (p,))])
    shape = (sz.media.in_channels, sz.image_side, sz.image_side)
    media[sz.media.name] = [rng.standard_normal(shape, dtype=np.float32) for _ in range(n)]
    if st.audio[k]:  # drawn after the images: the other draws stay those of the mixture
        mels = [
            rng.standard_normal((sz.audio.in_channels, f), dtype=np.float32)
            for f in _audio_frames(sz, st, k)
        ]
        media[sz.audio.name] = mels
        rows = _audio_counts(sz, st, k).placeholders
        runs = [np.full(r, _placeholder(sz.audio), dtype=np.int64) for r in rows]
        text = np.concatenate([*runs, text])
    labels = (~np.isin(text, [_placeholder(sz.media), *sz.reserved])).astype(np.uint8)
    return Sample(index, text, media, labels, source=source)


def _placeholder(spec: ModuleSpec) -> int:
    return modality(spec.kind).placeholder_id(spec)


class SyntheticSource:
    """The synthetic stream as a random-access, unbounded sample source for `BatchStream`.

    Caches the last few structure blocks, so reading metadata position by position stays cheap.
    """

    num_samples: int | None = None  # unbounded

    def __init__(
        self,
        mixture: MixtureSpec | str,
        *,
        model: MultimodalSpec,
        seed: int,
        scale: float = 1.0,
        image_size: int | None = None,
    ) -> None:
        self.model = model
        self.mixture = (get_mixture(mixture) if isinstance(mixture, str) else mixture).scaled(scale)
        self.seed = seed
        self._sizes = _sizes(self.mixture, model, image_size)
        self._blocks: dict[int, _Structure] = {}

    def _block(self, block: int) -> _Structure:
        if block not in self._blocks:
            if len(self._blocks) >= 4:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[block] = _draw_block(self.mixture, self.seed, block)
        return self._blocks[block]

    def metas(self, indices: Sequence[int]) -> list[SampleMeta | None]:
        """Metadata of the given stream positions (never None: synthetic samples are valid)."""
        out: list[SampleMeta | None] = []
        k = 0
        while k < len(indices):
            # Consecutive indices inside one block become one vectorised slice.
            first, end = indices[k], k + 1
            while (
                end < len(indices)
                and indices[end] == first + end - k
                and indices[end] // BLOCK == first // BLOCK
            ):
                end += 1
            b, lo = self._block(first // BLOCK), first % BLOCK
            out.extend(_metas(b.part(lo, lo + end - k), self._sizes, first))
            k = end
        return out

    def sample(self, index: int) -> Sample:
        """The arrays of stream position `index`."""
        b = self._block(index // BLOCK)
        return _sample(self.mixture, self._sizes, b, index % BLOCK, index, self.seed)
