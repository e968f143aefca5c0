"""Checks run before an executor communicates: a plan that does not fit the built model is refused.

Every rank holds the whole plan and runs the same checks on all of it, so a plan that is wrong
anywhere is refused on every rank, before the first message (a rank that refused alone would leave
its peers waiting forever).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from megatron_dip.schedule.engine import PlanError
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import (
    FORMAT_VERSION,
    ChunkSpec,
    MessageKey,
    Placement,
    Plan,
    Recv,
    Send,
    TensorSpec,
)
from megatron_dip.schedule.validate import check_channel_order, check_plan_matches, validate_plan

TensorFn = Callable[[MessageKey], Iterable[TensorSpec]]
ChunkKey = tuple[str, int]


def unwrap_chunk(module: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside wrappers (DDP, Float16Module): the module with a `chunk` spec."""
    seen = module
    while not isinstance(getattr(seen, "chunk", None), ChunkSpec):
        inner = getattr(seen, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(
                f"{type(module).__name__} is not a model chunk: no `chunk` ChunkSpec attribute "
                "on it or on the modules it wraps"
            )
        seen = inner
    return seen


def index_chunks(chunks: Iterable[torch.nn.Module]) -> dict[ChunkKey, torch.nn.Module]:
    """The given (possibly wrapped) chunks by (module, chunk index); duplicates are refused."""
    found: dict[ChunkKey, torch.nn.Module] = {}
    for c in chunks:
        spec = unwrap_chunk(c).chunk
        key = (spec.module, spec.index)
        if key in found:
            raise ValueError(f"chunk {spec.module}{spec.index} is given twice")
        found[key] = c
    return found


def check_chunks(
    chunks: Mapping[ChunkKey, torch.nn.Module], *, placement: Placement, rank: int
) -> None:
    """Refuse unless this rank holds exactly the chunks the placement puts on it."""
    want = {(c.module, c.index): c for c in placement.chunks_on_rank(rank)}
    for key, spec in want.items():
        if key not in chunks:
            raise PlanError(
                f"rank {rank}: the placement puts chunk {key[0]}{key[1]} "
                f"(layers [{spec.layer_start}, {spec.layer_end})) here, but it was not built"
            )
        built = unwrap_chunk(chunks[key]).chunk
        if (built.layer_start, built.layer_end) != (spec.layer_start, spec.layer_end):
            raise PlanError(
                f"rank {rank}: chunk {key[0]}{key[1]} was built for layers "
                f"[{built.layer_start}, {built.layer_end}), the placement says "
                f"[{spec.layer_start}, {spec.layer_end})"
            )
    extra = sorted(set(chunks) - set(want))
    if extra:
        raise PlanError(
            f"rank {rank}: chunks {[f'{m}{i}' for m, i in extra]} were built here, "
            "the placement puts them elsewhere"
        )


def check_message_specs(plan: Plan, tensor_fn: TensorFn) -> None:
    """Refuse a plan whose message shapes differ from what the built model produces."""
    memo: dict[MessageKey, tuple[TensorSpec, ...]] = {}
    for program in plan.programs:
        for i, ins in enumerate(program.instructions):
            if not isinstance(ins, (Send, Recv)):
                continue
            if ins.key not in memo:
                memo[ins.key] = tuple(tensor_fn(ins.key))
            if tuple(ins.tensors) != memo[ins.key]:
                raise PlanError(
                    f"rank {program.rank}: instruction {i} ({type(ins).__name__.lower()} "
                    f"{ins.key}) carries {_specs(ins.tensors)}, the model produces "
                    f"{_specs(memo[ins.key])}"
                )


def _specs(specs: Iterable[TensorSpec]) -> str:
    return ", ".join(f"{s.name}{list(s.shape)}:{s.dtype}" for s in specs) or "nothing"


def check_before_run(
    *,
    plan: Plan,
    placement: Placement,
    rank: int,
    num_ranks: int,
    chunks: Mapping[ChunkKey, Any],
    tensor_fn: TensorFn | None,
    validate: bool,
) -> Dataflow:
    """All checks that need no communication; returns the plan's data flow.

    Format version; the plan is for this world size and the built model's placement; this rank
    holds exactly its chunks; (optionally) the full `validate_plan`; every channel carries its
    messages in one order; (when `tensor_fn` is given) every message has the model's shapes.
    """
    if plan.version != FORMAT_VERSION:
        raise PlanError(
            f"plan {plan.name!r} has format version {plan.version}, this runtime runs "
            f"version {FORMAT_VERSION}"
        )
    check_plan_matches(plan, placement=placement, num_ranks=num_ranks)
    check_chunks(chunks, placement=placement, rank=rank)
    if validate:
        validate_plan(plan)
    check_channel_order(plan.programs)  # also part of validate_plan; cheap, so always run
    if tensor_fn is not None:
        check_message_specs(plan, tensor_fn)
    return Dataflow(plan.placement, plan.submicrobatches, plan.dependencies)
