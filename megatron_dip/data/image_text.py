"""The path shared by the image-text readers (LLaVA JSON, Megatron-Energon) from a record to its
metadata and its sample.

A reader turns record i into a `Record`: its turns (`chat.Turn`, "<image>" tags in the text) and
its images as `ImageSource`s, whose size is known without decoding pixels. Metadata: each image's
size after preprocessing (`image.ImageProcessor.target_size`), its ViT patches and LLM tokens,
the text encoded in the run's prompt format with a placeholder run per image
(`chat.make_encoder`), and the loss tokens. The sample: the same text, and each image decoded and
preprocessed (float32 [3, H, W]). Images feed the model's module whose placeholder role is
"image" (the ViT); its placeholder id and the text's vocabulary are the model's, set from the
run's tokenizer.

Too long (`max_tokens`, --dip-max-sample-tokens): with on_bad_sample="truncate" the text is cut
to it (images kept; a sample whose images would be cut, or that keeps no loss token, is skipped),
counted in `truncated`; otherwise such a record is bad (an error or a skip). A record without
any loss token is bad too (it would train nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from megatron_dip.modalities import media_modules, modality_of, text_module
from megatron_dip.modalities.llm import loss_targets, placeholder_ids
from megatron_dip.modalities.vit import image_tokens
from megatron_dip.modelspec import ModuleSpec, MultimodalSpec

from .chat import Turn, fit_tokens, make_encoder
from .image import ImageProcessor, ImageProcessorConfig
from .records import BadSampleError, OnBadSample, RecordReader, SkipLog
from .sample import InstanceCounts, Sample, SampleMeta
from .tokenizer import ByteTokenizer, TokenizerSpec, load_tokenizer


class ImageSource(Protocol):
    """One image of a record."""

    def size(self) -> tuple[int, int]:
        """(width, height) in pixels, without decoding the pixels."""
        ...

    def open(self, *, target: tuple[int, int] | None = None):
        """The decoded image (a PIL image); `target` (H, W): the size it is resized to, so a
        huge JPEG may decode at a reduced scale (`image.draft`)."""
        ...


@dataclass(frozen=True)
class Record:
    """One record's text and images (module docstring)."""

    turns: tuple[Turn, ...]
    images: tuple[ImageSource, ...] = ()


@dataclass(frozen=True)
class ReaderConfig:
    """How records become samples: tokenizer and prompt format, image preprocessing, bad
    samples and the truncation length; whether image paths may leave the dataset root
    (--dip-allow-outside-paths); the run's `SkipLog` (every reader of a run's data shares
    one, so each bad record is logged once per rank)."""

    tokenizer: TokenizerSpec = TokenizerSpec()
    image: ImageProcessorConfig = ImageProcessorConfig()
    on_bad_sample: OnBadSample = "error"
    max_tokens: int | None = None
    allow_outside_paths: bool = False
    skip_log: SkipLog | None = field(default=None, compare=False)


def image_module(model: MultimodalSpec) -> ModuleSpec | None:
    """The module fed by images (placeholder role "image"), or None."""
    for spec in media_modules(model):
        if getattr(modality_of(spec), "placeholder_role", "") == "image":
            return spec
    return None


