"""Split backwards scheduled by the list scheduler: B on the critical path, W in the bubbles.

DIP's plans hold activations up to the memory limit, so W cannot be deferred after the fact
(`weight_fill`'s post-pass finds no room). Here the list scheduler itself places each W
(`schedule_kernel`: a rank runs its oldest pending W where it would idle, or in a gap the W
fits), and a pending W holds its stage's activations, so the scheduler admits fewer forwards
while W are pending: it trades in-flight forwards for W that fill the drain, ZB-H1's way, under
the real limit. Frozen modules have no weight gradients: their backward stays whole.

`split_graph` prices a stage graph's split backwards, `best_split_schedule` tries the fill
policies under the plan's order and recompute choice, and `split_plan` makes the plan from the
schedule (communication, W placed, one gradient reduction per trainable chunk). The DIP planner
keeps the split plan only where it simulates faster than the fused one within memory
(`DipPlanner._split_backwards`), so splitting is one more candidate: it can only help.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..schedule.backward_split import place_weights
from ..schedule.graph import Dataflow
from ..schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    MemoryPolicy,
    Plan,
    StageId,
)
from ..schedule.passes import TensorFn, add_communication
from .list_scheduler import ListSchedule, StageGraph, split_list_schedule

# Share of a W that may overrun the idle gap it is put into (tried in turn, the fastest kept):
# 0 never delays a ready B or F; 0.5 fills more of the bubbles at the risk of a short delay;
# 1 runs each W as soon as its rank is free (no deferral: where memory binds, a deferred W that
# holds activations costs more than the bubble it fills, and B alone still sends the gradient
# upstream sooner than the fused backward).
OVERSHOOTS = (0.0, 0.5, 1.0)

# (input-gradient seconds, weight-gradient seconds) of a stage's backward, host time included;
# weight 0: the backward stays whole (a frozen module).
SplitCostFn = Callable[[StageId], "tuple[float, float, float]"]


def split_graph(graph: StageGraph, split_cost: SplitCostFn) -> StageGraph:
    """`graph` with each stage's backward split as `split_cost` prices it: (B seconds, W
    seconds, bytes a pending W holds)."""
    costs = [split_cost(s) if b else (t, 0.0, a) for s, b, t, a in zip(
        graph.stages, graph.has_backward, graph.bwd_time, graph.act_bytes)]  # fmt: skip
    return graph.with_split([c[0] for c in costs], [c[1] for c in costs], [c[2] for c in costs])


def best_split_schedule(
    graph: StageGraph,
    *,
    priority: Sequence[tuple],
    memory_limit: Sequence[float] | None,
    recompute: Callable[[StageId], MemoryPolicy] = lambda s: NO_RECOMPUTE,
    fill_bubbles: bool = True,
) -> ListSchedule | None:
    """The fastest list schedule of a split `graph` over the fill policies (`OVERSHOOTS`) that
    stays within `memory_limit`; None if none does."""
    best = None
    for overshoot in OVERSHOOTS:
        found = split_list_schedule(
            graph,
            priority=priority,
            memory_limit=memory_limit,
            recompute=recompute,
            fill_bubbles=fill_bubbles,
            overshoot=overshoot,
        )
        if not found.overcommitted and (best is None or found.makespan < best.makespan):
            best = found
    return best


def held_until_weights(orders: Sequence[Sequence]) -> list[list]:
    """Compute orders as the memory pass reads them (activations held from a Forward to its
    Backward), for a split schedule: a split stage's W takes its Backward's place (its B
    holds on), so recomputation is chosen for what the split schedule really keeps alive."""
    return [
        [
            Backward(i.stage) if isinstance(i, BackwardWeight) else i
            for i in order
            if not isinstance(i, BackwardInput)
        ]
        for order in orders
    ]


def split_plan(plan: Plan, schedule: ListSchedule, dataflow: Dataflow, tensors: TensorFn) -> Plan:
    """`plan` (same batch, placement and sub-microbatches as `dataflow`) with the programs of
    the split `schedule`: communication placed by its B/F orders, each W where the schedule has
    it, a reduction after each trainable chunk's last W."""
    computes = [
        tuple(i for i in order if not isinstance(i, BackwardWeight)) for order in schedule.orders
    ]
    delay = _weights_before(schedule)
    programs = add_communication(
        computes,
        dataflow,
        tensors=tensors,
        compute_time=lambda r, ins: schedule.duration(r, ins) + delay.get(ins, 0.0),
    )
    programs = place_weights(programs, schedule.orders, plan.placement)
    return dataclasses.replace(plan, programs=programs, name=plan.name + "+bw")


def _weights_before(schedule: ListSchedule) -> dict:
    """Seconds of the W that run right before each compute: the communication pass times the
    orders without W, and charging them to the next compute keeps its timing (where messages
    are posted and waited for) close to the schedule's."""
    out: dict = {}
    for order in schedule.orders:
        pending = 0.0
        for ins in order:
            if isinstance(ins, BackwardWeight):
                pending += schedule.durations[ins]
            else:
                if pending:
                    out[ins] = pending
                pending = 0.0
    return out
