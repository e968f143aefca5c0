"""Megatron-Energon datasets (`--dip-data energon:PATH`) as a `SampleSource` for `BatchStream`.

PATH is an Energon-prepared WebDataset (`energon prepare`: tar shards, `.nv-meta/` with the index,
`split.yaml` and `dataset.yaml`) or a metadataset yaml blending several by weight (`blend:` with
`weight:`; `blend_epochized:` repetitions become weights proportional to repetitions x size).
Energon resolves the paths, splits, sample types and field maps (`load_dataset(...)
.get_datasets(...)`); samples are read by index through Energon's tar index
(`ShardInfosITarReader`) and built by the dataset's own `load_sample` (field map or sample
loader), so every Energon sample type it defines loads as Energon loads it. Supported types:
`CaptioningSample` (a user turn "<image>\\n" + `CAPTION_PROMPT`, the caption as the answer),
`VQASample` (the context as the question, the best-weighted answer), `InterleavedSample` (one
document: text and images in order, loss on all text), our `ConversationSample` (LLaVA-style
turns and images: what `tools/llava_to_energon.py` writes), and crude datasets (`CrudeWebdataset`)
whose samples a cooker turns into one of these: our `LLAVA_COOKER` (subflavor
`megatron_dip: llava`) and the cookers named by `--dip-energon-cooker MODULE:NAME` (a cooker
function, an energon `Cooker`, a list of them, or a `TaskEncoder` with `cookers`).

Images are never decoded for metadata. They reach sample loaders and cookers as `EncodedImage`s
(pass them through into the sample's image field). The planner's lookahead reads each sample's
parts except its images, and the image sizes from Energon's media metadata in the index
(`energon prepare --media-metadata-by-extension`, which our converter runs); a dataset prepared
without it has its image headers read instead (the image bytes are read, not decoded). The
pixels are decoded and preprocessed only when a replica loads its samples.

Order: `energon_order` (blend by weight, Energon's shard split over `slots` global workers);
every rank reads the same metadata and forms the same global batches. The evaluation stream
reads the `val` split when it has samples, else the training split in another order.
"""

from __future__ import annotations

import importlib
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from megatron_dip.modelspec import MultimodalSpec

from .chat import DOCUMENT, IMAGE_TAG, Turn, llava_turns
from .energon_order import BlendOrder, SliceOrder
from .image_text import ImageTextReader, ReaderConfig, Record
from .records import BadSampleError
from .sample import Sample, SampleMeta

try:
    from megatron.energon import (
        CaptioningSample,
        Cooker,
        CrudeSample,
        InterleavedSample,
        VQASample,
        WorkerConfig,
        load_dataset,
    )
    from megatron.energon.edataclass import edataclass
    from megatron.energon.flavors.base_dataset import Sample as EnergonSample
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory
    from megatron.energon.flavors.webdataset.indexing import SqliteIndexReader
    from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
    from megatron.energon.flavors.webdataset.sample_decoder import SampleDecoder
    from megatron.energon.media.metadata import deserialize_media_metadata
    from webdataset.autodecode import IMAGE_EXTENSIONS, Decoder
except ImportError as err:  # an optional dependency: only --dip-data energon:PATH needs it
    raise ImportError(
        f"--dip-data energon:PATH needs megatron-energon: pip install megatron-energon ({err})"
    ) from err

logger = logging.getLogger(__name__)

CAPTION_PROMPT = "Give a short description of the image."
MAX_SAMPLES_PER_SEQUENCE = 100  # Energon's slice length: consecutive samples read from a shard
_IMAGE_EXTENSIONS = frozenset(IMAGE_EXTENSIONS) | {"jpg", "jpeg", "png", "webp"}
_INDEX = ".nv-meta/index.sqlite"


@dataclass(frozen=True)
class EncodedImage:
    """An image part of an Energon sample, not decoded: its entry name ("key.part"), its bytes
    (None when only its size was read) and its size when Energon's media metadata gives it."""

    entry: str
    data: bytes | None = None
    width: int | None = None
    height: int | None = None

    def size(self) -> tuple[int, int]:
        """(width, height), from the media metadata or the image header."""
        if self.width is not None and self.height is not None:
            return self.width, self.height
        if self.data is None:
            raise BadSampleError(f"{self.entry}: neither bytes nor media metadata")
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as im:
            return im.size

    def open(self, *, target: tuple[int, int] | None = None):
        """The decoded image (`target`: see `image_text.ImageSource.open`)."""
        from PIL import Image

        from .image import draft

        if self.data is None:
            raise BadSampleError(f"{self.entry}: its bytes were not read")
        with Image.open(io.BytesIO(self.data)) as im:
            draft(im, target)  # a huge JPEG decodes at a reduced scale
            return im.copy()  # decoded; converted by the image processor


