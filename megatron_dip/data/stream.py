"""`BatchStream`: global batches whose metadata is known before their tensors are built.

The planner reads `peek(n)` (the next n batches' `BatchMeta`) while the current iteration trains;
the training loop then takes the batch with `next()` and asks for its tensors with `samples()`,
each data-parallel rank passing the sample ids the planner's replica split gave its replica.

Positions and ids. The stream reads a source position by position. Sample ids in every
`BatchMeta` are stream positions (0, 1, 2, ...), unique over the whole run even when a finite
dataset repeats; position p maps to dataset index `permutation_e[p mod N]` of epoch e = p // N
(a seeded permutation per epoch, or the identity with `shuffle=False`; unbounded sources such
as the synthetic generator are read in order). Positions whose source metadata is None (a bad
record the reader skipped) or that are oversize under `limits` with `on_oversize="skip"` are
left out, deterministically, counted (`skipped`) and logged once each with the reason.

Unusable samples. A batch that meets an oversize sample under `on_oversize="error"`, a record the
source refuses (its `metas` raises ValueError, e.g. a reader's BadSampleError), or no usable
sample within a bounded search (a whole pass over a finite source; `max_consecutive_skips`
positions of an unbounded one) cannot be formed: its error names the position, the record and
the reason. It is raised when that batch is CONSUMED by `next()` (or when it is the first batch
`peek` is asked for), never earlier: `peek` returns only the batches before it. Every rank reads
the same metadata, so every rank raises at the same iteration, before any of them runs it, even
though only the planner's rank peeks ahead.

Global batch size (exactly one of):

* `batch_samples=N`: the next N usable samples;
* `batch_microbatches=M` (needs `limits`): the longest run of samples that first-fit packs into
  M microbatches, i.e. the batch ends at the first sample that would open microbatch M + 1 (it
  starts the next batch). The planner may split these samples across data-parallel replicas and
  pack each share on its own, so per-replica microbatch counts are the planner's outcome; the
  stream fixes the amount of data (M full sequences' worth) per iteration.

The position is resumable: `state_dict()` records the next batch to be consumed (peeked batches
are recomputed), and `load_state_dict()` continues identically. A source with a `signature()`
(e.g. an Energon blend: its datasets, weights and shard slots) has it saved too, and a state
saved over another source is refused.

Truncated samples (a reader's `was_truncated(index)`, --dip-bad-samples truncate) are counted in
`truncated` over the consumed batches, like the skipped ones.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from megatron_dip.data.meta import sample_meta
from megatron_dip.data.packing import FirstFitPacker, OnOversize, PackingLimits, oversize_reason
from megatron_dip.data.sample import BatchMeta, Sample, SampleMeta
from megatron_dip.modelspec import MultimodalSpec

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
_PERMUTATION = 2  # spawn-key tag, distinct from the synthetic generator's tags
_READ_CHUNK = 64
MAX_CONSECUTIVE_SKIPS = 4096  # unbounded sources: unusable positions in a row before giving up


class SampleSource(Protocol):
    """What a `BatchStream` reads: random access to metadata and samples by dataset index."""

    model: MultimodalSpec
    num_samples: int | None  # None: unbounded (index = position)

    def metas(self, indices: Sequence[int]) -> list[SampleMeta | None]:
        """Metadata of the given indices; None for a record the source skips."""
        ...

    def sample(self, index: int) -> Sample:
        """The arrays of one index (its metadata must equal `metas`'s)."""
        ...


@dataclass(frozen=True)
class StreamConfig:
    """How a `BatchStream` forms global batches; see the module docstring."""

    seed: int = 0
    batch_samples: int | None = None
    batch_microbatches: int | None = None
    limits: PackingLimits | None = None
    on_oversize: OnOversize = "error"
    shuffle: bool = True
    check_meta: bool = True  # samples() verifies each sample against the planner's metadata
    max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS  # unbounded sources only

    def __post_init__(self) -> None:
        if (self.batch_samples is None) == (self.batch_microbatches is None):
            raise ValueError("set exactly one of batch_samples and batch_microbatches")
        size = self.batch_samples if self.batch_samples is not None else self.batch_microbatches
        if size is not None and size <= 0:
            raise ValueError(f"global batch size must be positive, got {size}")
        if self.batch_microbatches is not None and self.limits is None:
            raise ValueError("batch_microbatches needs packing limits")
        if self.on_oversize not in ("error", "skip"):
            raise ValueError(f"on_oversize must be 'error' or 'skip', got {self.on_oversize!r}")
        if self.max_consecutive_skips < 1:
            raise ValueError(
                f"max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}"
            )

    def signature(self) -> str:
        """What must not change across a resume for the continuation to be identical."""
        return repr(
            (
                self.seed,
                self.batch_samples,
                self.batch_microbatches,
                self.limits,
                self.on_oversize,
                self.shuffle,
            )
        )


@dataclass(frozen=True)
class _Built:
    batch: BatchMeta | None  # None: the batch cannot be formed (`error`)
    end: int  # first position after the batch
    skipped: int
    error: StreamError | None = None
    truncated: int = 0


class StreamError(ValueError):
    """A batch that cannot be formed; the message names the position, record and reason.

    `oversize`: the cause is sample sizes against the packing limits (an oversize sample under
    on_oversize="error", or a search that found only oversize samples), not a broken record.
    `position`: the stream position of the one sample refused (None: no usable sample at all).
    """

    def __init__(self, message: str, *, oversize: bool = False, position: int | None = None):
        super().__init__(message)
        self.oversize = oversize
        self.position = position


class BatchStream(Iterator[BatchMeta]):
    """An iterator of global `BatchMeta`, with lookahead and on-demand tensors."""

    def __init__(self, source: SampleSource, *, config: StreamConfig) -> None:
        self.source = source
        self.config = config
        self._iteration = 0
        self._position = 0
        self._skipped = 0
        self._truncated = 0
        self._ahead: deque[_Built] = deque()
        self._perms: dict[int, np.ndarray] = {}
        self._logged: set[int] = set()  # finite sources: dataset indices whose skip was logged
        self._logged_upto = 0  # unbounded sources: skips at positions below this were logged

    # -- metadata ------------------------------------------------------------------------------

    def peek(self, n: int) -> list[BatchMeta]:
        """The next `n` batches' metadata, without consuming them; fewer when a later one cannot
        be formed (its error waits for `next()`). Raises if the very next one cannot be formed."""
        while len(self._ahead) < n and (not self._ahead or self._ahead[-1].error is None):
            last = self._ahead[-1] if self._ahead else None
            start = last.end if last else self._position
            iteration = last.batch.iteration + 1 if last else self._iteration
            self._ahead.append(self._build(iteration, start))
        if n > 0 and self._ahead and self._ahead[0].error is not None:
            raise self._ahead[0].error
        good = []
        for built in list(self._ahead)[:n]:
            if built.error is not None:
                break
            good.append(built.batch)
        return good

    def __next__(self) -> BatchMeta:
        if not self._ahead:
            self._ahead.append(self._build(self._iteration, self._position))
        if self._ahead[0].error is not None:
            raise self._ahead[0].error  # consumed nothing: the position stays before the batch
        built = self._ahead.popleft()
        self._iteration = built.batch.iteration + 1
        self._position = built.end
        self._skipped += built.skipped
        self._truncated += built.truncated
        return built.batch

    @property
    def skipped(self) -> int:
        """Positions left out so far (bad records, skipped oversize samples) in consumed batches."""
        return self._skipped

    @property
    def truncated(self) -> int:
        """Samples of the consumed batches whose text the reader truncated."""
        return self._truncated

    def _was_truncated(self, position: int) -> bool:
        check = getattr(self.source, "was_truncated", None)
        return bool(check is not None and check(self._index(position)))

    def _build(self, iteration: int, start: int) -> _Built:
        """Batch `iteration` from position `start`, or why it cannot be formed."""
        try:
            return self._collect(iteration, start)
        except StreamError as err:  # an unusable sample under "error", a starved search
            return _Built(None, start, 0, error=err)

    def _collect(self, iteration: int, start: int) -> _Built:
        cfg = self.config
        packer = FirstFitPacker(cfg.limits) if cfg.batch_microbatches is not None else None
        taken: list[SampleMeta] = []
        position, skipped, misses, reason = start, 0, 0, ""
        while True:
            chunk = _READ_CHUNK
            if cfg.batch_samples is not None:
                chunk = min(chunk, cfg.batch_samples - len(taken))
            for raw in self._metas(position, chunk):
                if isinstance(raw, StreamError):
                    raise raw  # a record the source refuses, reached in data order
                why = "the source skipped the record" if raw is None else self._unusable(raw)
                if why is None:
                    meta = replace(raw, sample_id=position)
                    if packer is not None and packer.place(meta) == cfg.batch_microbatches:
                        return self._done(iteration, taken, position, skipped)
                    if packer is not None:
                        packer.add(meta)
                    taken.append(meta)
                    misses = 0
                else:
                    self._refuse_or_log(position, why, skip=raw is None)
                    skipped, misses, reason = skipped + 1, misses + 1, why
                    self._check_not_starved(position, misses, reason, oversize=raw is not None)
                position += 1
                if cfg.batch_samples is not None and len(taken) == cfg.batch_samples:
                    return self._done(iteration, taken, position, skipped)

    def _done(self, iteration: int, taken: list[SampleMeta], end: int, skipped: int) -> _Built:
        truncated = sum(self._was_truncated(m.sample_id) for m in taken)
        return _Built(BatchMeta(iteration, tuple(taken)), end, skipped, truncated=truncated)

    def _metas(self, position: int, count: int) -> list[SampleMeta | None | StreamError]:
        """Source metadata of `count` positions from `position`. A record the source refuses
        ends the list as a StreamError: raised only if the batch reaches it (the read is
        chunked, the batch may end before)."""
        indices = [self._index(p) for p in range(position, position + count)]
        try:
            return list(self.source.metas(indices))
        except ValueError:
            pass
        out: list[SampleMeta | None | StreamError] = []
        for offset, index in enumerate(indices):
            try:
                out.extend(self.source.metas([index]))
            except ValueError as err:
                at = position + offset
                out.append(StreamError(f"stream position {at}: {err}", position=at))
                break
        return out

    def _unusable(self, meta: SampleMeta) -> str | None:
        """Why `meta` fits in no microbatch, or None."""
        return None if self.config.limits is None else oversize_reason(meta, self.config.limits)

    def _record(self, position: int) -> str:
        """How the source names the record at stream position `position`."""
        index = self._index(position)
        describe = getattr(self.source, "describe", None)
        return describe(index) if describe is not None else f"dataset index {index}"

    def _where(self, position: int) -> str:
        return f"stream position {position} ({self._record(position)})"

    def _refuse_or_log(self, position: int, reason: str, *, skip: bool) -> None:
        """Raise for an oversize sample under on_oversize="error"; else log it once."""
        if not skip and self.config.on_oversize == "error":
            message = f"{self._where(position)}: {reason}"
            raise StreamError(message, oversize=True, position=position)
        if skip or not self._first_skip(position):
            return  # the reader logged its own skips, with their reason, once
        shared = getattr(self.source, "skip_log", None)  # the run's other streams meet it too
        if shared is None or shared.first(f"{self._record(position)}: {reason}"):
            logger.warning("skipping %s: %s", self._where(position), reason)

    def _first_skip(self, position: int) -> bool:
        """Whether the sample at `position` is skipped for the first time: once per record of
        a finite source (every epoch meets it again), once per position of an unbounded one
        (batches are rebuilt after a resume)."""
        if self.source.num_samples is None:
            first = position >= self._logged_upto
            self._logged_upto = max(self._logged_upto, position + 1)
            return first
        index = self._index(position)
        first = index not in self._logged
        self._logged.add(index)
        return first

    def _check_not_starved(self, position: int, misses: int, reason: str, *, oversize: bool):
        """Bound the search: a whole pass of a finite source, `max_consecutive_skips` positions
        of an unbounded one (which would otherwise be read forever)."""
        n, limit = self.source.num_samples, self.config.max_consecutive_skips
        if n is not None and misses > n:
            message = f"no usable sample in a whole pass over the {n} records (last: {reason})"
            raise StreamError(message, oversize=oversize)
        if n is None and misses >= limit:
            raise StreamError(
                f"no usable sample in {limit} consecutive stream positions up to {position} "
                f"(max_consecutive_skips={limit}; last: {reason})",
                oversize=oversize,
            )

    def dataset_index(self, position: int) -> int:
        """The source index that stream position `position` reads (a sample id's record)."""
        return self._index(position)

    def _index(self, position: int) -> int:
        n = self.source.num_samples
        if n is None:
            return position
        if n <= 0:
            raise StreamError("the source has no samples (an empty dataset)")
        epoch, offset = divmod(position, n)
        if not self.config.shuffle:
            return offset
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            seq = np.random.SeedSequence(self.config.seed, spawn_key=(_PERMUTATION, epoch))
            self._perms[epoch] = np.random.default_rng(seq).permutation(n)
        return int(self._perms[epoch][offset])

    # -- tensors -------------------------------------------------------------------------------

    def samples(self, batch: BatchMeta, sample_ids: Sequence[int] | None = None) -> list[Sample]:
        """The arrays of `sample_ids` of `batch` (default: all), in the order given.

        A data-parallel rank passes its replica's ids from the planner's split. With
        `check_meta`, raises ValueError when a loaded sample's metadata differs from what the
        planner saw (a changed file, a reader bug), so no plan runs on the wrong data.
        """
        by_id = {m.sample_id: m for m in batch.samples}
        ids = list(by_id) if sample_ids is None else list(sample_ids)
        out = []
        for sid in ids:
            if sid not in by_id:
                raise ValueError(f"sample {sid} is not in batch {batch.iteration}")
            sample = replace(self.source.sample(self._index(sid)), sample_id=sid)
            if self.config.check_meta:
                seen = sample_meta(sample, model=self.source.model)
                if sample.bad is not None:  # a blank stand-in: no loss tokens (records.py)
                    seen = replace(seen, loss_tokens=by_id[sid].loss_tokens)
                if seen != by_id[sid]:
                    raise ValueError(
                        f"sample {sid} (dataset index {self._index(sid)}) changed after "
                        f"planning: planned {by_id[sid]}, loaded {seen}"
                    )
            out.append(sample)
        return out

    # -- resumption ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch to consume (plain ints and strings only)."""
        return {
            "version": _STATE_VERSION,
            "iteration": self._iteration,
            "position": self._position,
            "skipped": self._skipped,
            "truncated": self._truncated,
            "config": self.config.signature(),
            "source": self._source_signature(),
        }

    def _source_signature(self) -> str | None:
        signature = getattr(self.source, "signature", None)
        return None if signature is None else signature()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; raises ValueError if it was saved under another config."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown stream state version {state.get('version')!r}")
        if state["config"] != self.config.signature():
            raise ValueError(
                "stream state was saved with another configuration: "
                f"{state['config']} != {self.config.signature()}"
            )
        saved, mine = state.get("source"), self._source_signature()
        if saved is not None and saved != mine:
            raise ValueError(
                "stream state was saved over another data source (its datasets, weights or "
                f"shard slots differ; the order would not continue): {saved} != {mine}"
            )
        self._iteration = int(state["iteration"])
        self._position = int(state["position"])
        self._skipped = int(state["skipped"])
        self._truncated = int(state.get("truncated", 0))
        self._ahead.clear()
