"""Helpers, no tests: the processes of `test_faults.py`'s fault matrix.

* `planner_parent(state)`: a stand-in rank that starts a `PlannerService` and brings its planner
  process to `state` (starting, idle, planning), prints the planner's pid, then waits to be
  killed (the test SIGKILLs it and times how long the planner outlives it);
* `fault_rank(...)`: one rank of a 4-process tiny-vlm PP2 x DP2 training job whose fault (a
  rank that stops or dies at iteration 3) the test injects from outside;
* `LauncherJob`: a real `torchrun --standalone` job of `pretrain_vlm_dip.py` (tiny-vlm PP2, two
  ranks, a planner process on rank 0); torchrun's agent hosts the job's store, and the test
  SIGKILLs it (the launcher's death);
* `alive(pid)` / `wait_gone(pids, bound)`: whether processes are gone (zombies count as gone);
  `gone_after(pids, bound)`: when each one went.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from pathlib import Path

TINY = [
    "--model", "tiny-vlm", "--global-batch-size", "4", "--dip-image-size", "32", "--lr", "1e-3",
    "--pipeline-model-parallel-size", "2", "--log-interval", "1", "--seed", "7",
]  # fmt: skip


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids, bound: float) -> float | None:
    """Seconds until every process of `pids` is gone, None if some outlive `bound`."""
    start = time.monotonic()
    while time.monotonic() - start < bound:
        if not any(alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def gone_after(pids, bound: float) -> dict[int, float | None]:
    """Seconds until each process of `pids` is gone (None: it outlived `bound`)."""
    start, left, found = time.monotonic(), set(pids), {}
    while left and time.monotonic() - start < bound:
        for pid in [p for p in left if not alive(p)]:
            found[pid] = time.monotonic() - start
            left.discard(pid)
        time.sleep(0.05)
    return {**found, **dict.fromkeys(left)}


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def planner_parent(state: str) -> None:
    """Module docstring. Prints "planner PID" once the planner is in `state`."""
    from test_planner_service import batch, make_planner
    from torch.distributed import TCPStore

    from megatron_dip.planner.service import PlannerService, StoreAddress

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = StoreAddress("127.0.0.1", master.port, 10.0)
    slow = state == "planning"
    factory = functools.partial(make_planner, rollouts=2, sleep_s=30.0 if slow else 0.0)
    if state == "searching":  # with search worker processes of its own (forked)
        factory = functools.partial(make_planner, rollouts=10**6, workers=2, budget_s=120.0)
    service = PlannerService(factory, address, lookahead=2)
    service.start()
    if state in ("idle", "planning", "searching"):
        deadline = time.monotonic() + 120
        while service.startup is None and time.monotonic() < deadline:
            time.sleep(0.05)
    if state in ("planning", "searching"):
        service.submit(batch(0))
        time.sleep(1.0)  # the planner is inside its 30 s plan (or 120 s search) now
    if state == "searching":
        deadline = time.monotonic() + 60
        while len(descendants(os.getpid())) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # the planner and its two search workers
    print(f"planner {service.process.pid}", flush=True)
    time.sleep(600)


def fault_rank(*, rank: int, world_size: int, data: str, extra: list[str]) -> dict:
    """One rank of the fault job (a `distributed_harness` target that reports its error)."""
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.validate import resolve
    from megatron_dip.training.iteration.loop import pretrain

    argv = [*TINY, "--dip-data", f"llava:{data}", *extra]
    spec = resolve(parse_config(argv), world_size=world_size, cuda=False)
    try:
        pretrain(spec)
    except Exception as e:  # the line this rank ends with, and when
        return {"error": f"{type(e).__name__}: {e}", "at": time.time(), "pid": os.getpid()}
    return {"error": None, "at": time.time(), "pid": os.getpid()}


def rank_main(rank: int, world_size: int, store: str, out: str, data: str, extra: list[str]):
    """One rank of a fault job, as torchrun would start it (own process, no multiprocessing):
    the outcome goes to `out` as JSON."""
    import json
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    from megatron_dip.training.entry import exit_now

    result = fault_rank(rank=rank, world_size=world_size, data=data, extra=extra)
    Path(out).write_text(json.dumps(result))
    if result["error"] is not None and result["error"].startswith("StallError"):
        exit_now(1)  # as the entry point does


class FaultJob:
    """A 4-rank job of `rank_main` processes in `root`; `metrics` (rank 0's
    --dip-metrics-json) tells how far it got."""

    def __init__(self, root: Path, data: str, extra: list[str], world_size: int = 4) -> None:
        import subprocess

        self.root, self.world_size = root, world_size
        root.mkdir(parents=True, exist_ok=True)
        self.metrics = root / "metrics.jsonl"
        extra = [*extra, "--dip-metrics-json", str(self.metrics)]
        here = str(Path(__file__).resolve())
        self.procs = []
        for r in range(world_size):
            with open(root / f"rank{r}.log", "w") as log:  # the child keeps its own copy
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            here,
                            "rank",
                            str(r),
                            str(world_size),
                            str(root / "store"),
                            str(self.out(r)),
                            data,
                            *extra,
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=log,
                    )
                )

    def out(self, rank: int) -> Path:
        return self.root / f"rank{rank}.json"

    def wait_iterations(self, n: int, bound: float) -> bool:
        """Whether the job logged `n` iterations within `bound` seconds; False as soon as a
        rank ended before (`ended()` then names why)."""
        return _wait_metrics(self.metrics, n, bound, lambda: any(self.ended()))

    def wait_next_iteration(self, bound: float) -> bool:
        """Whether rank 0 logs one more iteration within `bound` seconds, watched closely (every
        5 ms): right after, every rank has just left that iteration's stats gather together,
        so none has been waiting on another for long (`_wait_metrics`)."""
        done = len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0
        return _wait_metrics(self.metrics, done + 1, bound, lambda: any(self.ended()), poll=0.005)

    def ended(self) -> dict[int, str]:
        """Each rank that already ended: its outcome line (or its exit code)."""
        import json

        out = {}
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                try:
                    out[r] = json.loads(self.out(r).read_text())["error"]
                except (OSError, ValueError, KeyError):
                    out[r] = f"exit code {p.returncode}"
        return out

    def log_tail(self, rank: int, lines: int = 15) -> str:
        """The last `lines` lines of `rank`'s stderr."""
        try:
            return "\n".join((self.root / f"rank{rank}.log").read_text().splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def outcomes(self, ranks, bound: float) -> dict[int, dict]:
        """The JSON outcome of each of `ranks` that reported within `bound` seconds."""
        import json

        deadline, found = time.monotonic() + bound, {}
        while True:
            for r in ranks:
                if r not in found and self.out(r).exists():
                    try:
                        found[r] = json.loads(self.out(r).read_text())
                    except ValueError:  # still being written
                        continue
            if len(found) == len(ranks) or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


class LauncherJob:
    """A torchrun job of the real entry point (module docstring); its log (torchrun's and the
    ranks' stderr, which they inherit) is `log`."""

    def __init__(self, root: Path, data: str, extra: list[str], nproc: int = 2) -> None:
        import subprocess

        root.mkdir(parents=True, exist_ok=True)
        self.metrics, self.log = root / "metrics.jsonl", root / "torchrun.log"
        entry = Path(__file__).resolve().parents[1] / "pretrain_vlm_dip.py"
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(entry), *TINY, "--dip-data", f"llava:{data}",
            *extra, "--dip-metrics-json", str(self.metrics),
        ]  # fmt: skip
        with open(self.log, "w") as log:
            self.launcher = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_iterations(self, n: int, bound: float) -> bool:
        """Whether the job logged `n` iterations within `bound` seconds (False as soon as
        torchrun ended)."""
        return _wait_metrics(self.metrics, n, bound, lambda: self.launcher.poll() is not None)

    def ranks(self) -> set[int]:
        """The rank processes (torchrun's children)."""
        return {p for p in descendants(self.launcher.pid) if _parent(p) == self.launcher.pid}

    def kill(self, family=()) -> None:
        """SIGKILL the launcher and whatever is left of it and of `family` (the processes of
        the job, taken while the launcher lived: its orphans are no longer below it)."""
        import signal

        for pid in [self.launcher.pid, *descendants(self.launcher.pid), *family]:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.launcher.wait()


def _wait_metrics(metrics: Path, n: int, bound: float, ended, poll: float = 0.05) -> bool:
    """Whether `metrics` holds `n` lines within `bound` seconds (looking every `poll` s);
    False once `ended()` holds (the job cannot get there any more)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return True
        if ended():
            return metrics.exists() and len(metrics.read_text().splitlines()) >= n
        time.sleep(poll)
    return False


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    if sys.argv[1] == "rank":
        r, w, store, out, data, *rest = sys.argv[2:]
        rank_main(int(r), int(w), store, out, data, rest)
    else:
        planner_parent(sys.argv[1])