class ImageTextReader(RecordReader):
    """Base of the image-text readers: subclasses give `record` and `describe`."""

    def __init__(self, *, model: MultimodalSpec, num_samples: int, config: ReaderConfig) -> None:
        text = text_module(model)
        if text.name != model.loss_module.name:
            raise ValueError(f"model {model.name!r} has no language model reading the text")
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        if text.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(
                f"the LLM vocabulary ({text.vocab_size}) is smaller than the tokenizer's "
                f"({self.tokenizer.vocab_size})"
            )
        self._vit = image_module(model)
        image_id = None if self._vit is None else modality_of(self._vit).placeholder_id(self._vit)
        own = self.tokenizer.special_id("image")
        if (
            image_id is not None
            and not isinstance(self.tokenizer, ByteTokenizer)
            and own != image_id
        ):
            raise ValueError(
                f"module {self._vit.name!r}'s placeholder id {image_id} is not the tokenizer's "
                f"image token ({own}); build the model with the tokenizer's ids "
                "(training.config.validate does)"
            )
        self.encoder = make_encoder(
            self.tokenizer, config.tokenizer.prompt_format, image_id=image_id
        )
        self._placeholders = placeholder_ids(model, text.name)
        self.processor = None
        if self._vit is not None:
            config.image.check_vit(patch=self._vit.patch_size, merge=self._vit.merge)
            factor = self._vit.patch_size * self._vit.merge
            self.processor = ImageProcessor(config.image, factor=factor)
        super().__init__(
            model=model,
            num_samples=num_samples,
            on_bad_sample=config.on_bad_sample,
            skip_log=config.skip_log,
        )

    def record(self, index: int, *, pixels: bool) -> Record:
        """Record `index`; `pixels=False`: its images need only tell their size."""
        raise NotImplementedError

    def _sizes(self, record: Record) -> list[tuple[int, int]]:
        """(H, W) of each image after preprocessing."""
        if record.images and self.processor is None:
            raise BadSampleError(f"{len(record.images)} images, but the model has no image module")
        sizes = []
        for i, image in enumerate(record.images):
            try:
                width, height = image.size()
                sizes.append(self.processor.target_size(height=height, width=width))
            except (OSError, ValueError) as err:
                raise BadSampleError(f"image {i}: {err}") from err
        return sizes

    def _read_meta(self, index: int) -> SampleMeta:
        record = self.record(index, pixels=False)
        counts = [image_tokens(height=h, width=w, vit=self._vit) for h, w in self._sizes(record)]
        text, mask = self._encode(index, record, [t for _, t in counts])
        loss = int(loss_targets(text, mask, placeholders=self._placeholders).sum())
        instances = {}
        if counts:
            patches, llm = tuple(p for p, _ in counts), tuple(t for _, t in counts)
            instances = {self._vit.name: InstanceCounts(patches, llm)}
        return SampleMeta(index, int(text.size), instances, loss_tokens=loss)

    def _read_sample(self, index: int) -> Sample:
        record = self.record(index, pixels=True)
        sizes, bad = self._planned_sizes(index, record)
        images = []
        for i, (image, size) in enumerate(zip(record.images, sizes)):
            pixels = None
            try:
                if bad is None:  # once one image is bad, the sample trains on nothing
                    pixels = self._decode(i, image, size)
            except BadSampleError as err:
                if self.config.on_bad_sample == "error":
                    raise
                bad = str(err)
            # The plan counts on this sample's shapes: keep them, train on nothing.
            images.append(np.zeros((3, *size), np.float32) if pixels is None else pixels)
        llm = [image_tokens(height=h, width=w, vit=self._vit)[1] for h, w in sizes]
        text, mask = self._encode(index, record, llm)
        if bad is not None:
            mask = np.zeros_like(mask)
        media = {} if self._vit is None else {self._vit.name: images}
        return Sample(index, text, media, mask, bad=bad)

    def _planned_sizes(
        self, index: int, record: Record
    ) -> tuple[list[tuple[int, int]], str | None]:
        """The images' sizes from their headers, and None; or, when a header cannot be read
        (an Energon image corrupt after `energon prepare`, whose metadata came from the index)
        outside "error" mode, the sizes the metadata was planned with and why."""
        try:
            return self._sizes(record), None
        except BadSampleError as err:
            if self.config.on_bad_sample == "error":
                raise
            return self._sizes(self.record(index, pixels=False)), str(err)

    def _decode(self, i: int, image: ImageSource, size: tuple[int, int]) -> np.ndarray:
        """Image `i` decoded and preprocessed to `size` (its header's), or BadSampleError."""
        try:
            pixels = self.processor.preprocess(image.open(target=size))
        except Exception as err:  # Pillow raises many types for broken files
            raise BadSampleError(f"cannot decode image {i}: {err}") from err
        if pixels.shape[1:] != size:
            raise BadSampleError(f"image {i} decodes to {pixels.shape}, its header {size}")
        return pixels

    def _encode(
        self, index: int, record: Record, llm_tokens: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        text, mask = self.encoder.encode(record.turns, image_tokens=llm_tokens)
        limit = self.config.max_tokens
        if limit is not None and text.size > limit:
            if self.config.on_bad_sample != "truncate":
                raise BadSampleError(
                    f"{text.size} tokens, more than --dip-max-sample-tokens {limit} "
                    "(or cut them: --dip-bad-samples truncate)"
                )
            kept, kept_mask = fit_tokens(
                text, mask, max_tokens=limit, placeholders=self._placeholders
            )
            self.note_truncated(index, int(text.size), int(kept.size))
            text, mask = kept, kept_mask
        if not loss_targets(text, mask, placeholders=self._placeholders).any():
            raise BadSampleError("no loss token (no assistant turn with text)")
        return text, mask
