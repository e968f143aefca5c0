"""Loss normalisation, the one place for DIP and for Megatron-Core's stock schedules.

The two normalisations are Megatron-LM's: the per-microbatch mean (`microbatch_mean_scale`:
each microbatch's loss sum divided by its tokens and by the number of microbatches, what
Megatron-Core's `forward_step` applies to a loss function returning (loss_sum, num_tokens,
report)) and, with `calculate_per_token_loss`, the per-token loss (`per_token_scale`: the
summed loss divided by the global batch's loss tokens, which Megatron-LM applies to the reduced
gradients after the schedule). The stock path (`stock.StockPipeline`, `training.iteration.step.run_stock`)
hands Megatron's schedules `megatron_loss_func` and finishes a per-token loss with
`per_token_scale` of the gathered token count; DIP applies both before the backward, as below.

Megatron's stock schedules (loss function returning (loss_sum, num_tokens, report)) compute per
microbatch `loss_sum / num_tokens / M` on every data-parallel replica (M = microbatches per
replica) and the DDP wrapper averages gradients over the D replicas; with equal replicas the
gradient is that of

    J = 1/M_global * sum over all microbatches mb of the global batch of loss_sum(mb) / tokens(mb)

(`per_token=False`, the default), or, with `calculate_per_token_loss`,
`J = sum loss_sum / sum tokens` over the whole global batch (`per_token=True`).

DIP splits a microbatch's loss over several sub-microbatches (a DiT microbatch into clip groups)
and replicas may hold different numbers of microbatches and tokens, so a mean of sub-microbatch
means, or a division by the local M, would be a different objective. The runtime therefore scales
every loss sub-microbatch by a weight computed from the plan's global denominators
(`BatchTotals`) and the microbatch's token count (from the data, before the sub-microbatch's
backward, which may precede the forward of the microbatch's other loss sub-microbatches):

    weight(mb) = G / (M_global * max(tokens(mb), 1))     per microbatch (Megatron's default)
    weight     = G / max(T_global, 1)                     per token

where G is the factor undoing the gradient reduction's own division: D when the reduction
averages over the D replicas (Megatron's DDP unless the model config has
`calculate_per_token_loss`), 1 when it sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dip.schedule.engine import PlanError
from megatron_dip.schedule.ir import BatchTotals, Plan, StageId

from .checks import unwrap_chunk


@dataclass(frozen=True)
class LossConfig:
    """How the loss is normalised (see the module docstring).

    `per_token`: Megatron's `calculate_per_token_loss`. `reduction_averages`: whether the
    data-parallel gradient reduction divides by the number of replicas (None: decided by the
    executor from the DDP wrappers; without data parallelism it does not matter).
    `report_name`: key of each microbatch's loss report, as Megatron's training loop expects.
    """

    per_token: bool = False
    reduction_averages: bool | None = None
    report_name: str = "lm loss"


def microbatch_mean_scale(num_microbatches: int, microbatch_tokens: float) -> float:
    """1 / (M * max(tokens, 1)): Megatron's per-microbatch mean of a loss sum over `tokens`."""
    if num_microbatches < 1:
        raise ValueError(f"plan totals name {num_microbatches} microbatches")
    return 1.0 / (num_microbatches * max(microbatch_tokens, 1))


def per_token_scale(num_loss_tokens: float) -> float:
    """1 / max(T, 1): Megatron-LM's `calculate_per_token_loss`, the summed loss over the global
    batch's `num_loss_tokens` loss tokens."""
    return 1.0 / max(num_loss_tokens, 1)


def megatron_loss_func(
    num_tokens: torch.Tensor, report_name: str, loss_sum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss function the stock path hands Megatron-Core's schedules: (loss_sum, num_tokens,
    {report_name: tensor([loss_sum, num_tokens])}), which Megatron normalises itself (module
    docstring); the report is the one DIP's `LossTracker.reports` gives."""
    report = torch.stack([loss_sum.detach().double(), num_tokens.double()])
    return loss_sum, num_tokens.to(torch.int), {report_name: report}


def loss_weight(
    *,
    totals: BatchTotals,
    microbatch_tokens: int,
    per_token: bool,
    reduction_averages: bool,
) -> float:
    """The factor a loss sum of one microbatch is multiplied by before its backward."""
    undo = float(totals.data_parallel_size) if reduction_averages else 1.0
    if per_token:
        return undo * per_token_scale(totals.num_loss_tokens)
    return undo * microbatch_mean_scale(totals.num_microbatches, microbatch_tokens)


