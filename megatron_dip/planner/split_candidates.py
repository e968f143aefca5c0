"""The split-backward candidates of one replica's plan (`PlannerConfig.split_backward`).

The planner's last step (`DipPlanner.plan_replica`) hands its chosen fused plan here and gets
back the fastest plan within memory among: that plan; that plan with its W moved into its
bubbles (`weight_fill.split_into_bubbles`); DIP's own order list-scheduled with split backwards
(`split_schedule`) under the fused plan's recompute choice and under the choices the memory pass
makes for split schedules; and, with `PlannerConfig.split_search`, the order the search finds
when it scores split list schedules. Where no all-split schedule fits, the stages whose pending W
would hold more than their activations (recomputed layers, rebuilt in B) keep their fused
backward. Splitting is one more candidate, so it can only help the simulated iteration.

Like `fallback` and `sub_size_choice`, this works through the planner's own graph, cost, memory
and search helpers (`planner`: the `DipPlanner`, which imports this module): one planner, one
way of pricing a stage.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..schedule.engine import per_peer_channel
from ..schedule.graph import Dataflow
from ..schedule.ir import ChunkSpec, Plan, StageId
from ..schedule.validate import validate_plan
from .list_scheduler import ListSchedule, priorities_from_units
from .memory import MemoryLimitError, RecomputeChoice
from .message_room import MESSAGE_REFITS, grown_room
from .overheads import host_overheads
from .recompute_candidates import RecomputeCandidates
from .simulator import SimResult, reduction_time, simulate
from .stock_configs import peaks_fit

logger = logging.getLogger(__name__)

# How much more in-flight activation memory the memory pass lets a split schedule plan with
# before recomputation brings it back under the real limit (`DipPlanner`'s RELAXATION_FACTORS
# for fused schedules): one factor, to keep the split candidate's planning time small.
SPLIT_RELAXATION_FACTORS = (1.25,)


def best_split_plan(
    planner, plan: Plan, own: Plan, scheduled: tuple, use_search: bool = False
) -> tuple[Plan, float]:
    """The fastest within memory of `plan` (the chosen fused plan), `plan` with its W moved
    into its bubbles and DIP's own schedule (`own`, of `scheduled` = dataflow,
    sub-microbatches, order, recompute choice) list-scheduled with split backwards (module
    docstring), with its simulated time. With `split_always`, the fastest fitting split
    candidate even where `plan` is faster (`plan` where none fits)."""
    from .weight_fill import split_into_bubbles

    always = planner.config.split_always
    best, sim = split_into_bubbles(
        plan,
        planner.cost_model,
        limits=planner.device_limits,
        channel=per_peer_channel,
        require_faster=not always,
    )
    dataflow, sub_of, order, choice = scheduled
    candidates = SplitCandidates(
        planner, dataflow, sub_of, own, planner.scheduling_limits, planner.device_limits
    )
    found = candidates.list_scheduled(order, choice, use_search=use_search)
    logger.debug(
        "split backwards: post-pass %.6g s, list schedule %s",
        sim.iteration_time,
        "none fits" if found is None else f"{found[1].iteration_time:.6g} s",
    )
    if found is not None and (
        found[1].iteration_time < sim.iteration_time or (always and best is plan)
    ):
        best, sim = found
    if always and best is plan:
        logger.warning("--dip-split-backward-always: no split plan fits; running the fused one")
    if best is not plan and planner.config.validate_plans:
        validate_plan(best)
    return best, sim.iteration_time


@dataclass
class SplitCandidates:
    """DIP's orders list-scheduled with split backwards, for one replica's plan: `own` (DIP's
    fused plan of `dataflow`, whose microbatches and messages the split plans keep),
    `sub_of` (its sub-microbatches by work id), the activation `limits` they are scheduled
    within (None: none) and the `caps` their simulated peaks, message buffers included, must
    fit (`DipPlanner.scheduling_limits`)."""

    planner: Any  # the `DipPlanner` (not imported: it imports this module)
    dataflow: Dataflow
    sub_of: Mapping
    own: Plan
    limits: Sequence[float] | None
    caps: Sequence[float] | None

    def list_scheduled(
        self, order, choice: RecomputeChoice, *, use_search: bool = False
    ) -> tuple[Plan, SimResult] | None:
        """`order` list-scheduled with split backwards under `choice` and under the choices
        the memory pass makes for split schedules (`choices`), and, with `use_search` and
        `split_search`, the order searched by split makespans under `choice`: the fastest
        simulated as a plan with its simulation; None where none fits the limits."""
        options = [choice, *self.choices(order)]
        found = [self.order_plan(order, options)]
        searched = None
        if use_search and self.planner.config.split_search:
            searched = self.searched_order(choice)
        if searched is not None and tuple(searched) != tuple(order):
            found.append(self.order_plan(searched, [choice]))
        fitting = [f for f in found if f is not None]
        return min(fitting, key=lambda f: f[1].iteration_time, default=None)

    def searched_order(self, choice: RecomputeChoice) -> tuple:
        """The unit order the search finds when it scores each order by its split list
        schedule's makespan (`split_schedule.SplitScore`) under `choice`."""
        from .split_schedule import SEARCH_OVERSHOOTS, SEARCH_ROUNDS, SplitScore

        graph = self.graph(choice)
        factory = functools.partial(
            SplitScore,
            graph,
            self.limits,
            self.planner.config.fill_bubbles,
            SEARCH_OVERSHOOTS,
            SEARCH_ROUNDS,
        )
        found = self.planner.search_order(
            graph, self.dataflow, self.limits, use_search=True, factory=factory
        )
        return found.order

    def order_plan(
        self, order, options: Sequence[RecomputeChoice]
    ) -> tuple[Plan, SimResult] | None:
        """`order` list-scheduled with split backwards under each recompute choice of
        `options`, the fastest as a plan with its simulation; None where none fits the limits.
        Where none fits with every backward split, the heavy stages keep their fused backward
        (module docstring)."""
        for keep_heavy in (False, True):
            found = self.options_plan(order, options, keep_heavy)
            if found is not None or self.limits is None:
                return found
        return None

    def options_plan(
        self, order, options: Sequence[RecomputeChoice], keep_heavy: bool
    ) -> tuple[Plan, SimResult] | None:
        """`order_plan` with or without the heavy stages fused (`keep_heavy`)."""
        best, chosen = None, None
        for option in options:
            found = self.scheduled(order, option, self.limits, keep_heavy)
            if found is not None and (best is None or found.makespan < best.makespan):
                best, chosen = found, option
        if best is None:
            return None
        return self.fitted(order, best, chosen, keep_heavy)

    def fitted(
        self, order, schedule: ListSchedule, choice: RecomputeChoice, keep_heavy: bool
    ) -> tuple[Plan, SimResult] | None:
        """`schedule` (of `order` under `choice`) lowered and simulated, if it fits the caps
        with its message buffers; else scheduled again within the caps less its buffers, as
        `DipPlanner._fit_messages` refits fused plans (`MESSAGE_REFITS` times at most: a split
        schedule holds its pending W's activations longer, and its buffers outgrow the first
        room more often than a fused one's); None where none fits."""
        from .split_schedule import split_plan

        tensors = functools.partial(self.planner.message_tensors, self.sub_of)
        caps = self.caps
        room = None if caps is None else tuple(c - lim for c, lim in zip(caps, self.limits))
        for refits in range(MESSAGE_REFITS + 1):
            plan = split_plan(self.own, schedule, self.dataflow, tensors)
            sim = simulate(plan, self.planner.cost_model, channel=per_peer_channel)
            if caps is None or peaks_fit(sim.peak_activation_bytes, caps):
                return plan, sim
            if refits == MESSAGE_REFITS:
                break
            room = grown_room(room, plan)
            limits = [c - r for c, r in zip(caps, room)]
            schedule = self.scheduled(order, choice, limits, keep_heavy)
            if schedule is None:
                break
        return None

    def graph(self, choice: RecomputeChoice, keep_heavy: bool = False):
        """The stage graph under `choice` with split backwards and the chunks' reductions
        (`keep_heavy`: `stage_times`')."""
        from .split_schedule import split_graph, with_reductions

        fused = self.planner.stage_graph(self.dataflow, self.sub_of, choice, forward_only=False)
        cost = functools.partial(self.stage_times, choice, keep_heavy=keep_heavy)
        graph = split_graph(fused, cost)
        return with_reductions(graph, self.dataflow.placement, self.reduce_time)

    def scheduled(
        self, order, choice: RecomputeChoice, limits, keep_heavy: bool = False
    ) -> ListSchedule | None:
        """The best split list schedule of `order` under `choice` within `limits`."""
        from .split_schedule import best_split_schedule

        graph = self.graph(choice, keep_heavy)
        return best_split_schedule(
            graph,
            priority=priorities_from_units(graph.stages, order),
            memory_limit=limits,
            recompute=choice.of,
            fill_bubbles=self.planner.config.fill_bubbles,
        )

    def choices(self, order) -> list[RecomputeChoice]:
        """The memory pass for split schedules: schedule with split backwards as if the limit
        were `factor` times larger, then choose recomputation so that what that schedule keeps
        alive (a stage until its W) fits the real limit (`SPLIT_RELAXATION_FACTORS`)."""
        from .split_schedule import held_until_weights

        planner = self.planner
        if self.limits is None or not planner.config.optimize_memory:
            return []
        memory_pass = RecomputeCandidates(planner, self.dataflow, self.sub_of, order, self.limits)
        out = []
        for factor in SPLIT_RELAXATION_FACTORS:
            loose_limits = [x * factor for x in self.limits]
            loose = self.scheduled(order, planner.uniform_choice(), loose_limits)
            if loose is None:
                continue
            alive = held_until_weights(loose.orders)
            try:
                out.append(memory_pass.choose(alive))
            except MemoryLimitError:
                continue
        return out

    def reduce_time(self, chunk: ChunkSpec) -> float:
        """Seconds of `chunk`'s data-parallel gradient reduction, as the simulator prices its
        `ReduceGrads`."""
        planner = self.planner
        return reduction_time(planner.cost_model, chunk, planner.config.data_parallel)

    def stage_times(
        self, choice: RecomputeChoice, stage: StageId, *, keep_heavy: bool = False
    ) -> tuple[float, float, float]:
        """(B, W) seconds of a stage's split backward, each with its instruction's host time,
        and the bytes its pending W holds; W 0 (the backward stays whole) for a module without
        weight gradients, and with `keep_heavy` for a stage whose pending W would hold more
        than its activations."""
        planner = self.planner
        c = planner.stage_cost(self.sub_of, stage, choice.of(stage))
        host = host_overheads(planner.cost_model).instruction
        if c.weight <= 0 or (keep_heavy and c.pending_weight_bytes > c.activation_bytes):
            return c.backward + host, 0.0, float(c.activation_bytes)
        return c.backward_input + host, c.weight + host, float(c.pending_weight_bytes)
