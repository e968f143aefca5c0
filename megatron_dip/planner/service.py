"""The planner service: plans upcoming batches in a separate process while the current one trains.

Delivery goes through a `torch.distributed` store (the TCPStore every torchrun job already has, or
any object with the same set/get/check/compare_set/delete_key methods), keyed by iteration and
data-parallel replica:

    dip/{it}/greedy/{replica}    the greedy plan, published as soon as it exists
    dip/{it}/searched/{replica}  the searched plan, published only while the iteration is ahead
    dip/{it}/{variant}/calibration  the calibration version that variant was planned with
    dip/{it}/ready               "greedy" or "searched": which variant is complete for all replicas
    dip/{it}/decision            set ONCE by compare-and-set: the variant the iteration runs
    dip/calibration              {"version": k, "scales": {module: factor}}: the newest in-run
                                 calibration (rank 0 sets it; the planner reads it before planning)

A training rank about to run iteration `it` calls `PlanClient.decide(it)`: the first rank's
compare-and-set fixes the variant from what is ready at that moment ("inline" if nothing is), and
every other rank reads the same decision, so all ranks run the same plan and nobody waits for the
search. "inline" means the training ranks plan it themselves: in a job, rank 0 makes a cheap
fallback plan (Megatron's order on the placement, milliseconds) for every replica once and shares
it through `dip/{it}/inline/{replica}` (`PlanClient.shares_fallback`). The planner stops
improving an iteration once it is decided.

The planner process (`process.py`: a plain subprocess over two pipes that dies with its rank;
its body: `planner_loop.py`) touches neither the store nor torch: it plans from the batches
(and calibrations) the service sends it and returns serialized plans; a publisher thread in the
owning process puts them in the store (a greedy variant only while no variant of that iteration
is ready, a searched one only while the iteration is undecided). So the process starts on
numpy, scipy and numba imports alone, and its first plan is ready within seconds of the job's
start (importing torch in it took longer than the first iterations). A planner whose heartbeat
stops, or whose loop stops making progress, is killed and restarted (`check_heartbeat`).

Calibration: the service forwards the newest `dip/calibration` to the planner process with
each batch it submits (ahead of it, when it changed); the process applies it to its base cost model (`CostModel.calibrated`) and tags what it returns with that
version. A plan of version k that is fetched after the ranks moved to k+1 is still valid (it is
one plan, decided once, for every rank), just planned with older numbers; a published variant is
never re-planned, since replicas fetching at different moments must get plans of the same split.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..data.sample import BatchMeta
from ..schedule.ir import Plan
from ..schedule.serialize import plan_from_bytes, plan_to_bytes
from .planner_loop import GREEDY, SEARCHED, UP, PlannerFaults
from .process import CLOSED, PlannerProcess

logger = logging.getLogger(__name__)

INLINE = "inline"
CALIBRATION_KEY = "dip/calibration"
FAULTY_START_S = 120.0  # tests only: how long a service with PlannerFaults waits for its planner
STORE_CONNECT_S = 30.0  # the publisher's connection to the plan store (a thread of the rank)


def _key(iteration: int, *parts: object) -> str:
    return "/".join(["dip", str(iteration), *map(str, parts)])


def _has(store, key: str) -> bool:
    return store.check([key])


@dataclass(frozen=True)
class StoreAddress:
    """Where the planner process connects to the job's store."""

    host: str
    port: int
    timeout_s: float = STORE_CONNECT_S

    def connect(self):
        from datetime import timedelta

        from torch.distributed import TCPStore

        return TCPStore(
            self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s)
        )


def publish(store, plans: list[Plan], variant: str, *, calibration_version: int = 0) -> None:
    """Publish one variant of an iteration's plans (all replicas) and the calibration version
    they were planned with, then mark it ready."""
    publish_bytes(
        store,
        plans[0].iteration,
        [plan_to_bytes(p) for p in plans],
        variant,
        calibration_version=calibration_version,
    )


def publish_bytes(
    store, iteration: int, replicas: list[bytes], variant: str, *, calibration_version: int = 0
) -> None:
    """`publish` of plans already serialized (`replicas[r]`: replica r's plan)."""
    for replica, data in enumerate(replicas):
        store.set(_key(iteration, variant, replica), data)
    store.set(_key(iteration, variant, "calibration"), str(calibration_version))
    store.set(_key(iteration, "ready"), variant)


def publish_calibration(store, *, version: int, scales: Mapping[str, float]) -> None:
    """Make calibration `version` (per-module scale factors) the one the planner plans with.
    One key, one set: the planner never sees a version without its scales."""
    store.set(CALIBRATION_KEY, json.dumps({"version": int(version), "scales": dict(scales)}))


