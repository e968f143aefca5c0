"""One job at a time on a --save directory: a lock held for the whole run.

Two jobs saving into one directory replace each other's checkpoints (and the tracker) without a
word. Rank 0 of a job with --save takes `DIR/.megatron_dip.lock` at start-up, before the model is
built, and holds it until the job ends:

* an advisory `fcntl` lock on the file (released by the kernel when the process dies, however it
  dies; on NFS and Lustre where the mount supports it, across hosts);
* the file's content names the holder (host, pid, job id, start time), for file systems without
  locks and for the refusal: a second job is refused, naming the holder.

A lock file whose holder is gone is taken over with a warning: on the same host when its process
no longer runs (checked by pid and start time, so a reused pid does not count), on another host
when the `fcntl` lock was free (its job ended without removing the file). Where the file system
has no locks and the holder is on another host nothing can tell whether it still runs: the job is
refused and the message says which file to delete once that job has ended. A job that ends
normally empties the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config.arguments import ConfigError

LOCK_FILE = ".megatron_dip.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class SaveLockedError(ConfigError):
    """Another job holds the --save directory (the message names it)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what the lock file says."""

    host: str
    pid: int
    job: str
    started: float  # the holder process's start time (seconds since the epoch)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, job {self.job}, started {when}"

    def running_here(self) -> bool:
        """Whether this host runs the holder process (the same pid and start time)."""
        import psutil

        try:
            return abs(psutil.Process(self.pid).create_time() - self.started) < 1.0
        except psutil.Error:
            return False


def this_process(job: str) -> Holder:
    import psutil

    return Holder(socket.gethostname(), os.getpid(), job, psutil.Process().create_time())


def job_id() -> str:
    """The launcher's job id (SLURM's, else torchrun's run id), for the lock file only."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "none"


class SaveLock:
    """The lock of one --save directory (module docstring); `acquire` and `release` on one
    process (rank 0)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, me: Holder) -> str | None:
        """Take the lock for `me`; returns a warning when a stale holder's lock was taken over.
        Raises `SaveLockedError` naming the holder when another job holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            warning = self._take(fd, me)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return warning

    def _take(self, fd: int, me: Holder) -> str | None:
        locks = True
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise self._refusal(_read(fd), "holds its lock") from None
            if e.errno not in _NO_LOCKS:
                raise
            locks = False  # a file system without locks: the file's content decides
        previous = _read(fd)
        warning = None
        if previous is not None and previous.pid != me.pid:
            if previous.host == me.host:
                if previous.running_here():
                    raise self._refusal(previous, "is named in its lock file and still runs")
                warning = f"{previous.describe()}: no longer running"
            elif locks:
                warning = f"{previous.describe()}: its lock was free (the job ended)"
            else:
                raise self._refusal(
                    previous,
                    "is named in its lock file, on another host, and this file system has no "
                    f"locks to tell whether it still runs; once that job has ended, delete "
                    f"{self.path}",
                )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
        os.fsync(fd)
        if warning is None:
            return None
        return f"--save {self.root}: took over the lock of {warning}"

    def _refusal(self, holder: Holder | None, what: str) -> SaveLockedError:
        who = f"another job ({holder.describe()})" if holder else "another job"
        return SaveLockedError(
            f"--save {self.root}: {who} {what}; two jobs saving there would replace each "
            "other's checkpoints: wait for it to end, or choose another --save"
        )

    def release(self) -> None:
        """Empty the file (no holder) and drop the lock."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        with contextlib.suppress(OSError):
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _read(fd: int) -> Holder | None:
    """The holder the lock file names (None: empty or unreadable: nobody)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode())
        return Holder(str(data["host"]), int(data["pid"]), str(data["job"]), float(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def hold_save_lock(root: str | Path, *, rank: int) -> SaveLock | None:
    """Collective over the world group, after it exists and before any work: rank 0 takes the
    lock of --save `root`; every rank raises the same `SaveLockedError` when it is held.
    Returns rank 0's lock (to `release` at the end), None on the other ranks."""
    import logging

    import torch.distributed as dist

    lock, outcome = None, [None, None]
    if rank == 0:
        lock = SaveLock(root)
        try:
            outcome[1] = lock.acquire(this_process(job_id()))
        except SaveLockedError as e:
            outcome[0] = str(e)
        except OSError as e:
            outcome[0] = f"--save {root}: cannot create its lock file ({e.strerror or e})"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise SaveLockedError(outcome[0])
    if outcome[1] is not None:
        logging.getLogger(__name__).warning(outcome[1])
    return lock
