"""`--dip-data`: which samples a run trains on, as `BatchStream`s (torch-free).

    synthetic-MIXTURE   the seeded synthetic stream (`data.synthetic.MIXTURES`: mixed, laion,
                        obelics, text-only for VLMs; t2v, t2i for diffusion), scaled by
                        --dip-data-scale, images of --dip-image-size pixels
    llava:JSON          a LLaVA-style JSON list (or JSON Lines) and its images
                        (`data.llava.LlavaDataset`), indexed by byte offsets
    energon:PATH        a Megatron-Energon dataset or metadataset blend (`data.energon`)
    latents:DIR         VAE latents and captions in the documented directory format
                        (`data.diffusion.LatentDataset`)

Real data is tokenized by the run's tokenizer (`--tokenizer-type`, `--tokenizer-model`) in its
prompt format (`--tokenizer-prompt-format`) and its images preprocessed by the vision model's
processor config (`--dip-image-processor`, `--dip-max-pixels`: `data.image`).

Evaluation reads the same source through a stream with another seed: the synthetic generator
with a different seed (unseen samples), an Energon dataset's `val` split when it has samples,
other datasets in another order (no held-out split).

Bad samples (--dip-bad-samples). A record the reader cannot use (missing or corrupt image or
latent file: every file is opened and verified when its metadata is read, malformed record) and
a sample that fits in no microbatch (more images than fit in the sequence, a caption longer than
it) either stop the run with an error naming the sample ("error") or are left out, counted in the
log line and logged once with the reason ("skip"); "truncate" cuts a text longer than
--dip-max-sample-tokens (default --seq-length; images kept, else the sample is skipped), counts
it, and skips the rest. All decisions come from metadata, which every rank reads identically,
and are taken when the batch is formed, so every rank stops at the same iteration before running
it (`BatchStream`). Pixels are decoded later, only by the ranks that need them; `load_agreed`
makes a failure there stop every rank together, naming the rank and sample.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from megatron_dip.data.image import DEFAULT_MAX_PIXELS, ImageProcessorConfig
from megatron_dip.data.packing import PackingLimits
from megatron_dip.data.records import BAD_SAMPLE_POLICIES, BadSampleError, SkipLog
from megatron_dip.data.sample import BatchMeta
from megatron_dip.data.stream import BatchStream, SampleSource, StreamConfig
from megatron_dip.data.synthetic import MIXTURES
from megatron_dip.data.tokenizer import TokenizerSpec
from megatron_dip.modelspec import MultimodalSpec

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
BAD_SAMPLES = BAD_SAMPLE_POLICIES
FILE_KINDS = ("llava", "energon", "latents")  # data read from files, through the tokenizer
T = TypeVar("T")


def image_config(
    *, processor: str | None, max_pixels: int | None, image_size: int | None
) -> ImageProcessorConfig:
    """The image preprocessing of real data (`data.image`: where max_pixels comes from)."""
    if processor is not None:
        config = ImageProcessorConfig.from_file(processor)
    else:
        side = image_size
        config = ImageProcessorConfig(max_pixels=side * side if side else DEFAULT_MAX_PIXELS)
    if max_pixels is not None:
        if max_pixels < 1:
            raise ValueError(f"--dip-max-pixels: must be >= 1, got {max_pixels}")
        min_pixels = config.min_pixels
        if min_pixels is not None and min_pixels > max_pixels:
            min_pixels = max_pixels  # the one limit wins over the config's floor
        config = dataclasses.replace(config, max_pixels=max_pixels, min_pixels=min_pixels)
    return config


@dataclass(frozen=True)
class DataSpec:
    """A parsed `--dip-data` value with what its readers need."""

    kind: str  # "synthetic", "llava", "energon", "latents"
    value: str  # mixture name or path
    scale: float = 1.0
    image_size: int | None = None
    bad_samples: str = "error"  # --dip-bad-samples: "error", "skip" or "truncate"
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    image: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)
    max_tokens: int | None = None  # --dip-max-sample-tokens (truncate: --seq-length)
    slots: int = 1  # Energon: DP x --num-workers
    cooker: str | None = None  # --dip-energon-cooker
    allow_outside_paths: bool = False  # --dip-allow-outside-paths
    # Every reader of the run's data logs each bad record once, through this (records.py).
    skip_log: SkipLog = field(default_factory=SkipLog, compare=False, repr=False)

    @classmethod
    def parse(
        cls,
        text: str,
        *,
        scale: float,
        image_size: int | None,
        bad_samples: str = "error",
        **readers,
    ) -> DataSpec:
        """Parse and check a `--dip-data` value; ValueError naming the flag otherwise.
        `readers`: the other fields (tokenizer, image, max_tokens, slots, cooker)."""
        if bad_samples not in BAD_SAMPLES:
            raise ValueError(
                f"--dip-bad-samples: choose {', '.join(BAD_SAMPLES)}, got {bad_samples!r}"
            )
        if "image" not in readers:
            readers["image"] = image_config(processor=None, max_pixels=None, image_size=image_size)
        if text.startswith("synthetic-"):
            mixture = text.removeprefix("synthetic-")
            if mixture not in MIXTURES:
                raise ValueError(
                    f"--dip-data: unknown synthetic mixture {mixture!r}; known: "
                    + ", ".join(f"synthetic-{m}" for m in MIXTURES)
                )
            return cls("synthetic", mixture, scale, image_size, bad_samples, **readers)
        kind, sep, path = text.partition(":")
        if not sep or kind not in FILE_KINDS or not path:
            raise ValueError(
                f"--dip-data: {text!r} is not synthetic-MIXTURE, llava:JSON, energon:PATH or "
                "latents:DIR"
            )
        if not Path(path).exists():
            raise ValueError(f"--dip-data: {path} does not exist")
        return cls(kind, path, scale, image_size, bad_samples, **readers)

    @property
    def reads_text(self) -> bool:
        """Whether the data is text the run's tokenizer encodes (not synthetic ids)."""
        return self.kind in FILE_KINDS

    def check_model(self, model: MultimodalSpec) -> None:
        """ValueError unless the data suits the model: the modules its instances need exist
        (images: a "vit"; latent clips: a "dit"; audio: an "audio" module)."""
        needs = {"llava": {"vit"}, "energon": {"vit"}, "latents": {"dit"}}.get(self.kind)
        what = f"{self.kind} data"
        if self.kind == "synthetic":
            mixture = MIXTURES[self.value]
            needs, what = mixture.needs, f"mixture {self.value!r} ({mixture.kind} data)"
        have = {m.kind for m in model.modules}
        if not needs <= have:
            raise ValueError(
                f"--dip-data: {what} needs module kinds {sorted(needs)}, the model "
                f"{model.name!r} has {sorted(have)}"
            )

    def reader_config(self):
        """The image-text readers' `ReaderConfig`."""
        from megatron_dip.data.image_text import ReaderConfig

        return ReaderConfig(
            tokenizer=self.tokenizer,
            image=self.image,
            on_bad_sample=self.bad_samples,
            max_tokens=self.max_tokens,
            allow_outside_paths=self.allow_outside_paths,
            skip_log=self.skip_log,
        )

    def source(self, model: MultimodalSpec, *, seed: int, evaluation: bool = False) -> SampleSource:
        """The sample source (metadata is read lazily)."""
        if self.kind == "synthetic":
            from megatron_dip.data.synthetic import SyntheticSource

            return SyntheticSource(
                self.value, model=model, seed=seed, scale=self.scale, image_size=self.image_size
            )
        if self.kind == "llava":
            from megatron_dip.data.llava import LlavaDataset

            if evaluation:
                self._note_no_validation_split("a LLaVA file has no validation split")
            return LlavaDataset(self.value, model=model, config=self.reader_config())
        if self.kind == "energon":
            from megatron_dip.data.energon import EnergonSource, has_samples

            split = "val" if evaluation and has_samples(self.value, split="val") else "train"
            if evaluation and split == "train":
                self._note_no_validation_split("its 'val' split has no samples")
            return EnergonSource(
                self.value,
                model=model,
                config=self.reader_config(),
                seed=seed,
                slots=self.slots,
                split=split,
                cooker=self.cooker,
            )
        from megatron_dip.data.diffusion import LatentConfig, LatentDataset

        if evaluation:
            self._note_no_validation_split("a latents directory has no validation split")

        config = LatentConfig(
            on_bad_sample=self.bad_samples,
            tokenizer=self.tokenizer,
            allow_outside_paths=self.allow_outside_paths,
            skip_log=self.skip_log,
        )
        return LatentDataset(self.value, model=model, config=config)

    def _note_no_validation_split(self, why: str) -> None:
        """Say that evaluation reads the training data (Megatron-LM evaluates on the blend's
        validation split; a run without one still evaluates, but not on held-out data)."""
        logger.warning(
            "evaluation: --dip-data %s:%s has no validation split (%s): evaluating on its "
            "training data in another order, so the validation loss is not held out; for a "
            "held-out loss give Energon data with a 'val' split",
            self.kind,
            self.value,
            why,
        )


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
    # Sources that order themselves (synthetic, Energon) take the evaluation seed too.
    source_seed = seed + EVAL_SEED_OFFSET if evaluation and spec.kind != "llava" else seed
    stream_seed = seed + EVAL_SEED_OFFSET if evaluation else seed
    return BatchStream(
        spec.source(model, seed=source_seed, evaluation=evaluation),
        config=StreamConfig(
            seed=stream_seed,
            batch_microbatches=global_batch_size,
            limits=limits,
            on_oversize="error" if spec.bad_samples == "error" else "skip",
        ),
    )


