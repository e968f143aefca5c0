"""Data mixtures in token units: sources, their weights, and how they are blended.

A `MixtureSpec` describes data independent of the model: text lengths, images or clips per
sample, image size as LLM tokens per side (13 x 13 = 169 tokens, as in the paper), video frames
as DiT tokens per latent-frame side, clip durations in seconds; `data.synthetic` draws seeded
samples from it and the model fixes pixel and latent sizes.

Two ways to blend sources (`MixtureSpec.blend`):

* "sample": each sample draws its source by weight and samples of any source share a packed
  sequence; packing evens the microbatches out.
* "sequence": as Megatron's `BlendedDataset` (over datasets of packed sequences) and an Energon
  blend of packed datasets do, each packed sequence (microbatch) holds samples of ONE source
  and the weights are shares of sequences. Samples carry their source (`SampleMeta.source`),
  the packer never mixes sources, and each source's per-sample draw probability is its weight
  over its expected footprint in a sequence (`MixtureSpec.draw_weights`), so sequence shares
  follow the weights. Far more uneven microbatches: a LAION sequence holds ~47 images, an
  OBELICS one a handful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal

from megatron_dip.modelspec import MultimodalSpec

MixtureKind = Literal["vlm", "diffusion"]
Blend = Literal["sample", "sequence"]
Grids = tuple[tuple[int, int], ...]
# The paper's text-to-video microbatch (`PackingLimits.t2v`): the footprint of a clip in it.
_T2V_CLIPS, _T2V_FRAMES = 8, 64


def _log_uniform_mean(lo: float, hi: float) -> float:
    """Mean of floor(x), x log-uniform on [lo, hi + 1) (`synthetic`'s integer draws)."""
    a, b = float(lo), float(hi) + 1.0
    return (b - a) / math.log(b / a) - 0.5 if b > a else a


@dataclass(frozen=True)
class SourceSpec:
    """One kind of sample in a mixture. Ranges are inclusive.

    `instances`: images (VLM) or clips (diffusion) per sample. `layout`: "image_first" puts the
    images before the text (captioning data), "interleaved" places them at random distinct
    positions inside the text (documents). `seconds`: clip duration range for diffusion video;
    None makes still images (one latent frame). `audio`: audio segments per sample (VLM
    mixtures), each of `audio_seconds`. `frame_grids`: the latent grids of this source's
    frames when they differ from the mixture's (a blend of 256p video and 512p images).
    """

    name: str
    weight: float
    text_tokens: tuple[int, int]
    instances: tuple[int, int] = (0, 0)
    layout: Literal["image_first", "interleaved"] = "image_first"
    seconds: tuple[float, float] | None = None
    audio: tuple[int, int] = (0, 0)
    audio_seconds: tuple[float, float] = (2.0, 30.0)
    frame_grids: Grids | None = None  # diffusion: this source's grids (None: the mixture's)

    def __post_init__(self) -> None:
        lo, hi = self.text_tokens
        if self.weight <= 0 or not 1 <= lo <= hi:
            raise ValueError(f"source {self.name!r}: need weight > 0 and 1 <= text range: {self}")
        for what, (a, b) in (("instance", self.instances), ("audio", self.audio)):
            if not 0 <= a <= b:
                raise ValueError(f"source {self.name!r}: bad {what} range {(a, b)}")
        for what, r in (("duration", self.seconds), ("audio duration", self.audio_seconds)):
            if r is not None and not 0 < r[0] <= r[1]:
                raise ValueError(f"source {self.name!r}: bad {what} range {r}")
        if self.frame_grids is not None and (
            not self.frame_grids or min(min(g) for g in self.frame_grids) < 1
        ):
            raise ValueError(f"source {self.name!r}: frame grids must be >= 1")


@dataclass(frozen=True)
class MixtureSpec:
    """A weighted mixture of sources of one data kind: "vlm" (a text sequence with placeholders,
    images for a ViT, audio for an audio encoder) or "diffusion" (captions and latent clips).

    `image_grid`: VLM images are square with image_grid^2 LLM tokens. `frame_grids`: diffusion
    latent frames of (rows, cols) DiT tokens, one drawn uniformly per sample. Video frames come
    at `fps`; the VAE keeps 1 + (frames - 1) // temporal_compression latent frames and divides
    each pixel side by `spatial_compression`. Word ids are uniform, or with `word_zipf` > 0
    Zipf-distributed (rank r with probability ~ r^-word_zipf), which a tiny model can learn.
    `blend`: "sample" or "sequence" (see the module docstring).
    """

    name: str
    kind: MixtureKind
    sources: tuple[SourceSpec, ...]
    image_grid: int = 13
    frame_grids: tuple[tuple[int, int], ...] = ((16, 16),)
    fps: int = 16
    temporal_compression: int = 4
    spatial_compression: int = 8
    word_zipf: float = 0.0  # > 0: word ids Zipf-distributed with this exponent (learnable)
    blend: Blend = "sample"

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError(f"mixture {self.name!r} has no sources")
        if self.word_zipf < 0:
            raise ValueError(f"mixture {self.name!r}: word_zipf must be >= 0")
        if self.image_grid < 1 or not self.frame_grids or min(min(g) for g in self.frame_grids) < 1:
            raise ValueError(f"mixture {self.name!r}: grids must be >= 1")
        if self.blend not in ("sample", "sequence"):
            raise ValueError(f"mixture {self.name!r}: blend must be 'sample' or 'sequence'")

    def grids_of(self, source: SourceSpec) -> Grids:
        """The latent-frame grids `source`'s frames are drawn from."""
        return source.frame_grids or self.frame_grids

    def footprint(self, source: SourceSpec) -> float:
        """Expected share of one packed sequence a sample of `source` takes, in the unit that
        binds: LLM tokens (text and image placeholders; audio left out) for a VLM, the larger
        of the clip and latent-frame shares of the paper's 8-clip / 64-frame microbatch for a
        diffusion model."""
        instances = sum(source.instances) / 2
        if self.kind == "vlm":
            text = _log_uniform_mean(*source.text_tokens)
            return text + instances * self.image_grid**2
        frames = 1.0
        if source.seconds is not None:
            lo, hi = source.seconds
            seconds = (hi - lo) / math.log(hi / lo) if hi > lo else lo
            frames = 1 + (seconds * self.fps - 1) / self.temporal_compression
        return instances * max(1 / _T2V_CLIPS, frames / _T2V_FRAMES)

    def draw_weights(self) -> tuple[float, ...]:
        """Per-sample source probabilities (normalised): the weights themselves when blending
        per sample; weight / footprint when blending per sequence, so that the sources' shares
        of packed sequences follow the weights."""
        raw = [s.weight for s in self.sources]
        if self.blend == "sequence":
            raw = [w / max(self.footprint(s), 1e-9) for w, s in zip(raw, self.sources)]
        total = sum(raw)
        return tuple(w / total for w in raw)

    @property
    def has_audio(self) -> bool:
        """Whether some source draws audio segments."""
        return any(s.audio[1] > 0 for s in self.sources)

    @property
    def needs(self) -> frozenset[str]:
        """The module kinds a model needs for this data: where its instances go."""
        return frozenset(
            {"vit" if self.kind == "vlm" else "dit"} | ({"audio"} if self.has_audio else set())
        )

    def suits(self, model: MultimodalSpec) -> bool:
        """Whether `model` has modules for all of this mixture's instances."""
        return self.needs <= {m.kind for m in model.modules}

    def scaled(self, factor: float) -> MixtureSpec:
        """A copy whose text lengths and per-image/per-frame token counts shrink by ~`factor`.

        Image and frame sides shrink by sqrt(factor) so their token areas follow the text and a
        packed sequence keeps about as many images; audio durations shrink by `factor` (their
        tokens are linear in time). Counts and clip durations stay as they are.
        """
        if factor <= 0:
            raise ValueError(f"scale factor must be positive, got {factor}")
        if factor == 1:
            return self

        def side(g: int) -> int:
            return max(1, round(g * math.sqrt(factor)))

        def text(r: tuple[int, int]) -> tuple[int, int]:
            lo = max(1, round(r[0] * factor))
            return lo, max(lo, round(r[1] * factor))

        def audio(r: tuple[float, float]) -> tuple[float, float]:
            return r[0] * factor, r[1] * factor

        def grids(gs: Grids | None) -> Grids | None:
            return None if gs is None else tuple((side(h), side(w)) for h, w in gs)

        sources = tuple(
            replace(
                s,
                text_tokens=text(s.text_tokens),
                audio_seconds=audio(s.audio_seconds),
                frame_grids=grids(s.frame_grids),
            )
            for s in self.sources
        )
        return replace(
            self,
            name=f"{self.name}@{factor:g}",
            sources=sources,
            image_grid=side(self.image_grid),
            frame_grids=grids(self.frame_grids),
        )


_LAION = SourceSpec("laion", 1.0, (5, 60), (1, 1), "image_first")
_OBELICS = SourceSpec("obelics", 1.0, (300, 3000), (0, 6), "interleaved")
_TEXT = SourceSpec("text", 1.0, (100, 4000))
_SPEECH = SourceSpec("speech", 1.0, (10, 200), audio=(1, 1), audio_seconds=(2.0, 30.0))
_AVQA = SourceSpec("av-qa", 0.5, (10, 120), (1, 1), audio=(1, 2), audio_seconds=(2.0, 15.0))
_VIDEO = SourceSpec("video", 1.0, (20, 200), (1, 1), seconds=(2.0, 16.0))
_STILL = SourceSpec("image", 1.0, (10, 120), (1, 1))
_VIDEO_GRIDS = ((16, 16), (16, 28), (28, 16))  # 256x256, 256x448, 448x256 pixels at 8x and p=2
_IMAGE_GRIDS = ((32, 32), (32, 56), (56, 32))  # 512p stills
_STILL_512 = replace(_STILL, frame_grids=_IMAGE_GRIDS)

MIXTURES: MappingProxyType[str, MixtureSpec] = MappingProxyType(
    {
        "laion": MixtureSpec("laion", "vlm", (_LAION,)),
        "obelics": MixtureSpec("obelics", "vlm", (_OBELICS,)),
        "mixed": MixtureSpec("mixed", "vlm", (_LAION, _OBELICS)),
        "mixed-blend": MixtureSpec("mixed-blend", "vlm", (_LAION, _OBELICS), blend="sequence"),
        "text-only": MixtureSpec("text-only", "vlm", (_TEXT,)),
        "omni": MixtureSpec("omni", "vlm", (_LAION, _SPEECH, _AVQA, _OBELICS), word_zipf=1.1),
        "t2v": MixtureSpec("t2v", "diffusion", (_VIDEO,), frame_grids=_VIDEO_GRIDS),
        "t2i": MixtureSpec("t2i", "diffusion", (_STILL,), frame_grids=_IMAGE_GRIDS),
        "t2v-mixed": MixtureSpec(
            "t2v-mixed", "diffusion", (_VIDEO, _STILL_512), frame_grids=_VIDEO_GRIDS
        ),
        "t2v-blend": MixtureSpec(
            "t2v-blend",
            "diffusion",
            (_VIDEO, _STILL_512),
            frame_grids=_VIDEO_GRIDS,
            blend="sequence",
        ),
    }
)


def get_mixture(name: str) -> MixtureSpec:
    """The preset mixture `name` (see `MIXTURES`); raises KeyError listing the presets."""
    try:
        return MIXTURES[name]
    except KeyError:
        raise KeyError(f"unknown mixture {name!r}; presets: {sorted(MIXTURES)}") from None


__all__ = ["MIXTURES", "Blend", "MixtureKind", "MixtureSpec", "SourceSpec", "get_mixture"]