def read_calibration(store) -> tuple[int, dict[str, float]] | None:
    """The newest published (version, scales), or None if none was published."""
    if not _has(store, CALIBRATION_KEY):
        return None
    data = json.loads(store.get(CALIBRATION_KEY))
    return int(data["version"]), {str(k): float(v) for k, v in data["scales"].items()}


class _Publisher(threading.Thread):
    """Thread of the owning process: puts what its planner process returns into the store."""

    def __init__(self, address: StoreAddress, process: PlannerProcess) -> None:
        super().__init__(name="dip-plan-publisher", daemon=True)
        self.address, self.results, self.process = address, process.results, process
        self.stopping = threading.Event()
        self.up = threading.Event()  # set once the process reported it can plan
        self.published: list[tuple[int, str]] = []  # (iteration, variant), for tests and logs
        self.startup: dict | None = None  # what the process reported once it could plan

    def _up(self, seconds: float, build_s: float, heavy: list[str]) -> None:
        self.startup = {"seconds": seconds, "planner_build_s": build_s, "heavy_modules": heavy}
        self.up.set()
        logger.info(
            "planner process ready %.1f s after its start (planner built in %.2f s)%s",
            seconds,
            build_s,
            f"; it imported {', '.join(heavy)}" if heavy else "",
        )

    def run(self) -> None:
        try:
            store = self.address.connect()
        except Exception as err:  # a thread: report it; the plans fall back inline
            logger.error("planner publisher cannot reach the store: %s; plans are inline", err)
            return
        while not self.stopping.is_set():
            try:
                item = self.results.get(timeout=0.1)
            except queue.Empty:
                if not self.process.is_alive():
                    return  # nothing more will come; a restart brings its own publisher
                continue
            if item is CLOSED:
                return  # the process is gone (possibly mid-message)
            if item[0] == UP:
                self._up(*item[1:])
                continue
            variant, iteration, replicas, version = item
            # A greedy plan only while nothing is ready (a restarted planner re-plans what is
            # ahead); a searched one only while the iteration is undecided.
            blocker = "ready" if variant == GREEDY else "decision"
            if not _has(store, _key(iteration, blocker)):
                publish_bytes(store, iteration, replicas, variant, calibration_version=version)
                self.published.append((iteration, variant))


def _exit_reason(code: int | None) -> str:
    """How a planner process ended, from its exit code, for the log."""
    if code is not None and code < 0:
        return f"was killed by signal {-code}"
    if code:
        return f"failed with exit code {code} (its traceback is on stderr)"
    return f"exited (code {code})"


