"""The planner service: plans upcoming batches in a separate process while the current one trains.

Delivery goes through a `torch.distributed` store (the TCPStore every torchrun job already has, or
any object with the same set/get/check/compare_set/delete_key methods), keyed by iteration and
data-parallel replica:

    dip/{it}/greedy/{replica}    the greedy plan, published as soon as it exists
    dip/{it}/searched/{replica}  the searched plan, published only while the iteration is ahead
    dip/{it}/ready               "greedy" or "searched": which variant is complete for all replicas
    dip/{it}/decision            set ONCE by compare-and-set: the variant the iteration runs

A training rank about to run iteration `it` calls `PlanClient.decide(it)`: the first rank's
compare-and-set fixes the variant from what is ready at that moment ("inline" if nothing is), and
every other rank reads the same decision, so all ranks run the same plan and nobody waits for the
search. "inline" means the training loop computes the greedy plan itself (deterministic, so every
rank computes the same one). The planner stops improving an iteration once it is decided.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..data.sample import BatchMeta
from ..schedule.ir import Plan
from ..schedule.serialize import plan_from_bytes, plan_to_bytes

logger = logging.getLogger(__name__)

GREEDY, SEARCHED, INLINE = "greedy", "searched", "inline"
IDLE_POLL_S = 1.0  # how often an idle planner checks that its parent is alive


def _key(iteration: int, *parts: object) -> str:
    return "/".join(["dip", str(iteration), *map(str, parts)])


def _has(store, key: str) -> bool:
    return store.check([key])


@dataclass(frozen=True)
class StoreAddress:
    """Where the planner process connects to the job's store."""

    host: str
    port: int
    timeout_s: float = 300.0

    def connect(self):
        from datetime import timedelta

        from torch.distributed import TCPStore

        return TCPStore(
            self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s)
        )


def publish(store, plans: list[Plan], variant: str) -> None:
    """Publish one variant of an iteration's plans (all replicas), then mark it ready."""
    iteration = plans[0].iteration
    for plan in plans:
        store.set(_key(iteration, variant, plan.replica), plan_to_bytes(plan))
    store.set(_key(iteration, "ready"), variant)


def planner_loop(
    make_planner: Callable[[], object],
    address: StoreAddress,
    batches: mp.Queue,
    *,
    poll_s: float = 0.05,
) -> None:
    """Body of the planner process: greedy plans first for every pending batch, then search the
    earliest undecided one. Ends on a None sentinel."""
    planner = make_planner()
    store = address.connect()
    parent = os.getppid()
    pending: list[BatchMeta] = []
    searched: set[int] = set()
    while True:
        if os.getppid() != parent:
            return  # the training process is gone: do not outlive it
        try:
            item = batches.get(timeout=poll_s if pending else IDLE_POLL_S)
            if item is None:
                return
            pending.append(item)
            continue  # drain the queue before planning
        except queue.Empty:
            pass
        pending = [b for b in pending if not _has(store, _key(b.iteration, "decision"))]
        for batch in pending:
            if not _has(store, _key(batch.iteration, "ready")):
                publish(store, [p.plan for p in planner.plan_batch(batch, search=False)], GREEDY)
        todo = [b for b in pending if b.iteration not in searched]
        if todo and planner.config.use_search:
            batch = todo[0]
            searched.add(batch.iteration)
            plans = [p.plan for p in planner.plan_batch(batch)]  # the configured search
            if not _has(store, _key(batch.iteration, "decision")):
                publish(store, plans, SEARCHED)


class PlannerService:
    """Owns the planner process (on one rank per job) and restarts it if it dies."""

    def __init__(
        self,
        make_planner: Callable[[], object],
        address: StoreAddress,
        *,
        lookahead: int = 2,
    ) -> None:
        if lookahead < 0:
            raise ValueError(f"--dip-lookahead must be >= 0, got {lookahead}")
        self.make_planner = make_planner
        self.address = address
        self.lookahead = lookahead
        self._ctx = mp.get_context("spawn")
        self._queue: mp.Queue | None = None
        self._process: mp.process.BaseProcess | None = None
        self._submitted: list[BatchMeta] = []
        self.restarts = 0

    def start(self) -> None:
        self._queue = self._ctx.Queue()
        self._process = self._ctx.Process(
            target=planner_loop,
            args=(self.make_planner, self.address, self._queue),
            name="dip-planner",
            daemon=True,
        )
        self._process.start()
        for batch in self._submitted:  # a restarted planner re-plans what is still ahead
            self._queue.put(batch)

    def submit(self, batch: BatchMeta) -> None:
        """Hand the metadata of an upcoming batch to the planner."""
        self.ensure_alive()
        self._submitted = [*self._submitted[-self.lookahead :], batch]
        self._queue.put(batch)

    def ensure_alive(self) -> bool:
        """Restart the planner process if it died; True when a restart happened."""
        if self._process is not None and self._process.is_alive():
            return False
        if self._process is not None:
            self.restarts += 1
            logger.warning(
                "planner process exited (code %s); restarting it (restart %d)",
                self._process.exitcode,
                self.restarts,
            )
        self.start()
        return True

    @property
    def process(self) -> mp.process.BaseProcess | None:
        return self._process

    def close(self) -> None:
        if self._process is None:
            return
        if self._process.is_alive():
            self._queue.put(None)
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
        self._process = None


class PlanClient:
    """What a training rank uses to obtain the plan of an iteration."""

    def __init__(self, store, *, replica: int) -> None:
        self.store = store
        self.replica = replica
        self.inline_count = 0

    def decide(self, iteration: int) -> str:
        """Fix (once, for all ranks) and return the plan variant iteration `iteration` runs."""
        ready_key = _key(iteration, "ready")
        ready = self.store.get(ready_key).decode() if _has(self.store, ready_key) else INLINE
        decided = self.store.compare_set(_key(iteration, "decision"), "", ready)
        return decided.decode() if isinstance(decided, bytes) else str(decided)

    def fetch(self, iteration: int, inline: Callable[[], Plan]) -> tuple[Plan, str]:
        """The plan this rank's replica runs at `iteration` and its variant. `inline` computes
        the greedy plan when the planner had nothing ready (counted and logged)."""
        variant = self.decide(iteration)
        if variant == INLINE:
            self.inline_count += 1
            logger.warning(
                "iteration %d: no plan ready from the planner, planning inline", iteration
            )
            return inline(), variant
        started = time.monotonic()
        data = self.store.get(_key(iteration, variant, self.replica))
        plan = plan_from_bytes(data)
        if plan.iteration != iteration or plan.replica != self.replica:
            raise ValueError(
                f"store returned the plan of iteration {plan.iteration} replica {plan.replica} "
                f"for iteration {iteration} replica {self.replica}"
            )
        logger.debug(
            "iteration %d: fetched %s plan in %.1f ms",
            iteration,
            variant,
            1e3 * (time.monotonic() - started),
        )
        return plan, variant

    def cleanup(self, iteration: int, *, num_replicas: int) -> None:
        """Delete an iteration's keys once every rank has fetched its plan."""
        for variant in (GREEDY, SEARCHED):
            for r in range(num_replicas):
                self.store.delete_key(_key(iteration, variant, r))
        self.store.delete_key(_key(iteration, "ready"))
        self.store.delete_key(_key(iteration, "decision"))