@edataclass
class ConversationSample(EnergonSample):
    """LLaVA-style turns ({"from", "value"} or {"role", "content"}; "<image>" tags) and images."""

    conversation: list
    images: list


def is_image_part(part: str) -> bool:
    """Whether a sample part ("jpg", "img0.png", ...) is an image."""
    return part.rsplit(".", 1)[-1].lower() in _IMAGE_EXTENSIONS


class PassImages(SampleDecoder):
    """Energon's decoder minus the image decoding: text, json, ... are decoded as usual; images
    stay `EncodedImage`s (placed by the reader)."""

    def __init__(self) -> None:
        super().__init__()
        self._decoder = Decoder([], partial=True)

    def config(self) -> dict:
        return {"images": "EncodedImage (megatron-dip decodes them)"}


class _ImagePartsAside:
    """A tar part filter that keeps the dataset's parts except images, noting the image parts."""

    def __init__(self, keep) -> None:
        self.keep, self.images = keep, []

    def __call__(self, part: str) -> bool:
        if self.keep is not None and not self.keep(part):
            return False
        if is_image_part(part):
            self.images.append(part)
            return False
        return True


def cook_llava(sample: dict) -> ConversationSample:
    """The built-in cooker of crude LLaVA records (tools/llava_to_energon.py): a "json" part with
    "conversations" and "images" (the image part names, in order), and those image parts."""
    record = sample.get("json")
    if not isinstance(record, dict):
        raise BadSampleError("a crude LLaVA sample needs a 'json' part holding an object")
    names = record.get("images", [])
    missing = [n for n in names if n not in sample]
    if missing:
        raise BadSampleError(f"image parts {missing} named by 'images' are not in the sample")
    return ConversationSample(
        __key__=sample["__key__"],
        __restore_key__=sample["__restore_key__"],
        __subflavors__=sample.get("__subflavors__"),
        __sources__=sample.get("__sources__"),
        conversation=record.get("conversations"),
        images=[sample[n] for n in names],
    )


LLAVA_COOKER = Cooker(cook_llava, has_subflavors={"megatron_dip": "llava"})


def load_cookers(name: str | None) -> list:
    """`--dip-energon-cooker MODULE:NAME` as a list of energon `Cooker`s (ours last)."""
    if name is None:
        return [LLAVA_COOKER]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--dip-energon-cooker: {name!r} is not MODULE:NAME")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--dip-energon-cooker: cannot import {name}: {err}") from None
    found = getattr(found, "cookers", found)
    items = list(found) if isinstance(found, (list, tuple)) else [found]
    cookers = [c if isinstance(c, Cooker) else Cooker(c) for c in items]
    if any(c.need_primary or c.need_cache for c in cookers):
        raise ValueError(
            f"--dip-energon-cooker: {name}: cookers that need the primary dataset or a cache are "
            "not supported (megatron-dip reads samples by index, without auxiliary datasets)"
        )
    return [*cookers, LLAVA_COOKER]


def _images(value: Any, what: str) -> tuple:
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, EncodedImage):
            raise BadSampleError(
                f"{what} holds a {type(item).__name__}; pass the image part through unchanged "
                "(an EncodedImage) so that it is decoded and preprocessed for the model"
            )
    return tuple(items)


def _prompt(text: str, images: int) -> str:
    return text if IMAGE_TAG in text or not images else IMAGE_TAG * images + "\n" + text


def energon_record(sample: Any) -> Record:
    """Turns and images of an Energon sample (module docstring: the supported types)."""
    if isinstance(sample, ConversationSample):
        images = _images(sample.images, "images") if sample.images else ()
        return Record(llava_turns(sample.conversation), images)
    if isinstance(sample, CaptioningSample):
        image = _images(sample.image, "image")
        turns = (Turn("user", _prompt(CAPTION_PROMPT, 1)), Turn("assistant", str(sample.caption)))
        return Record(turns, image)
    if isinstance(sample, VQASample):
        image = _images(sample.image, "image")
        if not sample.answers:
            raise BadSampleError("a VQA sample without answers")
        best = (
            0
            if sample.answer_weights is None
            else int(np.argmax(np.asarray(sample.answer_weights)))
        )
        turns = (
            Turn("user", _prompt(str(sample.context), 1)),
            Turn("assistant", str(sample.answers[best])),
        )
        return Record(turns, image)
    if isinstance(sample, InterleavedSample):
        text, images = [], []
        for item in sample.sequence:
            if isinstance(item, str):
                text.append(item)
            else:
                images.extend(_images(item, "sequence"))
                text.append(IMAGE_TAG)
        return Record((Turn(DOCUMENT, "".join(text)),), tuple(images))
    raise BadSampleError(
        f"unsupported sample type {type(sample).__name__}: use CaptioningSample, VQASample, "
        "InterleavedSample or megatron_dip.data.energon.ConversationSample (or cook into one)"
    )


