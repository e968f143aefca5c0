"""planner.worker_pool: plain worker subprocesses (no multiprocessing semaphore, no tracker)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from megatron_dip.planner.worker_pool import WorkerDiedError, WorkerPool


def _power(base: int, task: int) -> int:
    if task < 0:
        raise ValueError(f"negative task {task}")
    if task == 99:
        os.kill(os.getpid(), signal.SIGKILL)
    return base**task


def _children() -> set[int]:
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _semaphores() -> list[str]:
    return [
        ln for ln in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines() if "/sem." in ln
    ]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_tasks_answer_in_order_errors_travel_and_nothing_is_left() -> None:
    before, semaphores = _children(), _semaphores()  # earlier tests' (checkpoint writers) stay
    with WorkerPool(2, _power, 3) as pool:
        assert pool.map(range(6)) == [1, 3, 9, 27, 81, 243]
        assert len(_children() - before) == 2
        with pytest.raises(ValueError, match="negative task -1"):
            pool.submit(-1).result(timeout=60)
        assert pool.submit(2).result(timeout=60) == 9  # the worker that raised still serves
        with pytest.raises(WorkerDiedError, match="ended"):
            pool.submit(99).result(timeout=60)
        assert pool.map([1, 2, 3]) == [3, 9, 27]  # on the worker left
        with pytest.raises(WorkerDiedError, match="ended"):
            pool.submit(99).result(timeout=60)
        with pytest.raises(WorkerDiedError, match="every worker"):
            pool.submit(1).result(timeout=60)
    assert _children() == before  # killed and reaped
    assert _semaphores() == semaphores
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(1)
