"""Split backwards scheduled by the list scheduler: B on the critical path, W in the bubbles.

DIP's plans hold activations up to the memory limit, so W cannot be deferred after the fact
(`weight_fill`'s post-pass finds no room). Here the list scheduler itself places each W
(`schedule_kernel`: a rank runs its oldest pending W where it would idle, or in a gap the W
fits), and a pending W holds its stage's activations, so the scheduler admits fewer forwards
while W are pending: it trades in-flight forwards for W that fill the drain, ZB-H1's way, under
the real limit. Frozen modules have no weight gradients: their backward stays whole.

`split_graph` prices a stage graph's split backwards, `best_split_schedule` tries the fill
policies under the plan's order and recompute choice (`with_reductions` adds the chunks'
data-parallel reductions, which the scheduler keeps from being exposed by deferred W), and
`split_plan` makes the plan from the
schedule (communication, W placed, one gradient reduction per trainable chunk). The DIP planner
keeps the split plan only where it simulates faster than the fused one within memory
(`split_candidates.best_split_plan`), so splitting is one more candidate: it can only help.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..schedule.backward_split import place_weights
from ..schedule.graph import Dataflow
from ..schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    ChunkSpec,
    MemoryPolicy,
    Placement,
    Plan,
    StageId,
)
from ..schedule.passes import TensorFn, add_communication
from .list_scheduler import (
    ListSchedule,
    StageGraph,
    split_list_makespan,
    split_list_schedule,
    unit_priority_ranks,
)

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


def with_reductions(
    graph: StageGraph, placement: Placement, reduce_time: Callable[[ChunkSpec], float]
) -> StageGraph:
    """`graph` with each chunk's data-parallel gradient reduction (`reduce_time(chunk)`
    seconds; 0: none, e.g. a frozen module or no data parallelism), so the scheduler prices an
    exposed reduction and does not defer a chunk's W past its deadline."""
    index: dict[tuple[str, int], int] = {}
    seconds: list[float] = []
    group = []
    for s in graph.stages:
        key = (s.module, s.chunk)
        if key not in index:
            t = reduce_time(placement.module(s.module).chunks[s.chunk])
            index[key] = len(seconds) if t > 0 else -1
            if t > 0:
                seconds.append(t)
        group.append(index[key])
    return graph.with_reductions(group, seconds) if seconds else graph


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


# The search's score runs the split list scheduler once per rollout, under the middle fill
# policy: all three policies with three runs each (what `best_split_schedule` does for the
# chosen order) made the search ~9x slower than the fused one (VLM-S: 4.2 s CPU per plan
# instead of 1.2 s); the chosen order is scheduled under every policy afterwards.
SEARCH_OVERSHOOTS = (0.5,)
SEARCH_ROUNDS = 1


@dataclass(frozen=True)
class SplitScore:
    """A picklable scorer for the order search with split backwards: unit order -> the fastest
    split list schedule's makespan over the fill policies `overshoots` (`rounds` runs each,
    `split_list_schedule`) within `memory_limit`; where none fits, twice the fastest one's
    (finite, as the search's reward needs, and behind every order that fits)."""

    graph: StageGraph
    memory_limit: Sequence[float] | None
    fill_bubbles: bool = True
    overshoots: tuple[float, ...] = OVERSHOOTS
    rounds: int = 3

    def __call__(self, order: Sequence[tuple[str, int]]) -> float:
        prank = unit_priority_ranks(self.graph, order)
        found = [
            split_list_makespan(
                self.graph,
                priority=prank,
                memory_limit=self.memory_limit,
                fill_bubbles=self.fill_bubbles,
                overshoot=overshoot,
                rounds=self.rounds,
            )
            for overshoot in self.overshoots
        ]
        makespan, over = min((over, makespan) for makespan, over in found)[::-1]
        return 2 * makespan if over else makespan


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


def split_plan(
    plan: Plan,
    schedule: ListSchedule,
    dataflow: Dataflow,
    tensors: TensorFn,
) -> Plan:
    """`plan` (same batch, placement and sub-microbatches as `dataflow`) with the programs of
    the split `schedule`: communication placed by its B/F orders for `plan.channels`' streams,
    each W where the schedule has it, a reduction after each trainable chunk's last W."""
    computes = [
        tuple(i for i in order if not isinstance(i, BackwardWeight)) for order in schedule.orders
    ]
    delay = _weights_before(schedule)
    programs = add_communication(
        computes,
        dataflow,
        tensors=tensors,
        compute_time=lambda r, ins: schedule.duration(r, ins) + delay.get(ins, 0.0),
        channels=plan.channels,
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