def batch_fingerprint(batch: BatchMeta) -> int:
    """A checksum of a batch's metadata, equal on ranks that formed the same batch."""
    return zlib.crc32(repr((batch.iteration, batch.samples)).encode()) & 0x7FFFFFFF


def load_agreed(
    load: Callable[[], T], *, batch: BatchMeta, rank: int, device, group=None, wait=None
) -> T:
    """`load()` (this rank's samples of `batch`), with the outcome agreed by every rank of
    `group` (default: the world) before any of them goes on into the pipeline.

    A rank whose load fails (a file deleted or corrupted after its metadata was read) would
    otherwise leave its peers waiting for it forever, and a rank that formed another batch (its
    metadata read differently, e.g. a file readable on some ranks only) would train on other
    data. One small all-gather per iteration; on either, every rank raises the same error,
    naming the ranks at fault and their reasons. `wait(work)`: waits for the all-gather
    (`PhaseWatch.wait`, bounded by --dip-comm-timeout-s); default: an unbounded wait.
    """
    import torch
    import torch.distributed as dist

    try:
        result, error = load(), None
    except Exception as err:  # any failure to build a sample's arrays stops every rank
        result, error = None, f"rank {rank}: {err}"
    mine = torch.tensor(
        [0 if error is None else 1, batch_fingerprint(batch)], dtype=torch.int64, device=device
    )
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    if wait is None:
        work.wait()
    else:
        wait(work)
    prints = [int(row[1]) for row in rows]
    if len(set(prints)) > 1:
        raise BadSampleError(
            f"batch {batch.iteration}: the ranks formed different batches (metadata read "
            f"differently; checksums by rank {prints}), every rank stops"
        )
    if not any(int(row[0]) for row in rows):
        return result
    errors: list = [None] * len(rows)
    dist.all_gather_object(errors, error, group=group)
    reasons = "; ".join(e for e in errors if e is not None)
    raise BadSampleError(
        f"batch {batch.iteration}: samples failed to load, every rank stops: {reasons}"
    )
