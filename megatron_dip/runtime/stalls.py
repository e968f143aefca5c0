"""Named phases of the training loop, a heartbeat per rank, and the post-mortem that names the
rank that stalled.

Every blocking step of an iteration (plan fetch, sample agreement, the pipeline schedule, the
data-parallel gradient reduction, the optimizer step, the stats gather, checkpoint save, load
and publish, ...) runs inside `PhaseWatch.phase(name, group=...)`. Its collectives are bounded
by --dip-comm-timeout-s (the groups are created with it, and our own collectives wait with it);
the phase adds no communication of its own on the way.

When a phase fails with a communication error (a timeout, a closed connection: `is_comm_failure`)
the rank does not raise gloo's or NCCL's raw text. It writes a report (its phase, iteration,
group, the error) into the job's store and reads everybody else's for a short grace period
(`PhaseWatch.grace_s`). A rank that is alive but blocked elsewhere cannot report, so every rank
also runs a heartbeat thread that writes a counter and its current phase into the store every
`beat_s` seconds: a rank whose counter did not move during the grace period is *stalled*
(stopped, hung, dead), and its last heartbeat says where it was; so is a rank that reported its
own stall but stopped before finishing that post-mortem (each marks its report done at the end:
a rank that reports and exits stops beating too). Then every rank raises one
`StallError` line naming its own phase and group, the ranks of that group that did and did not
arrive, and the stalled ranks (`describe_stall`). A rank that fails with any other error reports
it too (`report_failure`), so its peers name it instead of the connection it closed.

The heartbeat also notices when the job's store itself is gone (its host, torchrun's agent or
rank 0, was killed): gloo's connections between the ranks outlive it, so the ranks would train
on with nobody to stop them. Each beat writes and then reads its key back (a write alone is
buffered by the socket and "succeeds" once after the host died); once the beats have failed for
`LOST_AFTER_S` (a confirming retry every `RETRY_S`), the rank logs one line naming the store and
its host and ends the process (`on_store_lost`; its planner process and checkpoint writers die
with it). Worst case after the host's death: one beat interval plus `LOST_AFTER_S`, about 2.5 s.

Cost: nothing per collective; one store write and one check per rank every `beat_s` seconds
(at most 2 s).
On NCCL a timed-out collective reaches us only if the watchdog lets it raise (see
docs/training.md, "When a rank stalls": TORCH_NCCL_BLOCKING_WAIT / TORCH_NCCL_ASYNC_ERROR_HANDLING).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .errors import PipelineCommError, StallError

logger = logging.getLogger(__name__)

# Lower-cased fragments of gloo / NCCL / store errors that mean "a peer is gone or late".
_COMM_TEXTS = (
    "timed out", "timeout", "connection closed", "connection reset", "pair closure",
    "broken pipe", "connection refused", "socket", "nccl", "gloo",
)  # fmt: skip
# Each run in a process gets its own store keys (tests run many runs on one store).
_GENERATIONS = itertools.count()
MAX_BEAT_S = 2.0
# The store counts as lost once every beat failed for this long (at least two attempts).
LOST_AFTER_S = 0.5
RETRY_S = 0.5  # how soon a failed beat is retried (each failure prints a C++ warning)


def is_comm_failure(error: BaseException) -> bool:
    """Whether `error` is a failed or timed-out communication (a peer stalled or died), as
    opposed to a fault of this rank's own (a bad sample, a bad plan)."""
    import torch.distributed as dist

    if isinstance(error, (PipelineCommError, dist.DistError, TimeoutError, ConnectionError)):
        return True
    # gloo and the stores raise plain RuntimeErrors; our own subclasses (CheckpointError,
    # NonFiniteError, ...) already name their cause and pass through.
    text = str(error).lower()
    return type(error) is RuntimeError and any(t in text for t in _COMM_TEXTS)


def _caused_by_comm(error: BaseException | None, depth: int = 4) -> bool:
    """`is_comm_failure` of `error` or of what it was raised from (e.g. a CheckpointError
    "saving ... failed" from gloo's "Connection closed by peer": the dead peer is the cause)."""
    while error is not None and depth > 0:
        if is_comm_failure(error):
            return True
        error, depth = error.__cause__, depth - 1
    return False


