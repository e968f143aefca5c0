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
left out, deterministically.

Global batch size (exactly one of):

* `batch_samples=N`: the next N usable samples;
* `batch_microbatches=M` (needs `limits`): the longest run of samples that first-fit packs into
  M microbatches, i.e. the batch ends at the first sample that would open microbatch M + 1 (it
  starts the next batch). The planner may split these samples across data-parallel replicas and
  pack each share on its own, so per-replica microbatch counts are the planner's outcome; the
  stream fixes the amount of data (M full sequences' worth) per iteration.

The position is resumable: `state_dict()` records the next batch to be consumed (peeked batches
are recomputed), and `load_state_dict()` continues identically.
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

    def signature(self) -> str:
        """What must not change across a resume for the continuation to be identical."""
        return repr((self.seed, self.batch_samples, self.batch_microbatches, self.limits,
                     self.on_oversize, self.shuffle))  # fmt: skip


@dataclass(frozen=True)
class _Built:
    batch: BatchMeta
    end: int  # first position after the batch
    skipped: int


class BatchStream(Iterator[BatchMeta]):
    """An iterator of global `BatchMeta`, with lookahead and on-demand tensors."""

    def __init__(self, source: SampleSource, *, config: StreamConfig) -> None:
        self.source = source
        self.config = config
        self._iteration = 0
        self._position = 0
        self._skipped = 0
        self._ahead: deque[_Built] = deque()
        self._perms: dict[int, np.ndarray] = {}

    # -- metadata ------------------------------------------------------------------------------

    def peek(self, n: int) -> list[BatchMeta]:
        """The next `n` batches' metadata, without consuming them."""
        while len(self._ahead) < n:
            last = self._ahead[-1] if self._ahead else None
            start = last.end if last else self._position
            iteration = last.batch.iteration + 1 if last else self._iteration
            self._ahead.append(self._build(iteration, start))
        return [b.batch for b in list(self._ahead)[:n]]

    def __next__(self) -> BatchMeta:
        built = (
            self._ahead.popleft() if self._ahead else self._build(self._iteration, self._position)
        )
        self._iteration = built.batch.iteration + 1
        self._position = built.end
        self._skipped += built.skipped
        return built.batch

    @property
    def skipped(self) -> int:
        """Positions left out so far (bad records, skipped oversize samples) in consumed batches."""
        return self._skipped

    def _build(self, iteration: int, start: int) -> _Built:
        cfg = self.config
        packer = FirstFitPacker(cfg.limits) if cfg.batch_microbatches is not None else None
        taken: list[SampleMeta] = []
        position, skipped, misses = start, 0, 0
        while True:
            chunk = _READ_CHUNK
            if cfg.batch_samples is not None:
                chunk = min(chunk, cfg.batch_samples - len(taken))
            metas = self.source.metas([self._index(p) for p in range(position, position + chunk)])
            for raw in metas:
                if raw is not None and not self._drop(raw, position):
                    meta = replace(raw, sample_id=position)
                    if packer is not None and packer.place(meta) == cfg.batch_microbatches:
                        return _Built(BatchMeta(iteration, tuple(taken)), position, skipped)
                    if packer is not None:
                        packer.add(meta)
                    taken.append(meta)
                    misses = 0
                else:
                    skipped, misses = skipped + 1, misses + 1
                    self._check_not_starved(misses)
                position += 1
                if cfg.batch_samples is not None and len(taken) == cfg.batch_samples:
                    return _Built(BatchMeta(iteration, tuple(taken)), position, skipped)

    def _drop(self, meta: SampleMeta, position: int) -> bool:
        """Whether an oversize sample is skipped (raises under on_oversize="error")."""
        if self.config.limits is None:
            return False
        reason = oversize_reason(meta, self.config.limits)
        if reason is None:
            return False
        message = f"stream position {position} (dataset index {self._index(position)}): {reason}"
        if self.config.on_oversize == "error":
            raise ValueError(message)
        logger.warning("skipping oversize sample at %s", message)
        return True

    def _check_not_starved(self, misses: int) -> None:
        n = self.source.num_samples
        if n is not None and misses > n:
            raise ValueError(f"no usable sample in a whole pass over the {n} records")

    def _index(self, position: int) -> int:
        n = self.source.num_samples
        if n is None:
            return position
        if n <= 0:
            raise ValueError("the source has no samples")
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
            "config": self.config.signature(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; raises ValueError if it was saved under another config."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown stream state version {state.get('version')!r}")
        if state["config"] != self.config.signature():
            raise ValueError(
                "stream state was saved with another configuration: "
                f"{state['config']} != {self.config.signature()}"
            )
        self._iteration = int(state["iteration"])
        self._position = int(state["position"])
        self._skipped = int(state["skipped"])
        self._ahead.clear()
