"""Where each iteration's plan comes from.

DIP (`DipPlans`): rank 0 runs the planner service (a separate process planning the next
--dip-lookahead batches from `BatchStream.peek`, greedy first, then searched), delivering through a
TCPStore that rank 0 hosts; every rank asks `PlanClient.fetch` for its replica's plan; when nothing
is ready, rank 0 makes a fallback plan for every replica once (`DipPlanner.fallback_plan`:
Megatron's order on the chosen placement, else one list schedule: milliseconds, with the list
scheduler's kernel loaded on a thread at start-up, `_warm_up_in_background`) and shares it through
the store (counted as inline). With --dip-lookahead 0 there is no planner process and every rank computes the same
greedy plan itself (deterministic: the planner's work is bounded by its input, never the clock).

Calibration (`DipPlans.calibrate`): every rank applies the same per-module scale factors, at the
same iteration, to its inline planner's cost model; rank 0 also publishes them (versioned) to the
store, where the planner process picks them up before planning its next batch. A fetched plan
carries the calibration version it was planned with (`plan_calibration`): possibly older than the
ranks' current one, still the one plan every rank runs.

Stock (`StockPlans`): Megatron's order on the stock placement, in the plan format, so that the same
`SampleBatchSource` feeds Megatron's own schedule functions and the simulator can predict them.
The global batch is packed once and split into equal contiguous shares, as Megatron does.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections import Counter

import torch.distributed as dist

from megatron_dip.batching import layout_batch
from megatron_dip.data.sample import BatchMeta
from megatron_dip.data.stream import BatchStream
from megatron_dip.planner.dip import DipPlanner, ReplicaPlan
from megatron_dip.planner.list_scheduler import warm_up
from megatron_dip.planner.service import (
    INLINE,
    PlanClient,
    PlannerService,
    StoreAddress,
    publish_calibration,
)
from megatron_dip.planner.stock_configs import with_recompute
from megatron_dip.schedule.baselines import build_megatron_plan
from megatron_dip.schedule.ir import Plan

from ..assembly.setup import ParallelContext
from ..config.run import RunSpec

logger = logging.getLogger(__name__)

WARM_UP_JOIN_S = 120.0  # a cold compilation of the scheduler kernel: 8 s of one idle core


def planner_factory(spec: RunSpec) -> functools.partial:
    """Builds the run's planner (here and in the planner process): on a static placement
    chosen at start-up, with its virtual stages for Megatron's order."""
    return functools.partial(
        DipPlanner,
        spec.model,
        spec.cost_model,
        spec.placement,
        spec.planner,
        stage_units=spec.stage_units,
    )


def make_planner(spec: RunSpec) -> DipPlanner:
    """The run's planner (`planner_factory`)."""
    return planner_factory(spec)()


def replica_plan(
    planner: DipPlanner,
    batch: BatchMeta,
    replica: int,
    *,
    search: bool = False,
    forward_only: bool = False,
) -> ReplicaPlan:
    """The plan of one replica, identical to `planner.plan_batch(batch)[replica]`."""
    return planner.plan_layout(
        planner.layout(batch), replica, forward_only=forward_only, search=search
    )


def _share_store(ctx: ParallelContext, timeout_s: float = 300.0):
    """A TCPStore hosted by rank 0 for plan delivery: (store, address for rank 0's planner
    process) on every rank. The server listens on all interfaces; the other ranks reach it by
    rank 0's host name (rank 0 need not be the rendezvous host)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    box: list = [None, None]
    store = None
    if ctx.rank == 0:
        store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        box = [socket.gethostname(), store.port]
    dist.broadcast_object_list(box, src=0)
    host, port = box
    if store is None:
        store = StoreAddress(host, int(port), timeout_s).connect()
    return store, StoreAddress("127.0.0.1", int(port), timeout_s)


def _warm_up_in_background() -> threading.Thread:
    """Load (or compile) the list scheduler's kernel on a thread of rank 0, which plans the
    iterations the planner process has nothing ready for. Where Megatron's order does not apply
    to such a batch, its fallback is one list schedule; without this, that iteration's plan
    compiled the kernel (8 s of one idle core on a fresh install) while every other rank waited
    for it, and on a loaded machine past --dip-comm-timeout-s. numba's compiler lock makes an
    early fallback wait for this thread's compilation rather than compile twice."""
    thread = threading.Thread(target=warm_up, name="dip-kernel-warm-up", daemon=True)
    thread.start()
    return thread


