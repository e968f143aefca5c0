"""Run a function on N gloo processes once and bring every rank's results back; never hang.

`run_world(world_size=N, target="module:function", kwargs=...)` spawns N processes (spawn
context), each initialising one gloo process group through a file store, importing `target` and
calling `function(rank=r, world_size=N, **kwargs)`; the return values (picklable: numbers,
numpy arrays) come back as a list indexed by rank. A rank that raises sends its traceback; the
parent then kills the other ranks (which would otherwise wait for it forever) and raises
`WorkerError` with that traceback. A run exceeding `timeout` seconds is killed and reported as
`WorkerError` naming the ranks that had not finished. Every process is joined or killed.

Workers are daemonic by default, and a daemonic process may not start children of its own;
`daemon=False` makes them ordinary processes, for targets that start one (the trainer's planner
service). They are still joined or killed here like the others.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any


class WorkerError(RuntimeError):
    """A worker process failed, died or timed out (the message holds its traceback)."""


def _child(rank: int, world_size: int, store: str, target: str, kwargs: dict, out) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        logging.basicConfig(level=logging.WARNING)
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
        )
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        result = func(rank=rank, world_size=world_size, **kwargs)
        out.put(("ok", rank, result))
    except BaseException:  # report everything, KeyboardInterrupt included
        out.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # the process exits right after; nothing useful to report
            pass


def run_world(
    *,
    world_size: int,
    target: str,
    kwargs: dict | None = None,
    timeout: float = 240.0,
    daemon: bool = True,
) -> list[Any]:
    """Run `target` on `world_size` gloo ranks; return the per-rank results (module docstring).
    `daemon=False` lets the target start child processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, store, target, kwargs or {}, out),
                daemon=daemon,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, out, world_size, timeout)
        finally:
            _reap(procs)


def _collect(procs, out, world_size: int, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            pending = sorted(set(range(world_size)) - set(results))
            raise WorkerError(f"ranks {pending} did not finish within {timeout:.0f} s")
        try:
            status, rank, payload = out.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
            if dead and out.empty():
                time.sleep(0.5)  # a final message may still be in the pipe
                if out.empty():
                    codes = {r: procs[r].exitcode for r in dead}
                    raise WorkerError(
                        f"ranks {dead} died without a result (exit codes {codes})"
                    ) from None
            continue
        if status == "error":
            raise WorkerError(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    return [results[r] for r in range(world_size)]


def _reap(procs) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