class PlannerService:
    """Owns the planner process (on one rank per job), publishes what it plans (a thread of
    this process) and restarts it if it dies or stops answering.

    `timeout_s` (--dip-planner-timeout-s): a planner whose heartbeat is silent this long
    (stopped, or stuck holding its interpreter), or whose planning loop makes no progress for
    `busy_limit_s` (a deadlock; default 3 x `timeout_s`), is killed and restarted like one that
    crashed. Its start-up (imports, the planner's build, the scheduler kernel's compilation on a
    fresh machine) is bounded work and gets `startup_limit_s` (default 10 x `timeout_s`)
    instead: a start-up killed for being slow on a loaded machine would start again from
    scratch, and so on, and deliver nothing. Call `start`, `submit` and `ensure_alive` from one
    thread that lives as long as the service (the planner dies with the thread that started
    it: `process.py`).
    """

    def __init__(
        self,
        make_planner: Callable[[], object],
        address: StoreAddress,
        *,
        lookahead: int = 2,
        faults: PlannerFaults | None = None,
        timeout_s: float = 20.0,
        busy_limit_s: float | None = None,
        startup_limit_s: float | None = None,
    ) -> None:
        if lookahead < 0:
            raise ValueError(f"--dip-lookahead must be >= 0, got {lookahead}")
        self.make_planner = make_planner
        self.address = address
        self.lookahead = lookahead
        self.faults = faults  # tests only: misbehaviour of the first planner process
        self.timeout_s = timeout_s
        self.busy_limit_s = busy_limit_s if busy_limit_s is not None else 3 * timeout_s
        self.startup_limit_s = max(
            self.busy_limit_s, startup_limit_s if startup_limit_s is not None else 10 * timeout_s
        )
        self._decided = -1
        self._process: PlannerProcess | None = None
        self._publisher: _Publisher | None = None
        self._submitted: list[BatchMeta] = []
        self._calibration: tuple | None = None  # the newest ("calibration", version, scales)
        self._store = None  # a store client of this process, to read `dip/calibration`
        self._unresponsive: str | None = None  # why the current process was killed, if it was
        self.restarts = 0

    def start(self) -> None:
        faults = self.faults if self.restarts == 0 else None
        self._unresponsive = None
        self._process = PlannerProcess((self.make_planner, faults, time.time()))
        self._publisher = _Publisher(self.address, self._process)
        self._publisher.start()
        if faults is not None and not self._publisher.up.wait(timeout=FAULTY_START_S):
            logger.warning("the fault-injected planner was not up within %.0f s", FAULTY_START_S)
        if self._decided >= 0:
            self._process.send(("decided", self._decided))
        if self._calibration is not None:
            self._process.send(self._calibration)
        for batch in self._submitted:  # a restarted planner re-plans what is still ahead
            self._process.send(batch)

    def _inject(self, batch: BatchMeta) -> None:
        """Tests only: kill or stop the first planner process at its iteration."""
        f = self.faults
        if f is None or self.restarts or self._process is None:
            return
        if f.kill_at_iteration == batch.iteration:
            logger.warning(
                "injected fault: killing the planner process (iteration %d)", batch.iteration
            )
            self._process.kill()
            self._process.join(timeout=5)
        if f.stop_at_iteration == batch.iteration:
            logger.warning(
                "injected fault: stopping the planner process (iteration %d)", batch.iteration
            )
            self._process.stop_signal()
            # Let the silence outlast the timeout, so the very next check finds it whatever
            # the machine's speed (training never waits for a planner otherwise).
            limit = self.timeout_s if self._process.beating else self.startup_limit_s
            time.sleep(limit + 0.5)

    def submit(self, batch: BatchMeta) -> None:
        """Hand the metadata of an upcoming batch to the planner."""
        self._inject(batch)
        self.ensure_alive()
        self._forward_calibration()
        self._submitted = [*self._submitted[-self.lookahead :], batch]
        self._process.send(batch)

    def _forward_calibration(self) -> None:
        """Send the planner the newest `dip/calibration`, if it changed, ahead of the next batch."""
        if self._store is None:
            self._store = self.address.connect()
        found = read_calibration(self._store)
        if found is not None and (self._calibration is None or found[0] != self._calibration[1]):
            self._calibration = ("calibration", *found)
            self._process.send(self._calibration)

    def decided(self, iteration: int) -> None:
        """Iteration `iteration` (and every earlier one) runs a plan already: the planner stops
        working on it."""
        if iteration > self._decided:
            self._decided = iteration
            if self._process is not None:
                self._process.send(("decided", iteration))

    def check_heartbeat(self) -> None:
        """Kill the planner process if it stopped answering (class docstring); the next
        `ensure_alive` restarts it."""
        p = self._process
        if p is None or not p.is_alive():
            return
        silent, busy = p.silent_s(), p.busy_s + p.silent_s()
        started = self.startup is not None
        limit = self.busy_limit_s if started else self.startup_limit_s
        # Before its first heartbeat the process imports: it gets the longer limit.
        if silent > (self.timeout_s if p.beating else limit):
            why = f"sent no heartbeat for {silent:.1f} s (stopped or hung)"
        elif busy > limit:
            doing = "made no progress" if started else "was still starting"
            why = f"{doing} for {busy:.1f} s (deadlocked or far too slow)"
        else:
            return
        self._unresponsive = why
        p.kill()
        p.join(timeout=5)

    def ensure_alive(self) -> bool:
        """Restart the planner process if it died or stopped answering; True when a restart
        happened."""
        self.check_heartbeat()
        if self._process is not None and self._process.is_alive():
            return False
        if self._process is not None:
            self.restarts += 1
            reason = self._unresponsive or _exit_reason(self._process.exitcode)
            killed = "; killed it" if self._unresponsive else ""
            logger.warning(
                "planner process %s%s; restarting it (restart %d); iterations without a plan "
                "ready meanwhile are planned inline",
                reason,
                killed,
                self.restarts,
            )
            self._stop_publisher()
            self._process.close()
        self.start()
        return True

    @property
    def process(self) -> PlannerProcess | None:
        return self._process

    @property
    def startup(self) -> dict | None:
        """What the current planner process reported when it was ready to plan (seconds
        after its start, planner build seconds, heavy modules it imported), None before."""
        return self._publisher.startup if self._publisher is not None else None

    def _stop_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.stopping.set()
            self._publisher.join(timeout=5)

    def close(self) -> None:
        if self._process is None:
            return
        if self._process.is_alive():
            self._process.send(None)
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5)
        self._stop_publisher()
        self._process.close()
        self._process = None