class DipPlans:
    """Plans of this rank's replica (module docstring)."""

    def __init__(self, spec: RunSpec, ctx: ParallelContext) -> None:
        self.spec, self.ctx = spec, ctx
        self.planner = make_planner(spec)
        self.calibration_version = 0
        self.plan_calibration = 0  # calibration version of the last plan handed out
        self.lookahead = spec.runtime.lookahead
        self.variants: Counter[str] = Counter()
        self.service: PlannerService | None = None
        self.client: PlanClient | None = None
        self._submitted = -1
        self.kernel_warm_up: threading.Thread | None = None
        if self.lookahead > 0:
            store, address = _share_store(ctx, timeout_s=spec.runtime.comm_timeout_s)
            self.client = PlanClient(store, replica=ctx.dp_rank, shares_fallback=ctx.rank == 0)
            if ctx.rank == 0:
                self.kernel_warm_up = _warm_up_in_background()
                factory = planner_factory(spec)
                silent = spec.runtime.planner_timeout_s
                self.service = PlannerService(
                    factory,
                    address,
                    lookahead=self.lookahead,
                    faults=spec.planner_faults,
                    timeout_s=silent,
                    # a plan may take the search budget on top
                    busy_limit_s=3 * silent + spec.planner.search.time_budget_s,
                )
                self.service.start()

    def calibrate(self, *, version: int, scales: dict[str, float]) -> None:
        """Plan from now on with the loaded cost model scaled by `scales` (calibration
        `version`). Call on every rank with the same arguments at the same iteration."""
        base = self.spec.cost_model
        self.planner.cost_model = base.calibrated(scales) if scales else base
        self.calibration_version = version
        if self.client is not None and self.ctx.rank == 0:
            publish_calibration(self.client.store, version=version, scales=scales)

    def ahead(self, stream: BatchStream) -> None:
        """Rank 0 hands the next --dip-lookahead batches' metadata to the planner process."""
        if self.service is None:
            return
        self.service.ensure_alive()  # restarts a planner that died or stopped answering
        for batch in stream.peek(self.lookahead):
            if batch.iteration > self._submitted:
                self.service.submit(batch)
                self._submitted = batch.iteration

    def plan(self, batch: BatchMeta) -> tuple[Plan, str]:
        """This replica's plan of `batch` and where it came from (searched/greedy/inline)."""

        def inline() -> Plan:
            return replica_plan(self.planner, batch, self.ctx.dp_rank).plan

        def fallbacks() -> list[Plan]:  # rank 0, for every replica (`PlanClient`)
            layout = self.planner.layout(batch)
            return [self.planner.fallback_plan(layout, r) for r in range(self.spec.shape.dp)]

        self.plan_calibration = self.calibration_version  # inline plans use the current one
        if self.client is None:
            plan, variant = inline(), INLINE
        else:
            plan, variant = self.client.fetch(batch.iteration, fallbacks)
            if self.service is not None:
                self.service.decided(batch.iteration)
            if self.client.plan_calibration is not None:
                self.plan_calibration = self.client.plan_calibration
            if self.ctx.rank == 0 and batch.iteration > 0:
                # Every rank fetched the previous iteration's plan: it ran with all of them.
                self.client.cleanup(batch.iteration - 1, num_replicas=self.spec.shape.dp)
        self.variants[variant] += 1
        return plan, variant

    def eval_plan(self, batch: BatchMeta) -> Plan:
        """A forward-only greedy plan (evaluation)."""
        return replica_plan(self.planner, batch, self.ctx.dp_rank, forward_only=True).plan

    @property
    def restarts(self) -> int:
        return self.service.restarts if self.service is not None else 0

    def close(self) -> None:
        """Stop the planner process; let a warm-up still compiling (a run shorter than a cold
        compilation) finish rather than end the interpreter under it."""
        if self.service is not None:
            self.service.close()
            self.service = None
        if self.kernel_warm_up is not None:
            self.kernel_warm_up.join(timeout=WARM_UP_JOIN_S)
            self.kernel_warm_up = None


class StockPlans:
    """Megatron's schedule for each replica's equal share of the packed global batch, in the
    plan format. How batches are cut and what the messages hold are the run's and fixed, so
    they are read once from the run's planner here, not per iteration."""

    def __init__(self, spec: RunSpec) -> None:
        # Shapes as the planner sees the run (--dip-emulate-compute: the emulated TP and dtype).
        planner = make_planner(spec)
        self.spec = spec
        self.layout_config = planner.layout_config.with_whole_modules()
        self.shapes = planner.shapes

    def plan(self, batch: BatchMeta, replica: int, *, forward_only: bool = False) -> Plan:
        """Replica `replica`'s plan of `batch` (Megatron's recompute flags on every stage)."""
        spec = self.spec
        layout = layout_batch(spec.model, batch, self.layout_config)
        mine = layout.replicas[replica]
        sub_of = mine.sub_of()
        plan = build_megatron_plan(
            placement=spec.placement,
            stage_units=spec.stage_units,
            submicrobatches=list(mine.submicrobatches),
            dependencies=list(mine.dependencies),
            microbatches=list(mine.infos),
            totals=layout.totals,
            num_model_chunks=len(spec.stage_units[0]),
            tensors=self.shapes.for_lookup(sub_of.__getitem__),
            iteration=batch.iteration,
            forward_only=forward_only,
        )
        return plan if forward_only else with_recompute(plan, spec.recompute)