class EnergonDataset(ImageTextReader):
    """One Energon dataset (a factory of `get_datasets`), read by index."""

    def __init__(
        self, factory, *, model: MultimodalSpec, config: ReaderConfig, cookers: Sequence
    ) -> None:
        self.factory, self.name = factory, str(getattr(factory, "path", factory))
        if not isinstance(factory, BaseWebdatasetFactory):
            raise ValueError(
                f"--dip-data: {self.name} is a {type(factory).__name__}; only prepared "
                "WebDatasets (tar shards) are supported, not joined or JSONL datasets"
            )
        self._aside = _ImagePartsAside(factory.part_filter)
        self._text_reader = ShardInfosITarReader(
            factory.path,
            factory.shards,
            part_filter=self._aside,
            sample_filter=factory.sample_filter,
        )
        self._full_reader = ShardInfosITarReader(
            factory.path,
            factory.shards,
            part_filter=factory.part_filter,
            sample_filter=factory.sample_filter,
        )
        index = SqliteIndexReader(factory.path / _INDEX)
        self._index = index if index.db_has_media_metadata() else None
        if self._index is None:
            logger.info(
                "%s has no media metadata in its index: image headers are read for the planner's lookahead (energon prepare --media-metadata-by-extension avoids it)",
                self.name,
            )
        self._crude = issubclass(factory.__sample_type__, CrudeSample)
        self._cookers = list(cookers)
        self._bounds = np.cumsum([0] + [s.count for s in factory.shards])
        super().__init__(model=model, num_samples=len(factory), config=config)

    def describe(self, index: int) -> str:
        shard = int(np.searchsorted(self._bounds, index, side="right")) - 1
        name = self.factory.shards[shard].name
        return f"Energon sample {index} ({name} #{index - self._bounds[shard]}) of {self.name}"

    def _sized(self, key: str, parts: list[str]) -> dict[str, EncodedImage] | None:
        """Image parts from the media metadata (None: some are missing there)."""
        out = {}
        for part in parts:
            entry = f"{key}.{part}"
            row = self._index.get_media_metadata(entry)
            if row is None:
                return None
            meta = deserialize_media_metadata(*row)
            width, height = getattr(meta, "width", None), getattr(meta, "height", None)
            out[part] = EncodedImage(entry, None, width, height)
        return out

    def _without_pixels(self, index: int) -> dict | None:
        """The sample's parts but its images, which only tell their size (None: the media
        metadata lacks one of them)."""
        self._aside.images = []
        raw = self._text_reader[index]
        if raw is None:
            return None
        sized = self._sized(raw["__key__"], self._aside.images)
        return None if sized is None else {**raw, **sized}

    def _raw(self, index: int, *, pixels: bool) -> dict | None:
        """The sample's parts, images as `EncodedImage`s (None: excluded by the split)."""
        if not pixels and self._index is not None:
            raw = self._without_pixels(index)
            if raw is not None:
                return raw
        raw = self._full_reader[index]
        if raw is not None:
            for part in [p for p in raw if not p.startswith("__") and is_image_part(p)]:
                raw[part] = EncodedImage(f"{raw['__key__']}.{part}", raw[part])
        return raw

    def record(self, index: int, *, pixels: bool) -> Record:
        raw = self._raw(index, pixels=pixels)
        if raw is None:
            raise BadSampleError("excluded by the dataset's split configuration")
        sample = self.factory.load_sample(raw)
        if self._crude:
            sample = self._cook(sample)
        return energon_record(sample)

    def _cook(self, sample: dict):
        flavors = sample.get("__subflavors__") or {}
        for cooker in self._cookers:
            if cooker.is_match(flavors):
                return cooker.cook(sample)
        raise BadSampleError(
            f"no cooker for crude samples with subflavors {flavors} (--dip-energon-cooker)"
        )


