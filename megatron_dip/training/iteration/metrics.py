"""Per-iteration numbers: global loss, busy time, per-module compute times, model FLOPs.

`gather_stats` is the one collective per iteration that brings every rank's numbers to every rank
(loss sums and tokens as Megatron reports them: summed over all microbatches of the global batch,
then divided, so the loss does not depend on packing or layout; measured busy time; measured and
predicted compute time per module for the cost-model calibration, `planner.calibration`).

Predicted times are the *uncalibrated* cost model's, so the calibration's scale factors stay
measured / predicted of the loaded cost model, whatever scales were in force when planning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dip.data.sample import BatchMeta
from megatron_dip.modalities import modality_of
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    ChunkSpec,
    Forward,
    Plan,
    StageId,
)

from ..assembly.setup import ParallelContext
from .step import StepResult


def _op_parts(op: tuple) -> tuple[StageId, bool, float]:
    """(stage, is_forward, measured seconds) of one `StepResult.ops` entry: either
    (instruction, seconds) or (module, is_forward, seconds, stage)."""
    if len(op) == 2 and isinstance(op[0], (Forward, Backward, BackwardWeight)):
        ins, seconds = op
        return ins.stage, isinstance(ins, Forward), float(seconds)
    if len(op) == 4:
        _, forward, seconds, stage = op
        return stage, bool(forward), float(seconds)
    raise ValueError(f"unrecognised executor timing record {op!r}")


def predicted_ops(plan: Plan, cost_model, ops: Iterable[tuple]) -> dict[str, float]:
    """Cost-model seconds of the executed compute instructions, by module (the recompute mode
    of a backward is its forward's, read from the plan)."""
    recompute = {
        ins.stage: ins.memory
        for program in plan.programs
        for ins in program.instructions
        if isinstance(ins, Forward)
    }
    out: dict[str, float] = {}
    for op in ops:
        s, forward, _ = _op_parts(op)
        chunk: ChunkSpec = plan.placement.module(s.module).chunks[s.chunk]
        c = cost_model.stage_cost(chunk, plan.submicrobatch(s.work), recompute.get(s, NO_RECOMPUTE))
        out[s.module] = out.get(s.module, 0.0) + _priced(c, op, forward)
    return out


def _priced(cost, op: tuple, forward: bool) -> float:
    """Cost-model seconds of one executed compute (a `StageCost`'s part): the halves of a split
    backward as such, so measured / predicted compares like with like."""
    ins = op[0] if len(op) == 2 else None
    if isinstance(ins, BackwardWeight):
        return cost.weight
    if isinstance(ins, BackwardInput):
        return cost.backward_input
    return cost.forward if forward else cost.backward


def measured_ops(ops: Iterable[tuple]) -> dict[str, float]:
    """Measured seconds of the executed compute instructions, by module."""
    out: dict[str, float] = {}
    for op in ops:
        s, _, seconds = _op_parts(op)
        out[s.module] = out.get(s.module, 0.0) + seconds
    return out


@dataclass(frozen=True)
class GlobalStats:
    """One iteration's numbers, identical on every rank."""

    loss: float
    loss_tokens: float
    max_busy: float
    max_duration: float  # the slowest rank's schedule time
    measured: dict[str, float]
    predicted: dict[str, float]
    blanked: int = 0  # samples trained as blank stand-ins this iteration (all replicas)


def gather_stats(
    ctx: ParallelContext,
    result: StepResult,
    *,
    modules: list[str],
    predicted: Mapping[str, float],
    blanked: int = 0,
) -> GlobalStats:
    """All-gather every rank's loss sums, busy time and per-module times (module docstring);
    `blanked`: this rank's count of blank stand-in samples (count each on one rank only)."""
    loss, tokens = result.loss_totals() if ctx.tp_rank == 0 else (0.0, 0.0)
    measured = measured_ops(result.ops)
    row = [loss, tokens, result.busy, result.ended - result.started, blanked]
    row += [measured.get(m, 0.0) for m in modules] + [predicted.get(m, 0.0) for m in modules]
    mine = torch.tensor(row, dtype=torch.float64, device=ctx.device)  # NCCL on a GPU
    rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    # Bounded by --dip-comm-timeout-s whatever the world group's own timeout is.
    ctx.watch.wait(dist.all_gather(rows, mine, async_op=True))
    table = torch.stack(rows)
    n = len(modules)
    total_tokens = float(table[:, 1].sum())
    return GlobalStats(
        loss=float(table[:, 0].sum()) / max(total_tokens, 1.0),
        loss_tokens=total_tokens,
        max_busy=float(table[:, 2].max()),
        max_duration=float(table[:, 3].max()),
        blanked=int(table[:, 4].sum()),
        measured={m: float(table[:, 5 + i].sum()) for i, m in enumerate(modules)},
        predicted={m: float(table[:, 5 + n + i].sum()) for i, m in enumerate(modules)},
    )


def batch_tokens(model: MultimodalSpec, batch: BatchMeta) -> dict[str, int]:
    """Tokens each module processes for `batch` (text for the LLM / text encoder, instance
    tokens for the media modules: `Modality.module_tokens`)."""
    return {
        m.name: sum(modality_of(m).module_tokens(m, s)[0] for s in batch.samples)
        for m in model.modules
    }


def model_flops(model: MultimodalSpec, cost_model, batch: BatchMeta) -> float:
    """6 * params * tokens per trained module (2 * for frozen ones); attention's quadratic part
    is left out, so TFLOP/s from it is an underestimate."""
    tokens = batch_tokens(model, batch)
    total = 0.0
    for m in model.modules:
        params = cost_model.chunk_params(ChunkSpec(m.name, 0, 0, 0, m.num_layers))
        total += (6 if m.trainable else 2) * params * tokens[m.name]
    return total
