"""Shared behaviour of the on-disk readers: cached metadata, and bad records as errors or skips.

A reader's metadata is read lazily (headers and text only, no pixel decoding) and cached, so the
planner's lookahead costs little. A record that cannot be read is a `BadSampleError` naming the
record id and file; with `on_bad_sample="skip"` it is logged once, counted in `skipped`, and its
metadata is None, which `BatchStream` leaves out of every batch. Tensors are only built for
records whose metadata was good; if building them fails after all (a file changed or is corrupt
past its header) the error is raised in both modes, because a plan already counts on the sample.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from megatron_dip.data.meta import sample_meta
from megatron_dip.data.sample import Sample, SampleMeta
from megatron_dip.modelspec import MultimodalSpec

logger = logging.getLogger(__name__)

OnBadSample = Literal["error", "skip"]


class BadSampleError(ValueError):
    """A record that cannot become a sample; the message names its id and file."""


def load_json_list(path: Path) -> list[dict[str, Any]]:
    """The JSON list of records at `path`; raises ValueError if it is not a list of objects."""
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: expected a JSON list of objects")
    return records


class RecordReader:
    """Base of the readers: subclasses implement `_read_meta`, `_read_sample`, `describe`."""

    def __init__(self, *, model: MultimodalSpec, num_samples: int, on_bad_sample: OnBadSample):
        if on_bad_sample not in ("error", "skip"):
            raise ValueError(f"on_bad_sample must be 'error' or 'skip', got {on_bad_sample!r}")
        self.model = model
        self.num_samples = num_samples
        self.on_bad_sample = on_bad_sample
        self._metas: dict[int, SampleMeta | None] = {}

    @property
    def skipped(self) -> int:
        """Records found bad (and skipped) so far."""
        return sum(m is None for m in self._metas.values())

    def describe(self, index: int) -> str:
        """How error messages name record `index` (id and file)."""
        raise NotImplementedError

    def _read_meta(self, index: int) -> SampleMeta:
        raise NotImplementedError

    def _read_sample(self, index: int) -> Sample:
        raise NotImplementedError

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"record {index} outside [0, {self.num_samples})")

    def meta(self, index: int) -> SampleMeta | None:
        """Metadata of record `index` (sample_id = index); None if it is bad and skipped."""
        self._check_index(index)
        if index not in self._metas:
            try:
                self._metas[index] = self._read_meta(index)
            except (BadSampleError, OSError, ValueError) as err:
                message = f"{self.describe(index)}: {err}"
                if self.on_bad_sample == "error":
                    raise BadSampleError(message) from err
                logger.warning("skipping bad record %s", message)
                self._metas[index] = None
        return self._metas[index]

    def metas(self, indices: Sequence[int]) -> list[SampleMeta | None]:
        """`meta` of each index."""
        return [self.meta(i) for i in indices]

    def sample(self, index: int) -> Sample:
        """The arrays of record `index`; raises BadSampleError if it is bad or unreadable."""
        meta = self.meta(index)
        if meta is None:
            raise BadSampleError(f"{self.describe(index)}: record was skipped as bad")
        try:
            sample = self._read_sample(index)
            loaded = sample_meta(sample, model=self.model)
        except (OSError, ValueError) as err:
            raise BadSampleError(f"{self.describe(index)}: {err}") from err
        if loaded != meta:
            raise BadSampleError(
                f"{self.describe(index)}: arrays do not match the metadata read before "
                f"({loaded} != {meta})"
            )
        return sample
