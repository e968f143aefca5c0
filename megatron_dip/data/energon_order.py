"""The order in which a blend of Energon datasets is read: a pure function of the stream position.

Blend. Position p draws from dataset d with probability weight_d (Energon's blending by weight,
per sample), by a seeded generator per block of `BLOCK` positions; draw k of dataset d is the
number of earlier positions that drew d. A position's dataset and draw are therefore known for
any p without replaying the run (the counts of earlier blocks are kept, 8 bytes per dataset per
block), which makes the data position one integer: exact resume is `BatchStream`'s.

Shards. Within a dataset, the samples are split over `slots` global workers as Energon splits
them over data-parallel ranks and their workers (`Sharder.shard_workers`; the caller passes its
result: per worker, the boundaries of its shard slices of at most `max_samples_per_sequence`
samples). Epoch e of a dataset of N samples is its draws [e N, (e + 1) N): draws cycle over the
workers in turn (a worker whose samples of the epoch are all drawn drops out of the turn), so an
epoch draws each sample exactly once; a worker's epoch visits its slices in a seeded order (a
permutation per worker and epoch), the samples of a slice in file order, as an Energon worker
reads its shards. Energon's split depends only on the global number of workers (ranks x workers
per rank), so the order is the same on every rank, and for any data-parallel size with the same
number of slots: every rank forms the same global batches from metadata, and the planner gives
each replica its samples.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

BLOCK = 1024
_BLEND, _SLICES = 3, 4  # spawn-key tags, distinct from the stream's and the generator's
_CACHE = 4


class SliceOrder:
    """Dataset index of each draw of one dataset (module docstring)."""

    def __init__(self, worker_slices: Sequence[Sequence[int]], *, seed: int, tag: int) -> None:
        self.workers = [
            tuple(int(x) for x in w) for w in worker_slices if len(w) > 1 and w[-1] > w[0]
        ]
        if not self.workers:
            raise ValueError("the dataset has no samples")
        self.seed, self.tag = seed, tag
        self.sizes = [w[-1] - w[0] for w in self.workers]
        self._epochs: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    def _epoch(self, worker: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(slice starts in visiting order, cumulative lengths) of one worker's epoch."""
        key = (worker, epoch)
        if key not in self._epochs:
            bounds = np.asarray(self.workers[worker], dtype=np.int64)
            seq = np.random.SeedSequence(self.seed, spawn_key=(_SLICES, self.tag, worker, epoch))
            order = np.random.default_rng(seq).permutation(len(bounds) - 1)
            starts, lengths = bounds[:-1][order], np.diff(bounds)[order]
            self._epochs[key] = (starts, np.concatenate(([0], np.cumsum(lengths))))
            if len(self._epochs) > _CACHE * len(self.workers):
                self._epochs.popitem(last=False)
        return self._epochs[key]

    def _turn(self, offset: int) -> tuple[int, int]:
        """(worker, its sample number) of draw `offset` within an epoch: round r visits the
        workers holding more than r samples, in order."""
        sizes = self.sizes
        lo, hi = 0, max(sizes)  # the round: the largest r with sum(min(s, r)) <= offset
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(min(s, mid) for s in sizes) <= offset:
                lo = mid
            else:
                hi = mid - 1
        rest = offset - sum(min(s, lo) for s in sizes)
        active = [w for w, s in enumerate(sizes) if s > lo]
        return active[rest], lo

    def index(self, draw: int) -> int:
        """The dataset index of draw `draw` (>= 0)."""
        epoch, offset = divmod(draw, self.num_samples)
        worker, j = self._turn(offset)
        starts, cum = self._epoch(worker, epoch)
        s = int(np.searchsorted(cum, j, side="right")) - 1
        return int(starts[s] + (j - cum[s]))


class BlendOrder:
    """Dataset and draw of each stream position (module docstring)."""

    def __init__(self, weights: Sequence[float], *, seed: int) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not len(w) or not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(
                f"blend weights must be finite, >= 0 and not all 0, got {list(weights)}"
            )
        self.probabilities = w / w.sum()
        self.seed = seed
        self._before: list[np.ndarray] = [np.zeros(len(w), dtype=np.int64)]  # counts before block
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()

    def _choices(self, block: int) -> np.ndarray:
        if block not in self._blocks:
            seq = np.random.SeedSequence(self.seed, spawn_key=(_BLEND, block))
            rng = np.random.default_rng(seq)
            self._blocks[block] = rng.choice(
                len(self.probabilities), size=BLOCK, p=self.probabilities
            )
            if len(self._blocks) > _CACHE:
                self._blocks.popitem(last=False)
        return self._blocks[block]

    def locate(self, position: int) -> tuple[int, int]:
        """(dataset, draw of that dataset) of stream position `position`."""
        if len(self.probabilities) == 1:
            return 0, position
        block, offset = divmod(position, BLOCK)
        while len(self._before) <= block:
            b = len(self._before) - 1
            counts = np.bincount(self._choices(b), minlength=len(self.probabilities))
            self._before.append(self._before[-1] + counts)
        choices = self._choices(block)
        dataset = int(choices[offset])
        return dataset, int(
            self._before[block][dataset] + np.count_nonzero(choices[:offset] == dataset)
        )
