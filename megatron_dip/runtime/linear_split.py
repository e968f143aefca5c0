"""Megatron's local linear layers in a split backward: the input gradient in B, the weight's in W.

Megatron-Core's local `ColumnParallelLinear` / `RowParallelLinear` run one Python autograd
Function (`LinearWithGradAccumulationAndAsyncCommunication`) whose backward computes the input
and the weight gradients together: the engine cannot ask it for one of them. Run as a weight
node of `backward_split`, B would compute the weight gradient and drop it, and W would compute
the input gradient (and repeat its tensor-parallel collective) to drop it: each half would pay
the other's GEMM. Megatron's own deferral is used instead: for B the node's context takes
Megatron's `grad_output_buffer` path (`wgrad_deferral_limit` 0, the gradient-accumulation-fusion
branch, which skips the weight GEMM and records the output gradient); W then computes what that
backward would have (`grad_output.t() @ total_input` after Megatron's own reshape, the input
gathered over the tensor-parallel group under sequence parallelism; the bias's column sum) and
hands each to its parameter's gradient accumulator through the autograd engine, so the hooks
there (Megatron's DDP: `main_grad` accumulation) fire as in a fused backward. The parameters'
Megatron attributes the fusion branch reads or writes (`main_grad`, `grad_added_to_main_grad`)
are left as they were. Transformer Engine's layers have the same split built in
(`delay_wgrad_compute`, `backward_dw`); they would take this module's place where TE is present
(not wired: no TE here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

MEGATRON_LINEAR = "LinearWithGradAccumulationAndAsyncCommunicationBackward"
_MISSING = object()


def deferrable(node: Node) -> bool:
    """Whether `node` is Megatron's linear whose weight (and bias) are accumulated directly."""
    if type(node).__name__ != MEGATRON_LINEAR:
        return False
    # One edge per tensor argument: input, weight, and the bias where there is one.
    edges = [fn for fn, _ in node.next_functions[1:3]]
    return all(type(fn).__name__ == "AccumulateGrad" for fn in edges) and len(edges) == (
        2 if node.use_bias else 1
    )


@dataclass
class DeferredLinears:
    """The Megatron linear nodes of one split stage whose weight gradients wait for W."""

    nodes: list[Node]
    buffers: list[list[torch.Tensor]] = field(default_factory=list)
    _saved: list[dict] = field(default_factory=list)

    def before_b(self) -> None:
        """Switch every node to Megatron's deferral for B (module docstring)."""
        for node in self.nodes:
            weight = node.next_functions[1][0].variable
            buffer: list[torch.Tensor] = []
            self.buffers.append(buffer)
            keep = {
                k: getattr(node, k)
                for k in (
                    "gradient_accumulation_fusion",
                    "grad_output_buffer",
                    "wgrad_deferral_limit",
                    "main_grad",
                )
            }
            keep["weight"] = {k: weight.__dict__.get(k, _MISSING) for k in _WEIGHT_ATTRS}
            self._saved.append(keep)
            weight.__dict__.pop("grad_added_to_main_grad", None)  # else a dummy gradient
            node.main_grad = getattr(weight, "main_grad", None)  # what the branch sets back
            node.gradient_accumulation_fusion = True
            node.grad_output_buffer = buffer
            node.wgrad_deferral_limit = 0

    def after_b(self) -> None:
        """Give the nodes and their weights back their own attributes."""
        for node, keep in zip(self.nodes, self._saved):
            weight = node.next_functions[1][0].variable
            for k, v in keep.pop("weight").items():
                if v is _MISSING:
                    weight.__dict__.pop(k, None)
                else:
                    setattr(weight, k, v)
            for k, v in keep.items():
                setattr(node, k, v)
        self._saved.clear()

    def tensors(self) -> list[torch.Tensor]:
        """The recorded output gradients."""
        return [g for b in self.buffers for g in b]

    def weight_gradients(self) -> None:
        """W: every node's weight (and bias) gradient, into its accumulators."""
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        with torch.no_grad():  # as inside the engine, where the layer's backward runs
            for node, buffer in zip(self.nodes, self.buffers):
                if buffer:
                    _node_gradients(node, buffer[0], edges, grads)
        self.nodes, self.buffers = [], []
        if edges:
            torch.autograd.backward(edges, grads)


_WEIGHT_ATTRS = ("main_grad", "grad_added_to_main_grad")


def _total_input(node: Node, saved: torch.Tensor) -> torch.Tensor:
    """The layer's input as its GEMM saw it: gathered over TP under sequence parallelism."""
    if not node.sequence_parallel:
        return saved
    from megatron.core.tensor_parallel.layers import dist_all_gather_func

    group = node.tp_group
    shape = [saved.shape[0] * group.size(), *saved.shape[1:]]
    out = torch.empty(shape, dtype=saved.dtype, device=saved.device)
    dist_all_gather_func(out, saved.contiguous(), group=group)
    return out


def _node_gradients(
    node: Node, grad_output: torch.Tensor, edges: list[GradientEdge], grads: list[torch.Tensor]
) -> None:
    """Megatron's weight and bias gradient of one linear (its backward's own arithmetic)."""
    from megatron.core.tensor_parallel.layers import prepare_input_tensors_for_wgrad_compute

    saved_input, _ = node.saved_tensors
    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(
        grad_output, _total_input(node, saved_input)
    )
    accumulators = [fn for fn, _ in node.next_functions[1:3]]  # weight, bias (`deferrable`)
    edges.append(GradientEdge(accumulators[0], 0))
    grads.append(grad_output.t().matmul(total_input))
    if node.use_bias:
        edges.append(GradientEdge(accumulators[1], 0))
        grads.append(grad_output.sum(dim=0))


def split_deferrable(groups: Sequence[tuple[list[Node], list[Node]]]) -> tuple[list, list[Node]]:
    """`groups` (of `backward_split.classify`) less the single-node groups of deferrable
    Megatron linears, and those nodes."""
    rest, linears = [], []
    for nodes, params in groups:
        if len(nodes) == 1 and deferrable(nodes[0]):
            linears.append(nodes[0])
        else:
            rest.append((nodes, params))
    return rest, linears
