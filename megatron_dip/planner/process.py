"""The planner process itself: how it is started, how it talks to its service, how it dies.

The process is a plain `subprocess` of the rank that owns the service (not `multiprocessing`:
its queues and values are POSIX semaphores, kept by a resource-tracker process that outlived a
killed job and left `/dev/shm/sem.mp-*` behind). Messages are pickled frames over two pipes
(`FramedPipe`); nothing is shared but those file descriptors, so nothing is left behind.

It dies with its parent in every state, within `PARENT_POLL_S`:
* before anything is imported, the bootstrap (`BOOTSTRAP`) asks the kernel to SIGKILL it when
  the thread that started it ends (Linux `prctl(PR_SET_PDEATHSIG)`), and exits at once if its
  parent is already gone;
* a thread polls `os.getppid()` (every other system, and a second line of defence);
* the parent closing its pipe (a clean stop, or any death) ends it too.

While it lives, a heartbeat thread sends ("beat", seconds since the planning loop last made
progress) every `BEAT_S`; the service kills and restarts a planner whose heartbeat stops
(stopped, or stuck holding the interpreter) or whose loop makes no progress for too long
(`PlannerService.check_heartbeat`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

BEAT = "beat"
BEAT_S = 0.5
PARENT_POLL_S = 0.5
_HEADER = struct.Struct("<Q")

# Runs with `python -c` before any of our modules is imported (module docstring); argv: the
# parent's pid, the parent's sys.path, the child's read and write descriptors, and its entry
# point ("module:function", called with parent=, read_fd=, write_fd=).
BOOTSTRAP = """
import ctypes, importlib, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != parent:
    os._exit(0)
