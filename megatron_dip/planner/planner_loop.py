"""The body of the planner process: greedy plans first for every pending batch, then the search
of the earliest undecided one (`planner_loop`), with the calibration it was sent
(`_Calibrated`) and the test-only faults (`PlannerFaults`). `process.py` starts the process and
carries its messages; `service.py` owns it from the training rank.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..data.sample import BatchMeta
from .list_scheduler import warm_up

logger = logging.getLogger("megatron_dip.planner.service")  # one logger for the planner side

GREEDY, SEARCHED = "greedy", "searched"
UP = "up"  # the planner process's first message: ready to plan
# What the planner process must not need (seconds of imports before it can plan).
HEAVY_MODULES = ("torch", "megatron.core")
IDLE_POLL_S = 1.0  # how often an idle planner checks that its parent is alive


class _Calibrated:
    """The planner process's view of the calibration: re-points `planner.cost_model` at the
    base cost model scaled by the newest factors the service sent."""

    def __init__(self, planner) -> None:
        self.planner = planner
        self.base = planner.cost_model
        self.version = 0

    def apply(self, version: int, scales: Mapping[str, float]) -> None:
        if version != self.version:
            self.planner.cost_model = self.base.calibrated(dict(scales)) if scales else self.base
            self.version = version
            logger.info("planner: cost-model calibration version %d", version)


@dataclass(frozen=True)
class PlannerFaults:
    """Fault injection, for tests only (no flag reaches it): how the FIRST planner process of a
    `PlannerService` misbehaves. A restarted planner runs without faults, as a real one would
    after a crash. With faults the service waits for that first process to be up before going
    on (training never waits for a planner otherwise), so the faults hit a running planner
    whatever the machine's speed.

    `delay_s`: stall this long before each greedy plan (a slow planner; batches still arrive).
    `raise_at_iteration`: raise on receiving this iteration's batch (the process dies of it).
    `kill_at_iteration`: the service SIGKILLs the process as it submits this iteration (the
    system's OOM killer, an operator).
    `stop_at_iteration`: the service SIGSTOPs the process as it submits this iteration (a
    planner that stops answering: the heartbeat must find it), then waits out the heartbeat
    timeout, so that the next check (at the same submit) finds it.
    """

    delay_s: float = 0.0
    raise_at_iteration: int | None = None
    kill_at_iteration: int | None = None
    stop_at_iteration: int | None = None


class InjectedFaultError(RuntimeError):
    """What a planner process raises under `PlannerFaults.raise_at_iteration`."""


def _receive(
    item, pending: list, faults: PlannerFaults | None, calibration: _Calibrated | None = None
) -> None:
    """Queue a received batch for planning, or apply a calibration (raising under the
    test-only `faults`)."""
    if isinstance(item, tuple):  # ("calibration", version, scales)
        if calibration is not None:
            calibration.apply(item[1], item[2])
        return
    if faults is not None and faults.raise_at_iteration == item.iteration:
        raise InjectedFaultError(f"injected planner fault at iteration {item.iteration}")
    pending.append(item)


def _stall(
    faults: PlannerFaults,
    batches: queue.Queue,
    pending: list,
    calibration: _Calibrated | None = None,
) -> bool:
    """The test-only delay before a plan; True when told to stop meanwhile. It keeps receiving
    batches (into `pending`), so it delays plans, not shutdown."""
    deadline = time.monotonic() + faults.delay_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            item = batches.get(timeout=left)
        except queue.Empty:
            break
        if item is None:
            return True
        _receive(item, pending, faults, calibration)
    return False


def planner_loop(
    make_planner: Callable[[], object],
    channels,
    *,
    poll_s: float = 0.05,
    faults: PlannerFaults | None = None,
) -> None:
    """Body of the planner process: greedy plans first for every pending batch, then search the
    earliest undecided one. Ends on a None sentinel. `channels`: `process.ChildChannels`;
    `faults`: test-only misbehaviour."""
    built = time.monotonic()
    planner = make_planner()
    calibration = _Calibrated(planner)
    warm_up()  # the scheduler kernel, before the first batch rather than in its plan
    heavy = sorted(m for m in HEAVY_MODULES if m in sys.modules)
    channels.results.put((UP, time.time() - channels.started_at, time.monotonic() - built, heavy))
    parent = os.getppid()
    pending: list[BatchMeta] = []
    greedy: set[int] = set()
    searched: set[int] = set()
    while True:
        channels.tick()  # the heartbeat reports the loop's progress
        if os.getppid() != parent:
            return  # the training process is gone: do not outlive it
        try:
            item = channels.batches.get(timeout=poll_s if pending else IDLE_POLL_S)
            if item is None:
                return
            _receive(item, pending, faults, calibration)
            continue  # drain the queue before planning
        except queue.Empty:
            pass
        pending = [b for b in pending if channels.undecided(b)]
        for batch in list(pending):
            if (
                faults is not None
                and faults.delay_s
                and _stall(faults, channels.batches, pending, calibration)
            ):
                return
            if batch.iteration not in greedy:
                greedy.add(batch.iteration)
                channels.send(planner, batch, GREEDY, calibration.version, search=False)
        todo = [b for b in pending if b.iteration not in searched and channels.undecided(b)]
        if todo and planner.config.use_search:
            batch = todo[0]
            searched.add(batch.iteration)
            channels.send(planner, batch, SEARCHED, calibration.version, search=True)


__all__ = ["GREEDY", "SEARCHED", "UP", "InjectedFaultError", "PlannerFaults", "planner_loop"]
