"""On-disk format and reader for text-to-video / text-to-image diffusion data (VAE latents).

Format (a directory `root`):

    root/captions.json   a JSON list of records, one per clip:
                         {"id": "clip-000042", "latent": "latents/clip-000042.npz",
                          "caption": "a dog runs along the beach"}
    root/<latent>        an .npz file (np.savez or np.savez_compressed) holding one array
                         "latent": float16/bfloat16-as-float16/float32, shape [T, C, h, w]

The latent is what the model's VAE made of the clip (already scaled as the DiT expects): T latent
frames (a still image has T = 1), C = the DiT's `in_channels`, h and w multiples of the DiT patch
size. Paths are relative to `root`. `write_latent_dataset` writes this format.

Reading follows `megatron_dip.data.sample`: sample_id = the record's index, text = BOS (when the
tokenizer has one) + the caption's ids under the run's tokenizer (the byte tokenizer by default) +
EOS, images = [the latent as float32], no labels_mask (the
diffusion loss covers all latent tokens). Metadata comes from the .npy header inside the .npz,
so the planner's lookahead reads no latent data. Bad records (missing or unreadable file, no
"latent" array, wrong rank/channels/sizes, empty caption) raise `BadSampleError` naming the id
and file, or are logged, counted and skipped with `on_bad_sample="skip"`.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_dip.data.json_index import JsonRecords
from megatron_dip.data.records import (
    BadSampleError,
    OnBadSample,
    RecordReader,
    SkipLog,
    inside_root,
)
from megatron_dip.data.sample import InstanceCounts, Sample, SampleMeta
from megatron_dip.data.tokenizer import TokenizerSpec, load_tokenizer
from megatron_dip.modalities import text_module
from megatron_dip.modalities.dit import clip_tokens
from megatron_dip.modelspec import MultimodalSpec

CAPTIONS_FILE = "captions.json"
LATENT_KEY = "latent"


@dataclass(frozen=True)
class LatentConfig:
    """Bad-record handling and tokenizer of `LatentDataset`."""

    on_bad_sample: OnBadSample = "error"
    tokenizer: TokenizerSpec = TokenizerSpec()
    allow_outside_paths: bool = False  # --dip-allow-outside-paths (`records.inside_root`)
    skip_log: SkipLog | None = field(default=None, compare=False)  # the run's (records.py)


def latent_shape(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of the "latent" array in the .npz at `path`, read from its header only."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as err:
        raise BadSampleError(f"{path} is not an .npz (zip) file: {err}") from None
    with archive:
        try:
            member = archive.open(f"{LATENT_KEY}.npy")
        except KeyError:
            raise BadSampleError(f"{path} holds no {LATENT_KEY!r} array") from None
        with member:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(member)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    return tuple(int(s) for s in shape), dtype


class LatentDataset(RecordReader):
    """A directory in the format above, as a `SampleSource` for `BatchStream`."""

    def __init__(
        self, root: str | Path, *, model: MultimodalSpec, config: LatentConfig = LatentConfig()
    ) -> None:
        dits = model.modules_of_kind("dit")
        if not dits:
            raise ValueError(f"model {model.name!r} is not a text-to-video/image diffusion model")
        self.root = Path(root)
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        vocab = text_module(model).vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise ValueError(
                f"the text encoder's vocabulary ({vocab}) is smaller than the tokenizer's"
            )
        self._dit = dits[0]
        self._records = JsonRecords(self.root / CAPTIONS_FILE)
        if config.on_bad_sample == "error":
            self._records.refuse_not_utf8()
        super().__init__(
            model=model,
            num_samples=len(self._records),
            on_bad_sample=config.on_bad_sample,
            skip_log=config.skip_log,
        )

    def record_id(self, index: int) -> str:
        """The record's own "id" field (or its index when it has none)."""
        return str(self._records[index].get("id", index))

    def describe(self, index: int) -> str:
        if index in self._records.not_utf8:  # it cannot be parsed to name its id
            return f"latent record {index} of {self._records.path}"
        latent = self._records[index].get("latent")
        return f"latent record {index} (id {self.record_id(index)!r}, latent {latent!r})"

    def _path(self, index: int) -> Path:
        latent = self._records[index].get("latent")
        if not isinstance(latent, str):
            raise BadSampleError("'latent' must be a path")
        return inside_root(self.root, latent, allow_outside=self.config.allow_outside_paths)

    def _caption(self, index: int) -> np.ndarray:
        caption = self._records[index].get("caption")
        if not isinstance(caption, str) or not caption.strip():
            raise BadSampleError("'caption' must be a non-empty string")
        tok = self.tokenizer
        bos = [] if tok.bos_id is None else [tok.bos_id]
        return np.concatenate((bos, tok.encode(caption), [tok.eos_id])).astype(np.int64)

    def _read_meta(self, index: int) -> SampleMeta:
        shape, dtype = latent_shape(self._path(index))
        if len(shape) != 4 or shape[1] != self._dit.in_channels:
            raise BadSampleError(f"latent must be [T, {self._dit.in_channels}, h, w], got {shape}")
        if not np.issubdtype(dtype, np.floating):
            raise BadSampleError(f"latent must be floating point, got {dtype}")
        t, _, h, w = shape
        tokens = clip_tokens(frames=t, height=h, width=w, dit=self._dit)
        text = int(self._caption(index).size)
        instances = {self._dit.name: InstanceCounts((tokens,), (), (t,))}
        return SampleMeta(index, text, instances, loss_tokens=tokens)

    def _read_sample(self, index: int) -> Sample:
        try:
            with np.load(self._path(index)) as archive:
                latent = np.asarray(archive[LATENT_KEY], dtype=np.float32)
        except (zipfile.BadZipFile, KeyError, EOFError) as err:  # np.load's other failure types
            raise BadSampleError(f"cannot read the latent: {err!r}") from err
        return Sample(index, self._caption(index), {self._dit.name: [latent]})


def write_latent_dataset(root: str | Path, records: Iterable[tuple[str, str, np.ndarray]]) -> Path:
    """Write (id, caption, latent [T, C, h, w]) records in the format above; returns the JSON.

    Latents are stored as given (cast float16 by the caller to halve the size if wanted), one
    uncompressed .npz per record under `root/latents/`.
    """
    root = Path(root)
    (root / "latents").mkdir(parents=True, exist_ok=True)
    entries = []
    for record_id, caption, latent in records:
        if "/" in record_id or record_id in ("", ".", ".."):
            raise ValueError(f"record id {record_id!r} cannot name a file")
        name = f"latents/{record_id}.npz"
        np.savez(root / name, **{LATENT_KEY: np.asarray(latent)})
        entries.append({"id": record_id, "latent": name, "caption": caption})
    path = root / CAPTIONS_FILE
    path.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")
    return path