@dataclass(frozen=True)
class Phase:
    """Where a rank is: a named step of iteration `iteration` over the global `ranks` of
    `group` (a description such as "data-parallel group")."""

    name: str
    iteration: int
    group: str = "world"
    ranks: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.name, "iteration": self.iteration, "group": self.group}


IDLE = Phase("start-up", 0)
# Phases that mostly compute locally (building the model): long without being stuck.
_NOT_EARLY = ("start-up",)


def _where(record: Mapping[str, Any] | None) -> str:
    if not record or "phase" not in record:
        return "before its first phase"
    return f"in {record['phase']!r} (iteration {record['iteration']})"


def describe_stall(
    *,
    rank: int,
    phase: Phase,
    cause: str,
    reports: Mapping[int, Mapping[str, Any]],
    beats: Mapping[int, Mapping[str, Any]],
    stalled: Sequence[int],
    grace_s: float,
    outcome: str = "failed",
) -> str:
    """The one line every rank raises (module docstring). `reports`: the ranks that reported a
    failure, by rank ({phase, iteration, group, error, failed}); `beats`: every rank's last
    heartbeat record; `stalled`: the ranks whose heartbeat did not move during the grace;
    `outcome`: what happened to the phase ("failed", or "is about to time out")."""
    members = phase.ranks or tuple(sorted(set(beats) | set(reports) | {rank}))

    def state(r: int) -> Mapping[str, Any] | None:
        return reports.get(r) or beats.get(r)

    def same(r: int) -> bool:
        s = state(r)
        return s is not None and (s.get("phase"), s.get("iteration")) == (
            phase.name,
            phase.iteration,
        )

    arrived = [r for r in members if r == rank or (r not in stalled and same(r))]
    absent = [r for r in members if r not in arrived]
    absent_text = ", ".join(
        f"rank {r} ({'stalled' if r in stalled else 'alive'} {_where(state(r))})" for r in absent
    )
    line = (
        f"rank {rank}: {phase.name!r} of iteration {phase.iteration} over the {phase.group} "
        f"{list(members)} {outcome} ({cause}); arrived: {arrived}; "
        f"not arrived: {absent_text or 'none'}. "
    )
    failed = {r: rep for r, rep in reports.items() if rep.get("failed")}
    if failed:
        line += "Failed: " + "; ".join(
            f"rank {r} {_where(rep)}: {rep.get('error', '?')}" for r, rep in sorted(failed.items())
        )
        line += ". "
    if stalled:
        line += "Stalled: " + ", ".join(
            f"rank {r} (no heartbeat for {grace_s:.1f} s: stopped, hung or dead; last "
            f"heartbeat {_where(beats.get(r))})"
            for r in stalled
        )
    elif not failed:
        line += (
            "Stalled: none (every rank is alive: the ranks wait in different phases, or the "
            "network between them failed)"
        )
    return line.rstrip(". ")


def _short(error: BaseException, limit: int = 240) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


