"""A pool of plain worker subprocesses for the planner's CPU-parallel work.

The start-up placement search scores its candidates on several CPU cores of rank 0
(`candidate_pool`). Its workers are started as the planner process itself is
(`process.start_child`), not with `multiprocessing` / `ProcessPoolExecutor`: those keep their
queues' locks in POSIX named semaphores and start a resource-tracker process, which a killed
job can leave behind with its `/dev/shm/sem.mp-*` files (the fault matrix checks that a failed
job leaves no process and no semaphore). Here a worker is a fresh interpreter (never a fork of a
rank that runs process-group threads, whose locks a forked child could inherit held) that talks
through two pipes, dies with the thread that started it, and is killed at `shutdown`. (The
root-parallel order search inside the planner process still forks a `ProcessPoolExecutor`: that
process runs no process-group threads, a forked pool unlinks its semaphores at once and starts no
tracker, and a fresh interpreter per plan would cost its imports on every plan.)

Each worker receives `(function, payload)` once (pickled) and then tasks; it answers
`function(payload, task)`, or the exception it raised. `submit` returns a
`concurrent.futures.Future`, so callers wait on results as they would on an executor's.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from .process import FramedPipe, start_child, watch_parent

WORKER_ENTRY = "megatron_dip.planner.worker_pool:worker_main"
_STOP_WAIT_S = 5.0  # a killed worker is reaped within this


class WorkerDiedError(RuntimeError):
    """A worker process ended while it held a task (killed, out of memory, crashed)."""


class _Worker:
    """One worker process, this side: its pipe, and the task it holds (None: idle)."""

    def __init__(self, function: Callable[[Any, Any], Any], payload: Any) -> None:
        self.popen, self.pipe = start_child(WORKER_ENTRY)
        self.pipe.send((function, payload))
        self.task: tuple[int, Future] | None = None
        self.alive = True


class WorkerPool:
    """`function(payload, task)` for each submitted task, on `workers` worker processes, each
    next task given to the first worker that frees. Use as a context manager; leaving it (or
    `shutdown`) cancels the tasks not started and kills the workers."""

    def __init__(self, workers: int, function: Callable[[Any, Any], Any], payload: Any) -> None:
        self._lock = threading.Lock()
        self._queued: deque[tuple[int, Any, Future]] = deque()
        self._next_id = 0
        self._closed = False
        self._workers = [_Worker(function, payload) for _ in range(max(1, workers))]
        for worker in self._workers:
            threading.Thread(
                target=self._read, args=(worker,), name="dip-pool-reader", daemon=True
            ).start()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def submit(self, task: Any) -> Future:
        """A future of `function(payload, task)`."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("submit on a worker pool that was shut down")
            self._queued.append((self._next_id, task, future))
            self._next_id += 1
            self._dispatch()
        return future

    def map(self, tasks: Iterable[Any]) -> list[Any]:
        """`function(payload, task)` for each of `tasks`, in their order (raises the first
        task's exception, in order)."""
        return [future.result() for future in [self.submit(t) for t in tasks]]

    def shutdown(self) -> None:
        """Cancel the queued tasks, kill the workers and reap them."""
        with self._lock:
            self._closed = True
            for _, _, future in self._queued:
                future.cancel()
            self._queued.clear()
        for worker in self._workers:
            with contextlib.suppress(ProcessLookupError):
                worker.popen.kill()
            with contextlib.suppress(Exception):
                worker.popen.wait(timeout=_STOP_WAIT_S)
            worker.pipe.close()

    def _dispatch(self) -> None:
        """Hand queued tasks to idle workers (the lock held); with no worker left alive, fail
        them."""
        if not any(w.alive for w in self._workers):
            while self._queued:
                future = self._queued.popleft()[2]
                if future.set_running_or_notify_cancel():
                    future.set_exception(WorkerDiedError("every worker process of the pool ended"))
        for worker in self._workers:
            if not self._queued:
                return
            if worker.task is not None or not worker.alive:
                continue
            task_id, task, future = self._queued.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            worker.task = (task_id, future)
            # A worker that is gone: its reader fails the task (and marks it dead).
            with contextlib.suppress(OSError):
                worker.pipe.send((task_id, task))

    def _read(self, worker: _Worker) -> None:
        """The reader thread of one worker: settle its tasks' futures as answers come."""
        while True:
            try:
                ok, task_id, value = worker.pipe.recv()
            except (EOFError, OSError):
                self._worker_ended(worker)
                return
            with self._lock:
                held, worker.task = worker.task, None
                self._dispatch()
            if held is not None and held[0] == task_id:
                (held[1].set_result if ok else held[1].set_exception)(value)

    def _worker_ended(self, worker: _Worker) -> None:
        with self._lock:
            held, worker.task, worker.alive = worker.task, None, False
            self._dispatch()
        if held is not None and not held[1].done():
            code = worker.popen.poll()
            held[1].set_exception(
                WorkerDiedError(
                    f"worker process {worker.popen.pid} ended (exit code {code}) while it held a task"
                )
            )


def worker_main(*, parent: int, read_fd: int, write_fd: int) -> None:
    """Body of a worker process after `process.BOOTSTRAP`: answer tasks until the pipe closes."""
    watch_parent(parent)
    pipe = FramedPipe(read_fd, write_fd)
    try:
        function, payload = pipe.recv()
        while True:
            task_id, task = pipe.recv()
            try:
                answer = (True, task_id, function(payload, task))
            except Exception as exc:  # the caller's future raises it
                answer = (False, task_id, _picklable(exc))
            pipe.send(answer)
    except (EOFError, OSError):
        pass
    os._exit(0)


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


__all__ = ["WorkerDiedError", "WorkerPool", "worker_main"]
