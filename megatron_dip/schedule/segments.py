"""A simple multi-module plan builder: separated modality segments in a fixed order, no search.

Each module's chunks live where the placement puts them (DIP spreads every module over all
ranks). The order is GPipe-like: all forwards, microbatch by microbatch, producer modules before
their consumers, sub-microbatch by sub-microbatch, chunk by chunk; then all backwards in exactly
the reverse order. Each rank runs its part of this one global sequence, so the compute orders
are consistent by construction; `add_communication` makes the plan deadlock-free. The plan is
valid but unoptimised (every activation stays alive until the backward phase): it exists so the
runtime can be built and tested on real multi-module plans before the planner exists.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from .graph import Dataflow
from .ir import (
    Backward,
    BatchTotals,
    Dependency,
    Forward,
    MicrobatchInfo,
    Placement,
    Plan,
    StageId,
    SubMicrobatch,
)
from .passes import TensorFn, add_communication


def module_order(placement: Placement, dependencies: Sequence[Dependency]) -> list[str]:
    """Module names, producers before consumers (placement order among independent modules).

    Raises `ValueError` when the module-level dependencies are cyclic.
    """
    names = [m.name for m in placement.modules]
    upstream: dict[str, set[str]] = defaultdict(set)
    for d in dependencies:
        upstream[d.consumer.module].add(d.producer.module)
    order: list[str] = []
    while len(order) < len(names):
        ready = [n for n in names if n not in order and upstream[n] <= set(order)]
        if not ready:
            rest = [n for n in names if n not in order]
            raise ValueError(f"modules {rest} depend on each other in a cycle")
        order.append(ready[0])
    return order


def _forward_sequence(
    placement: Placement,
    microbatches: Sequence[MicrobatchInfo],
    submicrobatches: Sequence[SubMicrobatch],
    dependencies: Sequence[Dependency],
) -> list[StageId]:
    subs: dict[tuple[str, int], list[SubMicrobatch]] = defaultdict(list)
    for s in submicrobatches:
        subs[(s.module, s.microbatch)].append(s)
    modules = module_order(placement, dependencies)
    seq: list[StageId] = []
    for mb in sorted(m.index for m in microbatches):
        for module in modules:
            chunks = placement.module(module).num_chunks
            for s in sorted(subs[(module, mb)], key=lambda x: x.index):
                seq += [StageId(module, c, mb, s.index) for c in range(chunks)]
    position = {st.work: i for i, st in enumerate(seq)}
    for d in dependencies:
        if position.get(d.producer, -1) >= position.get(d.consumer, -1):
            raise ValueError(
                f"dependency {d.producer} -> {d.consumer} points backwards in microbatch order"
            )
    return seq


def build_segment_plan(
    *,
    placement: Placement,
    microbatches: Sequence[MicrobatchInfo],
    submicrobatches: Sequence[SubMicrobatch],
    dependencies: Sequence[Dependency],
    totals: BatchTotals,
    tensors: TensorFn,
    iteration: int = 0,
    forward_only: bool = False,
    name: str = "segments",
) -> Plan:
    """Build the fixed-order segment plan described in the module docstring."""
    df = Dataflow(placement, submicrobatches, dependencies)
    forwards = _forward_sequence(placement, microbatches, submicrobatches, dependencies)
    compute: list[list[Forward | Backward]] = [[] for _ in range(placement.num_ranks)]
    for stage in forwards:
        compute[df.rank_of(stage)].append(Forward(stage))
    if not forward_only:
        for stage in reversed(forwards):
            if df.needs_backward(stage.module):
                compute[df.rank_of(stage)].append(Backward(stage))
    return Plan(
        iteration=iteration,
        placement=placement,
        microbatches=tuple(microbatches),
        submicrobatches=tuple(submicrobatches),
        dependencies=tuple(dependencies),
        totals=totals,
        programs=add_communication(compute, df, tensors=tensors),
        forward_only=forward_only,
        name=name,
    )