def reduction_averages(
    config: LossConfig, ddp_chunks: Iterable[torch.nn.Module], totals: BatchTotals
) -> bool:
    """Whether the data-parallel gradient reduction averages over the replicas.

    From `config` when set; else from the DDP wrappers (Megatron's DDP sums when the model
    config computes per-token losses and averages otherwise), checking that they reduce over
    as many replicas as the plan was made for. Without DDP the plan must be for one replica.
    """
    if config.reduction_averages is not None:
        return config.reduction_averages
    ddp = list(ddp_chunks)
    if not ddp:
        if totals.data_parallel_size != 1:
            raise ValueError(
                f"plan is for {totals.data_parallel_size} data-parallel replicas but the chunks "
                "are not DDP-wrapped: set LossConfig.reduction_averages to say how gradients "
                "are reduced"
            )
        return True
    sizes = {c.dp_cp_group.size() for c in ddp}
    if sizes != {totals.data_parallel_size}:
        raise PlanError(
            f"plan is for {totals.data_parallel_size} data-parallel replicas, the DDP wrappers "
            f"reduce over {sorted(sizes)}"
        )
    per_token = {bool(unwrap_chunk(c).config.calculate_per_token_loss) for c in ddp}
    if len(per_token) != 1:
        raise ValueError("chunks disagree on calculate_per_token_loss")
    return not per_token.pop()


def loss_module_of(plan: Plan) -> str:
    """The module computing the loss: the one with sub-microbatches that feeds no other."""
    producers = {d.producer.module for d in plan.dependencies}
    working = {s.module for s in plan.submicrobatches}
    sinks = [m.name for m in plan.placement.modules if m.name in working - producers]
    if len(sinks) != 1:
        raise PlanError(f"plan {plan.name!r}: cannot tell the loss module among {sinks}")
    return sinks[0]


class LossTracker:
    """Weights the loss sub-microbatches of one rank and collects Megatron-style reports.

    `batches` (a `data.BatchSource`) counts each loss sub-microbatch's loss tokens, so a
    microbatch's denominator is known at its first loss sub-microbatch (see the module
    docstring); the count each chunk reports is checked against it.
    """

    def __init__(
        self, *, plan: Plan, batches: Any, config: LossConfig, reduction_averages: bool
    ) -> None:
        self.plan, self.batches, self.config = plan, batches, config
        self.averages = reduction_averages
        self.module = loss_module_of(plan)
        self.objective = 0.0
        self._tokens: dict[int, int] = {}
        self._sums: dict[int, list] = {}

    def weighted(
        self, stage: StageId, outputs: Mapping[str, torch.Tensor], *, where: str
    ) -> torch.Tensor:
        """The weighted loss to differentiate for `stage`'s chunk outputs; records the report."""
        if stage.module != self.module:
            raise PlanError(f"{where}: {stage} returned a loss, the loss module is {self.module}")
        loss, tokens = outputs["loss"], int(outputs["num_tokens"])
        expected = self.batches.loss_tokens(stage.work)
        if tokens != expected:
            raise ValueError(
                f"{where}: {stage} computed its loss over {tokens} tokens, the batch source "
                f"counts {expected}"
            )
        total = self._sums.setdefault(stage.microbatch, [0.0, 0])
        total[0] = total[0] + loss.detach().double()
        total[1] += tokens
        weight = self.weight(stage.microbatch)
        undo = self.plan.totals.data_parallel_size if self.averages else 1
        self.objective += float(loss.detach()) * weight / undo
        return loss * weight

    def weight(self, microbatch: int) -> float:
        """`loss_weight` of `microbatch` (its token count summed over its loss sub-batches)."""
        if not self.config.per_token and microbatch not in self._tokens:
            works = [
                s.work
                for s in self.plan.submicrobatches
                if s.module == self.module and s.microbatch == microbatch
            ]
            self._tokens[microbatch] = sum(self.batches.loss_tokens(w) for w in works)
        return loss_weight(
            totals=self.plan.totals,
            microbatch_tokens=self._tokens.get(microbatch, 0),
            per_token=self.config.per_token,
            reduction_averages=self.averages,
        )

    def reports(self) -> list[dict[str, torch.Tensor]]:
        """{report_name: tensor([loss_sum, num_tokens])} per microbatch, in microbatch order."""
        out = []
        for _, (loss_sum, tokens) in sorted(self._sums.items()):
            # On the loss's device (Megatron reduces its reports there: NCCL on a GPU).
            total = torch.as_tensor(loss_sum, dtype=torch.float64)
            report = torch.stack([total, total.new_tensor(tokens)])
            out.append({self.config.report_name: report})
        return out