class PhaseWatch:
    """This rank's phases, heartbeat and post-mortem for one run (module docstring).

    `store`: the job's key-value store (`torch.distributed`'s default store: torchrun's, or
    the file store of a test); `timeout_s`: --dip-comm-timeout-s. Call `start()` once the
    process group exists and `stop()` at the end of the run.
    """

    def __init__(
        self,
        *,
        store,
        rank: int,
        world_size: int,
        timeout_s: float,
        beat_s: float | None = None,
        early: bool = False,
        store_host: str = "its host",
        on_store_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        # Who hosts the store (for the line), and what to do once it is lost (default: end
        # the process: `exit_unsupervised`; tests record the line instead).
        self.store_host = store_host
        self.on_store_lost = on_store_lost or exit_unsupervised
        self.timeout_s = timeout_s
        self.beat_s = beat_s if beat_s is not None else min(MAX_BEAT_S, max(0.2, timeout_s / 10))
        self.grace_s = max(1.0, 3 * self.beat_s)
        self.prefix = f"dip/watch/{next(_GENERATIONS)}"
        self.iteration = 0
        self.current = IDLE
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = 0
        # NCCL: its watchdog aborts the process at the timeout, before Python sees an error, so
        # the heartbeat thread reports a phase that is about to time out (`_report_early`).
        self.early = early
        self._entered = time.monotonic()
        self._early_done = False
        self._failing: tuple[float, int, BaseException] | None = None  # since, attempts, last
        self.store_lost = False

    @classmethod
    def for_world(cls, *, timeout_s: float, early: bool = False) -> PhaseWatch:
        """The watch of this process's torch.distributed world (`early`: on NCCL)."""
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        return cls(
            store=store,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            timeout_s=timeout_s,
            early=early,
            store_host=describe_store_host(os.environ),
        )

    # -- heartbeat -----------------------------------------------------------------------

    def start(self) -> None:
        self._write_beat()
        self._thread = threading.Thread(target=self._beat_loop, name="dip-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self.beat_s + 1)

    def _beat_loop(self) -> None:
        while not self._stopping.wait(self.beat_s if self._failing is None else RETRY_S):
            if not self._write_beat():
                if self._store_gone():
                    self._lose_store()
                    return
                continue
            if self.early and not self._early_done and self.current.name not in _NOT_EARLY:
                age = time.monotonic() - self._entered
                if age > self.timeout_s - self.grace_s - 2 * self.beat_s:
                    self._early_done = True
                    # Its own thread: this one must keep beating through the grace period.
                    args = (self.current, age)
                    threading.Thread(target=self._report_early, args=args, daemon=True).start()

    def _report_early(self, phase: Phase, age: float) -> None:
        """Log the stall line of a phase that NCCL's watchdog is about to end (`early`)."""
        cause = TimeoutError(
            f"waiting for {age:.0f} s; NCCL's watchdog aborts the rank at {self.timeout_s:g} s, "
            "--dip-comm-timeout-s"
        )
        error = self.post_mortem(phase, cause, outcome="is about to time out")
        logger.error("error: %s", error)

    def _write_beat(self) -> bool:
        """Write this rank's heartbeat and read it back; False (remembered in `_failing`)
        when the store did not answer."""
        self._beat += 1
        record = {"n": self._beat, **self.current.as_dict()}
        key = f"{self.prefix}/beat/{self.rank}"
        try:
            self.store.set(key, json.dumps(record))
            self.store.check([key])  # a reply: the set alone may sit in a dead socket's buffer
        except Exception as error:
            since, attempts, _ = self._failing or (time.monotonic(), 0, error)
            self._failing = (since, attempts + 1, error)
            return False
        self._failing = None
        return True

    def _store_gone(self) -> bool:
        since, attempts, _ = self._failing
        return attempts >= 2 and time.monotonic() - since >= LOST_AFTER_S

    def _lose_store(self) -> None:
        """The store is gone (module docstring): one line, then `on_store_lost`."""
        since, attempts, error = self._failing
        self.store_lost = True
        line = (
            f"rank {self.rank}: lost the job's store ({self.store_host}): {attempts} heartbeats "
            f"over {time.monotonic() - since:.1f} s failed ({_short(error, 120)}); its host is "
            f"gone and nothing supervises this rank any more, so it stops now, in "
            f"{self.current.name!r} of iteration {self.current.iteration}"
        )
        logger.error("error: %s", line)
        self.on_store_lost(line)

    # -- phases --------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str, *, group=None, group_name: str = "world") -> Iterator[Phase]:
        """Run the block as phase `name` over `group` (None: the world); a communication
        failure inside becomes a `StallError` after the post-mortem."""
        outer = self.current
        self.current = Phase(name, self.iteration, group_name, _ranks(group, self.world_size))
        self._entered, self._early_done = time.monotonic(), False
        try:
            yield self.current
        except StallError:
            raise
        except Exception as error:
            if not _caused_by_comm(error):
                raise
            raise self.post_mortem(self.current, error) from error
        finally:
            self.current = outer

    def wait(self, work, *, device=None) -> None:
        """Wait for an asynchronous collective of the current phase, at most `timeout_s`
        (gloo honours it; NCCL's own timeout is the process group's)."""
        if device is not None and getattr(device, "type", "cpu") == "cuda":
            work.wait()
            return
        if not work.wait(timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"timed out after {self.timeout_s:g} s")

    # -- reports and post-mortem ---------------------------------------------------------

    def report_failure(self, error: BaseException) -> None:
        """Tell the other ranks why this one stops (an error that is not a stall)."""
        self._report({**self.current.as_dict(), "error": _short(error), "failed": True})

    def _report(self, record: Mapping[str, Any]) -> None:
        """Write this rank's report, waiting at most the grace period (a store hosted by a
        stalled rank would block), then give the store its own timeout back (the process may
        go on: tests run several jobs in one, a failed run reports before it raises)."""
        with contextlib.suppress(Exception):
            before = self.store.timeout
            try:
                self.store.set_timeout(timedelta(seconds=self.grace_s))
                self.store.set(f"{self.prefix}/report/{self.rank}", json.dumps(record))
            finally:
                self.store.set_timeout(before)

    def _read(self, kind: str, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
        found = {}
        for r in ranks:
            key = f"{self.prefix}/{kind}/{r}"
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    found[r] = json.loads(self.store.get(key))
        return found

    def post_mortem(
        self, phase: Phase, error: BaseException, *, outcome: str = "failed"
    ) -> StallError:
        """Report, collect the others' reports and heartbeats for `grace_s`, and build the
        error this rank raises (module docstring)."""
        cause = _short(error)
        record = {**phase.as_dict(), "error": cause, "failed": False}
        self._report(record)
        everyone = range(self.world_size)
        first = self._read("beat", everyone)
        deadline = time.monotonic() + self.grace_s
        reports: dict[int, dict[str, Any]] = {}
        while True:
            reports.update(self._read("report", [r for r in everyone if r not in reports]))
            if len(reports) == self.world_size or time.monotonic() >= deadline:
                break
            time.sleep(min(0.1, self.beat_s / 2))
        beats = self._read("beat", everyone)
        reports.update(self._read("report", everyone))  # who finished meanwhile
        stalled = [
            r
            for r in everyone
            if r != self.rank
            and _unfinished(reports.get(r))
            and beats.get(r, {}).get("n") == first.get(r, {}).get("n")
        ]
        self._report({**record, "done": True})
        line = describe_stall(
            rank=self.rank,
            phase=phase,
            cause=cause,
            reports=reports,
            beats=beats,
            stalled=stalled,
            grace_s=self.grace_s,
            outcome=outcome,
        )
        return StallError(line, phase=phase.name, stalled=stalled)


def _unfinished(report: Mapping[str, Any] | None) -> bool:
    """Whether a rank with this report (None: none) could still be expected to beat: it did
    not report, or it reported its own stall and has not finished that post-mortem (a rank
    stopped inside it, after its report, is as stalled as one that never reported). A rank
    that failed of its own error, or finished its post-mortem, stops beating as it exits."""
    return report is None or not (report.get("failed") or report.get("done"))


def describe_store_host(environ: Mapping[str, str]) -> str:
    """Who hosts this process's torch.distributed store, from the launcher's variables: the
    torchrun agent (TORCHELASTIC_USE_AGENT_STORE), else rank 0 (env:// rendezvous)."""
    address = f"{environ.get('MASTER_ADDR', '?')}:{environ.get('MASTER_PORT', '?')}"
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return f"hosted by the torchrun agent at {address}"
    if "MASTER_ADDR" in environ:
        return f"hosted by rank 0 at {address}"
    return "hosted by the process that created it"


def exit_unsupervised(line: str) -> None:
    """End this process at once (from the heartbeat thread, whatever the main thread waits
    in), after flushing the log: exit status 1, as a stalled rank's."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def _ranks(group, world_size: int) -> tuple[int, ...]:
    """Global ranks of `group` (None: the world)."""
    if group is None:
        return tuple(range(world_size))
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


class NoWatch:
    """A `PhaseWatch` stand-in outside training (tests, tools): phases are plain blocks."""

    iteration = 0
    timeout_s = None

    @contextlib.contextmanager
    def phase(self, name: str, *, group=None, group_name: str = "world") -> Iterator[None]:
        yield None

    def wait(self, work, *, device=None) -> None:
        work.wait()

    def report_failure(self, error: BaseException) -> None:
        pass


__all__ = [
    "NoWatch", "Phase", "PhaseWatch", "describe_stall", "describe_store_host",
    "exit_unsupervised", "is_comm_failure",
]  # fmt: skip
