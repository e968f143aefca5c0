"""What one iteration of the executor gives back (`IterationResult`; `executor.py` re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_dip.schedule.engine import ChannelFn


@dataclass
class IterationResult:
    """What one rank's program produced.

    `reports`: on the rank holding the loss module's last chunk, one dict per microbatch (in
    microbatch order) {report_name: tensor([loss_sum, num_tokens])}, as Megatron's loss
    functions report; empty elsewhere. `objective`: this rank's share of the normalised loss
    that was differentiated (sum of weight * loss_sum, weights of `loss.py` without the
    data-parallel factor), so the replicas' objectives sum to the global loss. `messages`:
    point-to-point messages posted. `grad_sync_started`: (instruction index after which it
    started, chunk) for every data-parallel reduction, -1 meaning before the first.
    `started` / `ended`: wall-clock seconds (`time.time()`) of `run()`; `seconds` its duration.
    `leftovers`: `Executor.leftovers()` at the end (empty: `run()` raises otherwise).
    `channel`: the transport's channel model (what a simulation of this iteration should use).
    `freed_bytes`: bytes of sent outputs whose data was freed before their backward
    (`sent_outputs.py`).
    """

    reports: list[dict[str, torch.Tensor]]
    objective: float
    seconds: float
    messages: int
    grad_sync_started: list[tuple[int, tuple[str, int]]] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    leftovers: dict[str, list[str]] = field(default_factory=dict)
    channel: ChannelFn | None = None
    freed_bytes: int = 0


__all__ = ["IterationResult"]