class PlanClient:
    """What a training rank uses to obtain the plan of an iteration.

    `shares_fallback`: who plans an iteration the planner had nothing ready for. None: every
    rank calls its own `inline` (deterministic, so the same plan; tests, single-rank runs).
    True: this rank (rank 0) calls `inline` for the plans of every replica and publishes them
    (`dip/{it}/inline/{replica}`); False: this rank reads its replica's from there. So a late
    plan is made once per job, not once per rank."""

    def __init__(self, store, *, replica: int, shares_fallback: bool | None = None) -> None:
        self.store = store
        self.replica = replica
        self.shares_fallback = shares_fallback
        self.inline_count = 0
        # Calibration version of the last fetched plan (None: planned inline by the caller).
        self.plan_calibration: int | None = None

    def decide(self, iteration: int) -> str:
        """Fix (once, for all ranks) and return the plan variant iteration `iteration` runs."""
        ready_key = _key(iteration, "ready")
        ready = self.store.get(ready_key).decode() if _has(self.store, ready_key) else INLINE
        decided = self.store.compare_set(_key(iteration, "decision"), "", ready)
        return decided.decode() if isinstance(decided, bytes) else str(decided)

    def fetch(self, iteration: int, inline: Callable[[], Plan | list[Plan]]) -> tuple[Plan, str]:
        """The plan this rank's replica runs at `iteration` and its variant. `inline` plans the
        iteration when the planner had nothing ready (counted and logged): this replica's plan,
        or with `shares_fallback=True` every replica's (a list)."""
        variant = self.decide(iteration)
        self.plan_calibration = None
        started = time.monotonic()
        if variant == INLINE:
            self.inline_count += 1
            plan = self._fallback(iteration, inline)
            logger.warning(
                "iteration %d: no plan ready from the planner; %s in %.0f ms",
                iteration,
                {None: "planned inline", True: "planned inline for every replica"}.get(
                    self.shares_fallback, "fetched rank 0's inline plan"
                ),
                1e3 * (time.monotonic() - started),
            )
            return plan, variant
        data = self.store.get(_key(iteration, variant, self.replica))
        plan = plan_from_bytes(data)
        if plan.iteration != iteration or plan.replica != self.replica:
            raise ValueError(
                f"store returned the plan of iteration {plan.iteration} replica {plan.replica} "
                f"for iteration {iteration} replica {self.replica}"
            )
        tag = _key(iteration, variant, "calibration")
        if _has(self.store, tag):
            self.plan_calibration = int(self.store.get(tag))
        logger.debug(
            "iteration %d: fetched %s plan in %.1f ms",
            iteration,
            variant,
            1e3 * (time.monotonic() - started),
        )
        return plan, variant

    def _fallback(self, iteration: int, inline: Callable[[], Plan | list[Plan]]) -> Plan:
        """The inline plan: computed here, or made once on rank 0 and shared (class doc)."""
        if self.shares_fallback is None:
            return inline()
        began = _key(iteration, INLINE, "began")
        if self.shares_fallback:
            self.store.set(began, "1")  # so that a peer that times out can say where rank 0 was
            plans = inline()
            for replica, plan in enumerate(plans):
                self.store.set(_key(iteration, INLINE, replica), plan_to_bytes(plan))
            return plans[self.replica]
        try:  # bounded by the store's timeout (--dip-comm-timeout-s)
            data = self.store.get(_key(iteration, INLINE, self.replica))
        except RuntimeError as e:
            where = (
                "it began that plan and has not finished it"
                if _has(self.store, began)
                else "it has not begun that plan: it is still in an earlier step"
            )
            raise RuntimeError(
                f"iteration {iteration}: rank 0 published no fallback plan for replica "
                f"{self.replica} within the plan store's timeout ({where}): {e}"
            ) from None
        return plan_from_bytes(data)

    def cleanup(self, iteration: int, *, num_replicas: int) -> None:
        """Delete an iteration's keys once every rank has fetched its plan."""
        for r in range(num_replicas):
            self.store.delete_key(_key(iteration, INLINE, r))
        self.store.delete_key(_key(iteration, INLINE, "began"))
        for variant in (GREEDY, SEARCHED):
            for r in range(num_replicas):
                self.store.delete_key(_key(iteration, variant, r))
            self.store.delete_key(_key(iteration, variant, "calibration"))
        self.store.delete_key(_key(iteration, "ready"))
        self.store.delete_key(_key(iteration, "decision"))
