"""`--dip-data`: which samples a run trains on, as `BatchStream`s (torch-free).

    synthetic-MIXTURE   the seeded synthetic stream (`data.synthetic.MIXTURES`: mixed, laion,
                        obelics, text-only for VLMs; t2v, t2i for diffusion), scaled by
                        --dip-data-scale, images of --dip-image-size pixels
    llava:JSON          a LLaVA-style JSON list and its images (`data.llava.LlavaDataset`);
                        --dip-image-size caps the longer image side
    latents:DIR         VAE latents and captions in the documented directory format
                        (`data.diffusion.LatentDataset`)

Evaluation reads the same source through a stream with another seed: the synthetic generator
with a different seed (unseen samples), a dataset in another order (no held-out split).
Bad or oversize records are skipped, logged and counted (never a crash inside the pipeline).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from megatron_dip.data.packing import PackingLimits
from megatron_dip.data.stream import BatchStream, SampleSource, StreamConfig
from megatron_dip.data.synthetic import MIXTURES
from megatron_dip.modelspec import ModuleKind, MultimodalSpec

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class DataSpec:
    """A parsed `--dip-data` value."""

    kind: str  # "synthetic", "llava", "latents"
    value: str  # mixture name or path
    scale: float = 1.0
    image_size: int | None = None

    @classmethod
    def parse(cls, text: str, *, scale: float, image_size: int | None) -> DataSpec:
        """Parse and check a `--dip-data` value; ValueError naming the flag otherwise."""
        if text.startswith("synthetic-"):
            mixture = text.removeprefix("synthetic-")
            if mixture not in MIXTURES:
                raise ValueError(
                    f"--dip-data: unknown synthetic mixture {mixture!r}; known: "
                    + ", ".join(f"synthetic-{m}" for m in MIXTURES)
                )
            return cls("synthetic", mixture, scale, image_size)
        kind, sep, path = text.partition(":")
        if not sep or kind not in ("llava", "latents") or not path:
            raise ValueError(
                f"--dip-data: {text!r} is not synthetic-MIXTURE, llava:JSON or latents:DIR"
            )
        if not Path(path).exists():
            raise ValueError(f"--dip-data: {path} does not exist")
        return cls(kind, path, scale, image_size)

    def check_model(self, model: MultimodalSpec) -> None:
        """ValueError unless the data suits the model (VLM data for a VLM, latents for a DiT)."""
        diffusion = model.loss_module.kind is ModuleKind.DIT
        if self.kind == "synthetic":
            wants = MIXTURES[self.value].kind
            if (wants == "diffusion") != diffusion:
                raise ValueError(
                    f"--dip-data: mixture {self.value!r} is {wants} data, the model "
                    f"{model.name!r} is {'a diffusion model' if diffusion else 'a VLM'}"
                )
        elif (self.kind == "latents") != diffusion:
            raise ValueError(f"--dip-data: {self.kind} data does not suit model {model.name!r}")

    def source(self, model: MultimodalSpec, *, seed: int) -> SampleSource:
        """The sample source (metadata is read lazily)."""
        if self.kind == "synthetic":
            from megatron_dip.data.synthetic import SyntheticSource

            return SyntheticSource(
                self.value, model=model, seed=seed, scale=self.scale, image_size=self.image_size
            )
        if self.kind == "llava":
            from megatron_dip.data.llava import LlavaConfig, LlavaDataset

            config = LlavaConfig(on_bad_sample="skip")
            if self.image_size is not None:
                config = LlavaConfig(max_side=self.image_size, on_bad_sample="skip")
            return LlavaDataset(self.value, model=model, config=config)
        from megatron_dip.data.diffusion import LatentConfig, LatentDataset

        return LatentDataset(self.value, model=model, config=LatentConfig(on_bad_sample="skip"))


def packing_limits(model: MultimodalSpec, seq_length: int) -> PackingLimits:
    """VLM: packed sequences of `seq_length`; diffusion: <= 8 clips / 64 latent frames, captions
    within `seq_length` tokens."""
    if model.loss_module.kind is ModuleKind.DIT:
        return PackingLimits(seq_length=seq_length, max_instances=8, max_frames=64)
    return PackingLimits.vlm(seq_length=seq_length)


def make_stream(
    spec: DataSpec,
    model: MultimodalSpec,
    *,
    seed: int,
    global_batch_size: int,
    limits: PackingLimits,
    evaluation: bool = False,
) -> BatchStream:
    """The training (or evaluation) stream of `global_batch_size` packed microbatches."""
    source_seed = seed + EVAL_SEED_OFFSET if evaluation and spec.kind == "synthetic" else seed
    stream_seed = seed + EVAL_SEED_OFFSET if evaluation else seed
    return BatchStream(
        spec.source(model, seed=source_seed),
        config=StreamConfig(
            seed=stream_seed,
            batch_microbatches=global_batch_size,
            limits=limits,
            on_oversize="skip",
        ),
    )
