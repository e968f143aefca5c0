"""Keep native libraries' console output out of stdout (training logs, tools' tables).

HiGHS (scipy.optimize.milp, the recompute MILP of `memory.py`) prints some messages from C++
straight to file descriptor 1 whatever `disp` says (e.g. `HighsMipSolverData::...`), which lands
in the middle of a training log or a tool's JSON/table output. `native_stdout_silenced()`
points descriptor 1 at /dev/null for the duration of a call, flushing Python's and C's stdout
buffers on both sides so nothing written before or after is lost or redirected. Descriptor 1 is
process-wide, so the swap is serialised by a lock; other threads' Python `print`s meanwhile stay
in Python's buffer (flushed after), logging goes to stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator

_LOCK = threading.RLock()


def _flush_c_stdout() -> None:
    with contextlib.suppress(Exception):  # no C library to flush (other platforms)
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """Discard what native code writes to file descriptor 1 inside the block (module docstring)."""
    with _LOCK:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        _flush_c_stdout()
        try:
            saved = os.dup(1)
        except OSError:  # no descriptor 1 at all: nothing to protect
            yield
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            yield
        finally:
            _flush_c_stdout()
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
