"""Scoring the start-up placement candidates on several CPU cores.

The start-up search (`placement.choose_dip_placement`) plans and simulates calibration batches
for every candidate placement: minutes of CPU on rank 0 for a paper-scale model, while the other
ranks of the job wait and the node's cores are idle. `CandidateScorer` scores on worker
processes beside its own, each next candidate handed to the first that frees, once one candidate
scored here took long enough (`POOL_WORTH_S`) to pay for starting them (a tiny model's search
stays in one process).

Each worker is a fresh interpreter (`worker_pool.WorkerPool`: not forked, since the rank that
searches runs process-group threads, and not `multiprocessing`, whose semaphores and resource
tracker a killed job could leave behind), receives the scoring function and the candidates once
(pickled) and then candidate indices; it dies with the process that started it. A score is a
deterministic function of the calibration data, so the scores, and hence the choice, are the
ones one process computes, whatever the worker count and whichever worker finishes first.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from .worker_pool import WorkerPool

logger = logging.getLogger(__name__)

# A worker imports the planner (about 2 s of CPU) before it scores: below this many seconds per
# candidate, scoring here is as fast.
POOL_WORTH_S = 2.0


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _score_one(scoring: tuple[Callable[[Any], float], Sequence[Any]], index: int) -> float:
    """A worker's task: the score of candidate `index` (`scoring`: the function, the items)."""
    evaluate, items = scoring
    return evaluate(items[index])


def _next(queue: Iterator[int], stop: Callable[[int], bool]) -> int | None:
    """The next index of `queue`, None once it is empty or `stop` refuses one (then for good:
    the refused index is consumed, so every later call finds `queue` ended or refused too)."""
    i = next(queue, None)
    if i is None or stop(i):
        for _ in queue:  # drain: nothing after a refused index is scored
            pass
        return None
    return i


def _finished(running: dict[Future, int], *, block: bool) -> Iterator[tuple[int, float]]:
    """`(index, score)` of the finished futures of `running` (removed from it), in index
    order; `block`: wait for at least one first."""
    done = (
        wait(running, return_when=FIRST_COMPLETED)[0] if block else [f for f in running if f.done()]
    )
    for future in sorted(done, key=running.__getitem__):
        yield running.pop(future), future.result()


class CandidateScorer:
    """`evaluate` of `items[i]` for the indices asked, on up to `workers` processes (1: here,
    in this process), started once a candidate scored here took `POOL_WORTH_S` or more. Use as
    a context manager; `width` is how many it scores at once (each worker kept busy: no wave
    waits for its slowest member)."""

    def __init__(
        self, evaluate: Callable[[Any], float], items: Sequence[Any], *, workers: int
    ) -> None:
        self.evaluate, self.items = evaluate, list(items)
        self.width = max(1, min(workers, len(self.items)))
        self._pool: WorkerPool | None = None
        self._slow = False  # a candidate scored here took POOL_WORTH_S or more

    def __enter__(self) -> CandidateScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def scored(
        self, indices: Sequence[int], *, stop: Callable[[int], bool]
    ) -> Iterator[tuple[int, float]]:
        """`(i, score of items[i])` for `indices`, taken in their order: each index is asked
        `stop(i)` before it is scored (the caller updates what `stop` reads between results),
        and from the first one that answers True on, none is scored. On workers up to `width`
        are scored at once, each next index handed out as soon as a worker frees, and results
        come back as they finish: which indices get scored may then depend on timing, never
        a score (a function of its item alone)."""
        queue = iter(indices)
        for i in queue:
            if stop(i):
                return
            if self._slow and self.width > 1:
                yield from self._scored_on_workers(itertools.chain([i], queue), stop)
                return
            started = time.perf_counter()  # decides where to score, never what the score is
            score = self.evaluate(self.items[i])
            self._slow = time.perf_counter() - started >= POOL_WORTH_S
            yield i, score

    def _scored_on_workers(
        self, queue: Iterator[int], stop: Callable[[int], bool]
    ) -> Iterator[tuple[int, float]]:
        """`width - 1` worker processes and this one score at once; each worker holds one
        candidate queued behind the one it scores, so none idles while this one scores."""
        pool, running = self._workers(), {}
        while True:
            while len(running) < self.width and (i := _next(queue, stop)) is not None:
                running[pool.submit(i)] = i
            yield from _finished(running, block=False)
            if (i := _next(queue, stop)) is not None:
                yield i, self.evaluate(self.items[i])
            elif running:
                yield from _finished(running, block=True)
            else:
                return

    def _workers(self) -> WorkerPool:
        if self._pool is None:
            logger.info(
                "a candidate took %.0f s or more to score: scoring the rest on %d processes",
                POOL_WORTH_S,
                self.width,
            )
            self._pool = WorkerPool(self.width - 1, _score_one, (self.evaluate, self.items))
        return self._pool
