"""The memory pass around one plan's list schedule: which recomputation (and offload) to trade
for the forwards that throttling at the memory limit would hold back.

`RecomputeCandidates` is bound to one plan's searched order (its dataflow, sub-microbatches and
per-rank limits) and asks its `DipPlanner` for stage graphs and list schedules. Its candidates
(`all`): schedule as if the limit were `factor` times larger (`RELAXATION_FACTORS`), choose per
chunk (`memory.choose_recompute`, a MILP) so that schedule's alive-sets fit the real limit, then
reschedule under the real limit with those costs (`refined`) and also keep the relaxed orders
timed with them (`kept`); the shortest few give back the recomputation their own schedules do
not need (`relaxed`). Offload that takes a schedule over the host limit is replaced by
recomputation (`within_host_limit`). Everything is a function of the plan's inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..schedule.graph import Dataflow
from .list_scheduler import ListSchedule
from .memory import (
    MemoryLimitError,
    RecomputeChoice,
    choose_recompute,
    relax_choice,
    within_host_limit,
)
from .retime import retimed

# How much more in-flight activation memory the memory pass lets the scheduler plan with before
# recomputation brings it back under the real limit.
RELAXATION_FACTORS = (1.25, 1.5, 2.0, 3.0)
# Memory passes on a candidate's own (throttled) schedule where it still overcommits.
REFINE_ROUNDS = 5
# Rounds of taking back the recomputation a fitting candidate's own schedule does not need.
RELAX_ROUNDS = 2
# ... on this many of the memory pass's candidates (the shortest list schedules).
RELAX_BEST = 4

Planned = tuple[ListSchedule, RecomputeChoice]


@dataclass
class RecomputeCandidates:
    """The memory pass's candidates for one plan (module docstring): `order` is the searched
    unit order, `limits` the per-rank device limits."""

    planner: Any  # the `DipPlanner` (not imported: it imports this module)
    dataflow: Dataflow
    sub_of: Mapping
    order: Sequence[tuple[str, int]]  # the searched unit order
    limits: list[float]

    def all(self, *, errors: list[MemoryLimitError]) -> list[Planned]:
        """Every candidate (none where memory does not bind); factors whose schedule cannot
        fit add their error to `errors`."""
        uniform = self.planner.uniform_choice()
        free = self.planner.stage_graph(self.dataflow, self.sub_of, uniform, forward_only=False)
        unbounded = self.planner.list_scheduled(free, self.order, None, uniform)
        if all(p <= lim for p, lim in zip(unbounded.peak_memory, self.limits)):
            return []  # memory does not bind: nothing to trade
        out = []
        for factor in RELAXATION_FACTORS:
            relaxed = [x * factor for x in self.limits]
            loose = self.planner.list_scheduled(free, self.order, relaxed, uniform)
            try:
                choice = self.choose(loose.orders)
            except MemoryLimitError as err:
                errors.append(err)
                continue
            out.append(self.refined(choice))
            kept = self.kept((loose, choice))
            if kept is not None:
                out.append(kept)
        # Taking back recomputation gains a few per cent; only the best candidates can win.
        out.sort(key=lambda c: (c[0].overcommitted, c[0].makespan))
        return [self.relaxed(c) for c in out[:RELAX_BEST]] + out[RELAX_BEST:]

    def choose(self, orders, floor=None, *, exact: bool = True) -> RecomputeChoice:
        """The memory pass (`choose_recompute`) on `orders` under the device and host limits
        (`exact=False`: its greedy answer alone, for `refined`'s top-ups)."""
        return choose_recompute(orders, **self.inputs(), floor=floor, exact=exact)

    def inputs(self) -> dict:
        """What the memory pass and its relaxation (`choose_recompute`, `relax_choice`) take
        besides the orders: each stage's modes and their costs, which stages keep activations,
        the device and host limits, and the batch's row cache."""
        planner, sub_of = self.planner, self.sub_of
        return dict(
            mode_cost=functools.partial(planner.mode_cost, sub_of),
            modes_of=functools.partial(planner.memory_policies, sub_of),
            keeps_activations=self._keeps_activations,
            memory_limit=self.limits,
            **planner.host_limit_args(sub_of),
            row_cache=planner.plan_memos(sub_of)[3],
        )

    def kept(self, planned: Planned) -> Planned | None:
        """The relaxed schedule's own orders (`planned`: the schedule and the choice the memory
        pass made on its alive-sets) timed with the choice's costs (`retime.retimed`): every
        alive-set of these orders fits by the pass's construction, so no forward is throttled.
        None where they do not fit after all (the pass's greedy answer may end over a limit)
        or its offload breaks the host limit."""
        loose, choice = planned
        graph = self.planner.stage_graph(self.dataflow, self.sub_of, choice, forward_only=False)
        kept = retimed(loose, graph, choice.of, self.limits)
        if kept is None or kept.overcommitted:
            return None
        host = self.planner.host_limit_args(self.sub_of)
        if (
            host
            and within_host_limit(
                kept.orders,
                choice,
                host_bytes=host["host_bytes"],
                host_limit=host["host_limit"],
                keeps_activations=self._keeps_activations,
            ).modes
            != choice.modes
        ):
            return None
        return kept, choice

    def refined(self, choice: RecomputeChoice) -> Planned:
        """The list schedule under the real limit with `choice`'s costs; where that schedule
        still overcommits (under the limit the scheduler throttles forwards, so its alive-sets
        differ from the relaxed schedule's the choice was made on), the memory pass again on
        the schedule's own orders, only upgrading from `choice` (at most REFINE_ROUNDS times)."""
        schedule = self.scheduled(choice)
        for _ in range(REFINE_ROUNDS):
            if not schedule.overcommitted:
                break
            try:
                more = self.choose(schedule.orders, floor=choice.of, exact=False)
            except MemoryLimitError:
                break
            if not more.modes:
                break
            modes, added = {**choice.modes, **more.modes}, choice.added_time + more.added_time
            choice = RecomputeChoice(modes, added)
            schedule = self.scheduled(choice)
        return self.within_host_limit((schedule, choice))

    def relaxed(self, planned: Planned) -> Planned:
        """`planned` (schedule, choice), or the same with the recomputation its schedule's own
        alive-sets do not need taken back (`relax_choice`), in the same orders timed again
        (`retime.retimed`) or scheduled again, whichever fits and runs shortest, where that is
        shorter (at most RELAX_ROUNDS times)."""
        schedule, choice = planned
        for _ in range(RELAX_ROUNDS):
            if schedule.overcommitted:
                break
            relaxed = relax_choice(schedule.orders, choice, **self.inputs())
            if relaxed is choice:
                break
            graph = self.planner.stage_graph(
                self.dataflow, self.sub_of, relaxed, forward_only=False
            )
            tries = [self.planner.list_scheduled(graph, self.order, self.limits, relaxed)]
            tries.append(retimed(schedule, graph, relaxed.of, self.limits))
            tries = [t for t in tries if t is not None and not t.overcommitted]
            best = min(tries, key=lambda t: t.makespan, default=None)
            if best is None or best.makespan >= schedule.makespan:
                break
            schedule, choice = best, relaxed
        return schedule, choice

    def within_host_limit(self, planned: Planned) -> Planned:
        """`planned` (schedule, choice), with offload that takes the schedule's alive-sets over
        the host limit replaced by full recomputation and rescheduled until none does (each
        round only removes offload; the last removes all of it)."""
        schedule, choice = planned
        host = self.planner.host_limit_args(self.sub_of)
        if not host:
            return schedule, choice
        within = functools.partial(
            within_host_limit,
            host_bytes=host["host_bytes"],
            keeps_activations=self._keeps_activations,
            mode_cost=functools.partial(self.planner.mode_cost, self.sub_of),
        )
        for attempt in range(REFINE_ROUNDS + 1):
            fixed = within(schedule.orders, choice, host_limit=host["host_limit"])
            if fixed.modes == choice.modes:
                break
            if attempt == REFINE_ROUNDS:  # no offload left at all
                fixed = within(schedule.orders, choice, host_limit=[0.0] * len(self.limits))
            choice = fixed
            schedule = self.scheduled(choice)
        return schedule, choice

    def scheduled(self, choice: RecomputeChoice) -> ListSchedule:
        """The plan's order list-scheduled under the real limits with `choice`'s costs."""
        graph = self.planner.stage_graph(self.dataflow, self.sub_of, choice, forward_only=False)
        return self.planner.list_scheduled(graph, self.order, self.limits, choice)

    def _keeps_activations(self, stage) -> bool:
        return self.dataflow.needs_backward(stage.module)


__all__ = ["RELAXATION_FACTORS", "RecomputeCandidates"]