sys.path[:0] = [p for p in sys.argv[2].split(os.pathsep) if p]
module, _, function = sys.argv[5].partition(":")
entry = getattr(importlib.import_module(module), function)
entry(parent=parent, read_fd=int(sys.argv[3]), write_fd=int(sys.argv[4]))
"""


class FramedPipe:
    """Pickled messages over a pair of pipe file descriptors; `send` is thread-safe."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _HEADER.pack(len(data)) + data
        with self._lock:
            view = memoryview(frame)
            while view:
                view = view[os.write(self.write_fd, view) :]

    def recv(self) -> Any:
        """The next message; EOFError once the other end is closed."""
        (size,) = _HEADER.unpack(self._read(_HEADER.size))
        return pickle.loads(self._read(size))

    def _read(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            chunk = os.read(self.read_fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the other end of the planner pipe is closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


CLOSED = ("closed",)  # what a reader thread queues once its pipe is closed


def pump(
    pipe: FramedPipe, into: queue.Queue, on_message=None, *, closed: Any = CLOSED
) -> threading.Thread:
    """A daemon thread moving `pipe`'s messages into `into` (`on_message(msg)` may consume one
    by returning True); queues `closed` at the end."""

    def run() -> None:
        try:
            while True:
                message = pipe.recv()
                if on_message is None or not on_message(message):
                    into.put(message)
        except (EOFError, OSError):
            into.put(closed)

    thread = threading.Thread(target=run, name="dip-planner-pipe", daemon=True)
    thread.start()
    return thread


# -- the parent's side ----------------------------------------------------------------------------


def start_child(entry: str) -> tuple[subprocess.Popen, FramedPipe]:
    """A plain Python subprocess of this one running `entry` ("module:function", called with
    `parent=`, `read_fd=`, `write_fd=`) after `BOOTSTRAP`, and this side's pipe to it. It dies
    with the thread that calls this (`BOOTSTRAP`); no multiprocessing object is involved, so
    nothing outlives it (module docstring)."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    argv = [
        sys.executable, "-c", BOOTSTRAP, str(os.getpid()), os.pathsep.join(sys.path),
        str(to_child_r), str(from_child_w), entry,
    ]  # fmt: skip
    # stdout goes to stderr: nothing a child's libraries print joins the training log.
    popen = subprocess.Popen(
        argv,
        pass_fds=(to_child_r, from_child_w),
        stdin=subprocess.DEVNULL,
        stdout=2,
        close_fds=True,
    )
    os.close(to_child_r)
    os.close(from_child_w)
    return popen, FramedPipe(from_child_r, to_child_w)


class PlannerProcess:
    """The running planner process, seen from its service: send, receive, liveness, kill."""

    def __init__(self, setup: Any) -> None:
        self.popen, self.pipe = start_child("megatron_dip.planner.process:child_main")
        self.results: queue.Queue = queue.Queue()
        self.last_beat = time.monotonic()
        self.beating = False  # no heartbeat yet: the process is still importing
        self.busy_s = 0.0  # the planning loop's time since its last progress, last heartbeat
        pump(self.pipe, self.results, self._on_message)
        self.send(setup)

    def _on_message(self, message: Any) -> bool:
        if isinstance(message, tuple) and message and message[0] == BEAT:
            self.last_beat, self.busy_s = time.monotonic(), float(message[1])
            self.beating = True
            return True
        return False

    def send(self, message: Any) -> None:
        with contextlib.suppress(OSError):  # a dead planner: `is_alive` tells the service
            self.pipe.send(message)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def silent_s(self) -> float:
        """Seconds since the last heartbeat."""
        return time.monotonic() - self.last_beat

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def stop_signal(self) -> None:
        """SIGSTOP the process (fault injection in tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signal.SIGSTOP)

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)

    def close(self) -> None:
        self.pipe.close()


# -- the child's side -----------------------------------------------------------------------------


class ChildChannels:
    """What `planner_loop.planner_loop` talks through inside the planner process: `batches` (a
    queue of batches, calibrations and the None stop sentinel), `results.put`, `decided.value`
    (iterations <= it are decided), `tick()` (the loop made progress), `started_at`."""

    def __init__(self, pipe: FramedPipe, *, started_at: float) -> None:
        self.pipe = pipe
        self.started_at = started_at
        self.batches: queue.Queue = queue.Queue()
        self.decided = _Value(-1)
        self.results = self  # results.put(item) sends it
        self.progress = time.monotonic()

    def put(self, item: Any) -> None:
        self.pipe.send(item)

    def tick(self) -> None:
        self.progress = time.monotonic()

    def undecided(self, batch) -> bool:
        return batch.iteration > self.decided.value

    def send(self, planner, batch, variant: str, version: int, search: bool) -> None:
        from ..schedule.serialize import plan_to_bytes

        plans = [p.plan for p in planner.plan_batch(batch, search=search)]
        self.put((variant, batch.iteration, [plan_to_bytes(p) for p in plans], version))
        self.tick()

    def on_message(self, message: Any) -> bool:
        """Consume ("decided", iteration) messages; queue everything else."""
        if isinstance(message, tuple) and message and message[0] == "decided":
            self.decided.value = max(self.decided.value, int(message[1]))
            return True
        return False


class _Value:
    def __init__(self, value: int) -> None:
        self.value = value


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the thread that started it)
    ends, and exit now if it already has: for processes forked by the planner (the search
    workers), which do not inherit the planner's own setting (`BOOTSTRAP`)."""
    import ctypes

    parent = os.getppid()
    with contextlib.suppress(Exception):  # not Linux: the pool ends with its planner's pipes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:
        os._exit(0)


def watch_parent(parent: int) -> None:
    def run() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=run, name="dip-planner-parent", daemon=True).start()


def _heartbeat(channels: ChildChannels) -> None:
    def run() -> None:
        while True:
            try:
                channels.put((BEAT, time.monotonic() - channels.progress))
            except OSError:
                os._exit(0)  # the parent's end is gone
            time.sleep(BEAT_S)

    threading.Thread(target=run, name="dip-planner-beat", daemon=True).start()


def child_main(*, parent: int, read_fd: int, write_fd: int) -> None:
    """Body of the planner process after `BOOTSTRAP` (module docstring)."""
    watch_parent(parent)
    pipe = FramedPipe(read_fd, write_fd)
    channels = ChildChannels(pipe, started_at=time.time())
    _heartbeat(channels)  # before unpickling the planner (its imports take a while)
    try:
        make_planner, faults, channels.started_at = pipe.recv()
    except EOFError:
        return
    pump(pipe, channels.batches, channels.on_message, closed=None)  # None: stop
    from .planner_loop import planner_loop

    planner_loop(make_planner, channels, faults=faults)
    os._exit(0)  # daemon threads may hold the pipe: leave at once


__all__ = ["BOOTSTRAP", "ChildChannels", "FramedPipe", "PlannerProcess", "child_main"]
