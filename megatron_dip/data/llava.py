"""Reader for LLaVA-style data (the format of LLaVA-Pretrain), with Pillow for images.

Input: a JSON list of records

    {"id": "004539375", "image": "00453/004539375.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWrite a short caption."},
                       {"from": "gpt", "value": "a dog on the beach"}]}

`image` is a path relative to the image root (a list of paths for several images; absent for a
text-only record). Each "<image>" tag in the conversation takes the next image, in order.
The images feed the model's "vit" module; their placeholder id is that module's.

Output (`sample.py` conventions): sample_id = the record's index in the list (the JSON id is
kept for messages, `record_id`). Text = BOS, then every turn: its text with each "<image>"
replaced by a run of the ViT's placeholder id as long as the image's LLM tokens; a human turn ends with a
newline, a gpt turn with EOS. labels_mask is 1 exactly on gpt-turn text and its EOS. Images are
converted to RGB, resized to the model's patch grid (`grid_size`: sides multiples of
patch * merge, the longer side at most `max_side`, aspect ratio kept as far as the grid allows)
and scaled to float32 [-1, 1], shape [3, H, W]. Tokens come from the offline `ByteTokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from megatron_dip.data.records import BadSampleError, OnBadSample, RecordReader, load_json_list
from megatron_dip.data.sample import InstanceCounts, Sample, SampleMeta
from megatron_dip.data.tokenizer import ByteTokenizer
from megatron_dip.modalities import modality_of, text_module
from megatron_dip.modalities.llm import loss_targets, placeholder_ids
from megatron_dip.modalities.vit import image_tokens
from megatron_dip.modelspec import MultimodalSpec

IMAGE_TAG = "<image>"
_HUMAN = ("human", "user")
_GPT = ("gpt", "assistant")


@dataclass(frozen=True)
class LlavaConfig:
    """How records become samples: largest image side in pixels, and bad-record handling."""

    max_side: int = 336
    on_bad_sample: OnBadSample = "error"


def grid_size(*, height: int, width: int, unit: int, max_side: int) -> tuple[int, int]:
    """(H, W) for an image of `height` x `width`: multiples of `unit`, longer side <= max_side.

    The image is shrunk (never grown) to fit `max_side`, then each side rounded to the nearest
    multiple of `unit`, at least one unit.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} must be positive")
    if max_side < unit:
        raise ValueError(f"max_side {max_side} is smaller than one grid unit ({unit} pixels)")
    scale = min(1.0, max_side / max(height, width))
    most = max_side // unit

    def side(x: int) -> int:
        return int(np.clip(round(x * scale / unit), 1, most)) * unit

    return side(height), side(width)


