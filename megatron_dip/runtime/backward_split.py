"""A chunk's backward in two halves: input gradients (B) now, weight gradients (W) later.

B differentiates the chunk's outputs with respect to its inputs only (`autograd.backward` with
`inputs=` the input leaves), keeping the autograd graph; W differentiates the same outputs with
the same output gradients with respect to the chunk's trainable parameters and frees the graph.
Each gradient is accumulated exactly once, by the same autograd operations as in the fused
backward, so B then W gives the fused backward's gradients bit for bit (fp64 tests), under every
recompute mode (non-reentrant checkpoints recompute again for W) and with Megatron's DDP hooks
(they fire as the parameters' gradients accumulate in W). Both halves run the autograd engine
as `sent_outputs.backward` does, so a chunk output freed after its send (a placeholder whose
gradient has the original shape) splits like any other.

What this costs: W traverses the graph a second time (the input-gradient kernels of the layers
between the loss and each weight run again), so on real hardware a split backward is slower than
the fused one unless the weight-gradient GEMMs are deferred inside the layers (Transformer
Engine's delayed weight-gradient path); the plan's timing is the cost model's, which prices
B and W as those kernels would (`planner/cost_model.py`).

A chunk without weight gradients (a frozen module) has no W: its B runs the whole backward and
keeps nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .sent_outputs import backward


@dataclass
class PendingWeight:
    """What a stage's W needs from its B: the outputs and their gradients (graph kept)."""

    roots: list[torch.Tensor]
    grads: list[torch.Tensor | None]


def input_leaves(inputs: Iterable[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The input tensors of a chunk that receive gradients (autograd leaves with grad)."""
    return [t for msg in inputs for t in msg.values() if t.requires_grad]


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    leaves: Sequence[torch.Tensor],
    *,
    keep_graph: bool,
) -> PendingWeight | None:
    """B: accumulate the gradients of `leaves` (the chunk's inputs). With `keep_graph` (a W
    follows) only those, keeping the graph for W; without, the whole backward (no W)."""
    if not roots:
        return None
    if not keep_graph:
        backward(roots, grads)
        return None
    if leaves:
        backward(roots, grads, inputs=leaves, keep_graph=True)
    return PendingWeight(list(roots), list(grads))


def backward_weight(pending: PendingWeight | None, params: Sequence[torch.nn.Parameter]) -> None:
    """W: accumulate the gradients of `params` and free the graph B kept."""
    if pending is None:
        return
    if params:
        backward(pending.roots, pending.grads, inputs=params)
    pending.roots.clear()
    pending.grads.clear()


def trainable_parameters(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters whose gradients a chunk's W accumulates."""
    return [p for p in chunk.parameters() if p.requires_grad]