def _weights(loaded) -> list[float]:
    items = loaded.datasets
    if all(d.weight is None and d.repetitions is None for d in items):
        return [1.0 / len(items)] * len(items)  # a single dataset (or an unweighted list)
    return [
        float(d.weight) if d.weight is not None else float(d.repetitions) * len(d.dataset)
        for d in items
    ]


def open_datasets(path: str, *, split: str):
    """Energon's `get_datasets` of PATH's `split` with our image pass-through decoder."""
    worker = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return load_dataset(path).get_datasets(
        training=split == "train", split_part=split, worker_config=worker, decoder=PassImages()
    )


def has_samples(path: str, *, split: str) -> bool:
    """Whether PATH's `split` exists and holds samples."""
    try:
        return sum(len(d.dataset) for d in open_datasets(path, split=split).datasets) > 0
    except Exception:  # Energon raises assorted errors for a split it cannot find
        return False


class EnergonSource:
    """A blend of Energon datasets as an unbounded `SampleSource` (module docstring)."""

    num_samples = None  # unbounded: the stream position is the index

    def __init__(
        self,
        path: str,
        *,
        model: MultimodalSpec,
        config: ReaderConfig,
        seed: int,
        slots: int,
        split: str = "train",
        cooker: str | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"--num-workers: the Energon slots must be >= 1, got {slots}")
        self.model, self.path, self.split, self.slots = model, path, split, slots
        loaded = open_datasets(path, split=split)
        cookers = load_cookers(cooker)
        self.parts = [
            EnergonDataset(d.dataset, model=model, config=config, cookers=cookers)
            for d in loaded.datasets
        ]
        self.weights = _weights(loaded)
        self.blend = BlendOrder(self.weights, seed=seed)
        self._share_counts = (0, np.zeros(len(self.parts), np.int64))  # `realised_shares`
        logger.info("%s (%s): %s", path, split, self.blend_description())
        self.orders = []
        for d, part in enumerate(self.parts):
            if not part.num_samples:
                raise ValueError(f"--dip-data: {part.name} has no samples in split {split!r}")
            worker = WorkerConfig(rank=0, world_size=1, num_workers=slots)
            slices = part.factory.shard_workers(
                part.factory.shards,
                worker_config=worker,
                max_samples_per_sequence=MAX_SAMPLES_PER_SEQUENCE,
            )
            self.orders.append(SliceOrder(slices, seed=seed, tag=d))

    def blend_description(self) -> str:
        """Each dataset of the blend with its weight, its share of the draws and its size."""
        total = sum(self.weights)
        return "; ".join(
            f"{part.name}: weight {w:g}, share {w / total:.1%}, {part.num_samples} samples"
            for part, w in zip(self.parts, self.weights, strict=True)
        )

    def realised_shares(self, positions: int) -> list[float]:
        """The share of each dataset among stream positions [0, positions): what the blend
        drew so far (deterministic: the blend order is a function of the seed). Counted on
        from the last call's positions."""
        counted, counts = self._share_counts
        if positions < counted:
            counted, counts = 0, np.zeros(len(self.parts), np.int64)
        for position in range(counted, positions):
            counts[self.blend.locate(position)[0]] += 1
        self._share_counts = (positions, counts)
        return (counts / max(1, positions)).tolist()

    def locate(self, position: int) -> tuple[int, int]:
        """(dataset, index in it) of stream position `position`."""
        d, draw = self.blend.locate(position)
        return d, self.orders[d].index(draw)

    def metas(self, indices: Sequence[int]) -> list[SampleMeta | None]:
        out = []
        for position in indices:
            d, i = self.locate(position)
            meta = self.parts[d].meta(i)
            out.append(None if meta is None else replace(meta, sample_id=position))
        return out

    def sample(self, index: int) -> Sample:
        d, i = self.locate(index)
        return replace(self.parts[d].sample(i), sample_id=index)

    def describe(self, index: int) -> str:
        d, i = self.locate(index)
        return self.parts[d].describe(i)

    def was_truncated(self, index: int) -> bool:
        d, i = self.locate(index)
        return self.parts[d].was_truncated(i)

    def signature(self) -> str:
        """What must not change across a resume for the order to continue identically."""
        sizes = [p.num_samples for p in self.parts]  # not the paths: the data may move
        return repr(
            ("energon", self.split, sizes, self.weights, self.slots, MAX_SAMPLES_PER_SEQUENCE)
        )