class LlavaDataset(RecordReader):
    """A LLaVA-style JSON file and its image folder, as a `SampleSource` for `BatchStream`."""

    def __init__(
        self,
        json_path: str | Path,
        *,
        model: MultimodalSpec,
        image_root: str | Path | None = None,
        config: LlavaConfig = LlavaConfig(),
    ) -> None:
        vits = model.modules_of_kind("vit")
        if not vits or text_module(model).kind != "llm":
            raise ValueError(f"model {model.name!r} is not a vision-language model")
        self.json_path = Path(json_path)
        self.image_root = Path(image_root) if image_root is not None else self.json_path.parent
        self.config = config
        self.tokenizer = ByteTokenizer()
        vocab = text_module(model).vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise ValueError(f"the LLM vocabulary ({vocab}) is smaller than the tokenizer's")
        self._vit = vits[0]
        self._image_token = modality_of(self._vit).placeholder_id(self._vit)
        self._placeholders = placeholder_ids(model, self._vit.feeds)
        self._unit = self._vit.patch_size * self._vit.merge
        grid_size(height=1, width=1, unit=self._unit, max_side=config.max_side)  # validates
        self._records = load_json_list(self.json_path)
        super().__init__(
            model=model, num_samples=len(self._records), on_bad_sample=config.on_bad_sample
        )

    def record_id(self, index: int) -> str:
        """The record's own "id" field (or its index when it has none)."""
        return str(self._records[index].get("id", index))

    def image_paths(self, index: int) -> list[Path]:
        """Absolute paths of the record's images, in order."""
        image = self._records[index].get("image")
        names = [] if image is None else [image] if isinstance(image, str) else list(image)
        if not all(isinstance(n, str) for n in names):
            raise BadSampleError(f"{self.describe(index)}: 'image' must be a path or a list")
        return [self.image_root / n for n in names]

    def describe(self, index: int) -> str:
        image = self._records[index].get("image")
        shown = repr(image)
        if isinstance(image, list) and len(image) > 3:  # keep messages readable
            shown = f"[{image[0]!r}, {image[1]!r}, ... {len(image)} images]"
        return f"LLaVA record {index} (id {self.record_id(index)!r}, image {shown})"

    def _sizes(self, index: int) -> list[tuple[int, int]]:
        """Target (H, W) per image, from the headers; verifies each file is intact."""
        sizes = []
        for path in self.image_paths(index):
            try:
                with Image.open(path) as im:
                    width, height = im.size
                    im.verify()  # reads the whole file and checks it, without decoding pixels
            except Exception as err:  # Pillow raises many types for broken files
                raise BadSampleError(f"cannot read image {path}: {err}") from err
            sizes.append(
                grid_size(
                    height=height, width=width, unit=self._unit, max_side=self.config.max_side
                )
            )
        return sizes

    def _read_meta(self, index: int) -> SampleMeta:
        sizes = self._sizes(index)
        counts = [image_tokens(height=h, width=w, vit=self._vit) for h, w in sizes]
        patches = tuple(p for p, _ in counts)
        llm = tuple(t for _, t in counts)
        text, mask = self._encode(index, list(llm))
        loss = int(loss_targets(text, mask, placeholders=self._placeholders).sum())
        instances = {self._vit.name: InstanceCounts(patches, llm)}
        return SampleMeta(index, int(text.size), instances, loss_tokens=loss)

    def _read_sample(self, index: int) -> Sample:
        sizes = self._sizes(index)
        images = [_load_image(p, size) for p, size in zip(self.image_paths(index), sizes)]
        llm = [image_tokens(height=h, width=w, vit=self._vit)[1] for h, w in sizes]
        text, mask = self._encode(index, llm)
        return Sample(index, text, {self._vit.name: images}, mask)

    def _encode(self, index: int, llm_tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return encode_conversation(
            self._records[index].get("conversations"),
            llm_tokens=llm_tokens,
            tokenizer=self.tokenizer,
            image_token=self._image_token,
        )


def encode_conversation(
    conversations: Any, *, llm_tokens: list[int], tokenizer: ByteTokenizer, image_token: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, labels_mask) of a LLaVA conversation; see the module docstring for layout.

    Raises BadSampleError on a malformed conversation or a count of "<image>" tags that differs
    from the number of images.
    """
    if not isinstance(conversations, list) or not conversations:
        raise BadSampleError("'conversations' must be a non-empty list")
    ids: list[np.ndarray] = [np.array([tokenizer.bos_id])]
    mask: list[np.ndarray] = [np.zeros(1, dtype=np.uint8)]
    image = 0
    for t, turn in enumerate(conversations):
        role = turn.get("from") if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if role not in _HUMAN + _GPT or not isinstance(value, str):
            raise BadSampleError(f"turn {t} needs 'from' in {_HUMAN + _GPT} and a string 'value'")
        loss = 1 if role in _GPT else 0
        for j, part in enumerate(value.split(IMAGE_TAG)):
            if j:
                if image >= len(llm_tokens):
                    raise BadSampleError(f"more {IMAGE_TAG} tags than the {len(llm_tokens)} images")
                ids.append(np.full(llm_tokens[image], image_token, dtype=np.int64))
                mask.append(np.zeros(llm_tokens[image], dtype=np.uint8))
                image += 1
            enc = tokenizer.encode(part)
            ids.append(enc)
            mask.append(np.full(enc.size, loss, dtype=np.uint8))
        end = tokenizer.eos_id if loss else tokenizer.encode("\n")[0]
        ids.append(np.array([end]))
        mask.append(np.array([loss], dtype=np.uint8))
    if image != len(llm_tokens):
        raise BadSampleError(f"{image} {IMAGE_TAG} tags for {len(llm_tokens)} images")
    return np.concatenate(ids).astype(np.int64), np.concatenate(mask)


def _load_image(path: Path, size: tuple[int, int]) -> np.ndarray:
    """Decode `path` as RGB, resize to `size` (H, W) and scale to float32 [-1, 1], [3, H, W]."""
    with Image.open(path) as im:
        rgb = im.convert("RGB").resize((size[1], size[0]), Image.Resampling.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.float32) / 127.5 - 1.0
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
