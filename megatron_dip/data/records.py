"""Shared behaviour of the on-disk readers: cached metadata, and bad records as errors or skips.

A reader's metadata is read lazily (headers and text only, no pixel decoding) and cached (the
most recent `META_CACHE` records: memory stays bounded over any number of records; metadata is
a pure function of the record, so an evicted one is read again identically), so the planner's
lookahead costs little. A record that cannot be read is a `BadSampleError` naming the record id
and file; with `on_bad_sample="skip"` (or "truncate", whose too-long samples are cut instead, see
`chat.fit_tokens`) it is logged once, counted in `skipped`, and its metadata is None, which
`BatchStream` leaves out of every batch. A run reads its data through several readers (the
start-up check of the first batches, training, evaluation); they share one `SkipLog`, so each
bad record is logged once per rank however many of them meet it. Tensors are only built for records whose metadata was
good; if building them fails after all (a file changed or is corrupt past its header, e.g. a
truncated JPEG, which Pillow's `verify()` does not notice), "error" raises, naming the record;
the other modes return a stand-in of the planned shapes (blank images) with no loss token,
`Sample.bad` saying why, so the run goes on (a plan already counts on the sample).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

from megatron_dip.data.meta import sample_meta
from megatron_dip.data.sample import Sample, SampleMeta
from megatron_dip.modelspec import MultimodalSpec

logger = logging.getLogger(__name__)

OnBadSample = Literal["error", "skip", "truncate"]
BAD_SAMPLE_POLICIES = ("error", "skip", "truncate")
META_CACHE = 1 << 16  # records whose metadata stays cached


class BadSampleError(ValueError):
    """A record that cannot become a sample; the message names its id and file."""


def inside_root(root: Path, name: str, *, allow_outside: bool) -> Path:
    """`root / name`, normalised; BadSampleError when it leaves `root` (`../`, an absolute
    path) unless `allow_outside` (--dip-allow-outside-paths). The path as written is checked,
    not resolved: symbolic links placed inside the root by the dataset's owner are followed."""
    path, top = Path(os.path.normpath(root / name)), Path(os.path.normpath(root))
    if not allow_outside and not path.is_relative_to(top):
        raise BadSampleError(
            f"path {name!r} leads outside the dataset root {top} (to {path}); allow such paths "
            "with --dip-allow-outside-paths"
        )
    return path


class SkipLog:
    """The skip messages a run has logged (module docstring): `first(message)` is True once
    per message. Shared by readers and streams of one run; a reader without one logs each of
    its own bad records once."""

    def __init__(self) -> None:
        self._seen: set[str] = set()  # (no lock: it travels in pickled specs; a race logs twice)

    def first(self, message: str) -> bool:
        new = message not in self._seen
        self._seen.add(message)
        return new


class RecordReader:
    """Base of the readers: subclasses implement `_read_meta`, `_read_sample`, `describe`."""

    def __init__(
        self,
        *,
        model: MultimodalSpec,
        num_samples: int,
        on_bad_sample: OnBadSample,
        skip_log: SkipLog | None = None,
    ):
        if on_bad_sample not in BAD_SAMPLE_POLICIES:
            raise ValueError(
                f"on_bad_sample must be one of {BAD_SAMPLE_POLICIES}, got {on_bad_sample!r}"
            )
        self.model = model
        self.num_samples = num_samples
        self.on_bad_sample = on_bad_sample
        self.skip_log = skip_log if skip_log is not None else SkipLog()
        self._metas: OrderedDict[int, SampleMeta] = OrderedDict()
        self._bad: set[int] = set()  # skipped records (few; kept for good)
        self._truncated: set[int] = set()  # records whose text was cut (see `note_truncated`)

    @property
    def skipped(self) -> int:
        """Records found bad (and skipped) so far."""
        return len(self._bad)

    @property
    def truncated(self) -> int:
        """Records whose text was truncated so far (on_bad_sample="truncate")."""
        return len(self._truncated)

    def was_truncated(self, index: int) -> bool:
        """Whether record `index`'s text was truncated (its metadata has been read)."""
        return index in self._truncated

    def note_truncated(self, index: int, tokens: int, kept: int) -> None:
        """Record (and log once) that record `index`'s text was cut from `tokens` to `kept`."""
        if index not in self._truncated:
            self._truncated.add(index)
            if self.skip_log.first(f"truncated {self.describe(index)}"):
                logger.info("truncated %s from %d to %d tokens", self.describe(index), tokens, kept)

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
        if index in self._bad:
            return None
        if index in self._metas:
            self._metas.move_to_end(index)
            return self._metas[index]
        try:
            meta = self._read_meta(index)
        except (BadSampleError, OSError, ValueError) as err:
            message = f"{self.describe(index)}: {err}"
            if self.on_bad_sample == "error":
                raise BadSampleError(message) from err
            if self.skip_log.first(message):
                logger.warning("skipping bad record %s", message)
            self._bad.add(index)
            return None
        self._metas[index] = meta
        if len(self._metas) > META_CACHE:
            self._metas.popitem(last=False)
        return meta

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
        if sample.bad is not None:  # a blank stand-in: the planned shapes, no loss tokens
            sample = replace(sample, bad=f"{self.describe(index)}: {sample.bad}")
            loaded = replace(loaded, loss_tokens=meta.loss_tokens)
        if loaded != meta:
            raise BadSampleError(
                f"{self.describe(index)}: arrays do not match the metadata read before "
                f"({loaded} != {meta})"
            )
        return sample
