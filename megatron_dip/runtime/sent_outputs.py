"""Sent outputs freed once their send completed, the autograd graph kept (Megatron's idea).

A chunk output sent to another rank is needed on this rank only for its backward, and there only
for its autograd node (`grad_fn`), not its data: the receiver holds the data. Megatron-Core frees
it (`schedules.deallocate_output_tensor`: `out.data` becomes a 1-element placeholder) and runs the
backward through the autograd engine directly (`schedules.custom_backward`), since
`torch.autograd.backward` refuses a gradient whose shape is not the output's. DIP's chunks are
few layers each, so one held output is a large share of what a chunk keeps: this module does the
same for the executor.

Safety. Replacing `.data` of a tensor autograd saved itself (a chunk output that its own later
operations used, e.g. a DiT's `temb`; or an input passed through) would corrupt the backward.
So the executor does not free the chunk's tensor: each output about to be sent is first handed
over through `handover` (an identity autograd function saving nothing), whose result is a fresh
tensor sharing the output's storage that only the executor references. Freeing it drops the
executor's reference; the storage itself is released when nothing else holds it (the usual case:
the last layer's residual sum), and stays, correctly, when the graph saved the original.

`SentOutputs` tracks, per forward stage, the remote messages not yet completed; when the last one
is waited for, the stage's outputs are freed (`release`). `backward` runs the engine on outputs
with the full-shape gradients, freed or not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch.autograd.variable import Variable

from megatron_dip.schedule.ir import MessageKey, StageId


class _Handover(torch.autograd.Function):
    """Identity in both directions; its output is a new tensor on the input's storage."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        del ctx
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        del ctx
        return grad


def freeable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a chunk output) can be handed over and freed after its send: it is in
    the autograd graph, owns its storage, and holds more than the placeholder's one element."""
    return tensor.requires_grad and tensor._base is None and tensor.numel() > 1


def handover(outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`outputs` with every freeable tensor replaced by its hand-over (module docstring)."""
    return {n: _Handover.apply(t) if freeable(t) else t for n, t in outputs.items()}


def release(outputs: Mapping[str, torch.Tensor]) -> int:
    """Replace the data of every freeable tensor of `outputs` by a 1-element placeholder (the
    autograd graph stays); returns the bytes the tensors no longer reference."""
    freed = 0
    for t in outputs.values():
        if freeable(t):
            freed += t.numel() * t.element_size()
            t.data = torch.empty((1,), device=t.device, dtype=t.dtype)
    return freed


def backward(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    *,
    inputs: Sequence[torch.Tensor] = (),
    keep_graph: bool = False,
) -> None:
    """`torch.autograd.backward(roots, grads, inputs=inputs, retain_graph=keep_graph)` without
    its shape check (a freed root's data is a placeholder; its gradient has the original shape,
    which its autograd node recorded). `inputs`: accumulate only these leaves' gradients (none:
    every leaf's), as a split backward's halves do (`backward_split.py`)."""
    if all(g is not None for g in grads):
        Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
            tensors=tuple(roots),
            grad_tensors=tuple(grads),
            keep_graph=keep_graph,
            create_graph=False,
            inputs=tuple(inputs),
            allow_unreachable=True,
            accumulate_grad=True,
        )
    else:  # an implicit gradient (a scalar loss): never a freed root
        torch.autograd.backward(
            list(roots), list(grads), inputs=list(inputs) or None, retain_graph=keep_graph
        )


class SentOutputs:
    """The remote messages of each forward stage on this rank that have not completed yet."""

    def __init__(self) -> None:
        self._pending: dict[StageId, set[MessageKey]] = {}

    def expect(self, stage: StageId, keys: Iterable[MessageKey]) -> None:
        """`stage`'s outputs travel in the remote messages `keys` (none: nothing to free)."""
        keys = set(keys)
        if keys:
            self._pending[stage] = keys

    def completed(self, keys: Iterable[MessageKey]) -> list[StageId]:
        """Mark `keys` completed; returns the stages whose every remote message now has."""
        done = []
        for key in keys:
            left = self._pending.get(key.producer)
            if left is None or key not in left:
                continue
            left.discard(key)
            if not left:
                del self._pending[key.producer]
                done.append(key.producer)
        return done

    def forget(self, stage: StageId) -> None:
        """`stage` ran its backward (its outputs are gone anyway)."""
        self._pending.pop(stage, None)


__all__ = ["SentOutputs", "backward", "freeable", "handover", "release"]
