"""Scoring the start-up placement candidates on several CPU cores.

The start-up search (`placement.choose_dip_placement`) plans and simulates calibration batches
for every candidate placement: minutes of CPU on rank 0 for a paper-scale model, while the other
ranks of the job wait and the node's cores are idle. `CandidateScorer` scores a wave of
candidates at once on worker processes, once one candidate scored here took long enough
(`POOL_WORTH_S`) to pay for starting them (a tiny model's search stays in one process).

Each worker is *spawned*, not forked (the rank that searches already runs process-group threads,
and a forked child may inherit a lock one of them held), receives the scoring function once
(pickled) and then candidate indices; it dies with the process that started it. A score is a
deterministic function of the calibration data, so the scores, and hence the choice, are the
ones one process computes, whatever the worker count and whichever worker finishes first.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from .process import die_with_parent

logger = logging.getLogger(__name__)

# A worker imports the planner (about 2 s of CPU) before it scores: below this many seconds per
# candidate, scoring here is as fast.
POOL_WORTH_S = 2.0
_SCORE: list[Callable[[Any], float]] = []  # a worker's scoring function and its items
_ITEMS: list[Sequence[Any]] = []


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _start_worker(evaluate: Callable[[Any], float], items: Sequence[Any]) -> None:
    die_with_parent()
    _SCORE[:] = [evaluate]
    _ITEMS[:] = [items]


def _score_one(index: int) -> float:
    return _SCORE[0](_ITEMS[0][index])


class CandidateScorer:
    """`evaluate` of `items[i]` for the indices asked, on up to `workers` processes (1: here,
    in this process), started once a candidate scored here took `POOL_WORTH_S` or more. Use as
    a context manager; `width` is how many it scores at once."""

    def __init__(
        self, evaluate: Callable[[Any], float], items: Sequence[Any], *, workers: int
    ) -> None:
        self.evaluate, self.items = evaluate, list(items)
        self.width = max(1, min(workers, len(self.items)))
        self._pool: ProcessPoolExecutor | None = None
        self._slow = False  # a candidate scored here took POOL_WORTH_S or more

    def __enter__(self) -> CandidateScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def score(self, indices: Sequence[int]) -> list[float]:
        """The scores of `items[i]` for `indices`, in that order."""
        scores: list[float] = []
        for n, i in enumerate(indices):
            if self._slow and self.width > 1:
                return scores + self._score_on_workers(indices[n:])
            started = time.perf_counter()  # decides where to score, never what the score is
            scores.append(self.evaluate(self.items[i]))
            self._slow = time.perf_counter() - started >= POOL_WORTH_S
        return scores

    def _score_on_workers(self, indices: Sequence[int]) -> list[float]:
        if self._pool is None:
            logger.info(
                "a candidate took %.0f s or more to score: scoring the rest on %d processes",
                POOL_WORTH_S,
                self.width,
            )
            self._pool = ProcessPoolExecutor(
                max_workers=self.width,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self.evaluate, self.items),
            )
        return list(self._pool.map(_score_one, indices))
