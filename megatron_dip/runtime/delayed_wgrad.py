"""Layers that compute their own weight gradients later: Transformer Engine's delayed wgrad.

Transformer Engine's linear layers (Megatron-Core's `TELinear`, `TELayerNormColumnParallelLinear`,
... built with `TransformerConfig.delay_wgrad_compute`, TE >= 2.3) split their backward
themselves: the autograd backward computes the input gradient (and a fused norm's gradients)
and queues the weight GEMM in the layer's `wgrad_store`; the layer's `backward_dw()` pops the
oldest queued GEMM, sets the weight (and bias) gradient and calls the hooks Megatron's DDP
registered for it (`register_wgrad_accumulation_and_reduce_hooks`, where `main_grad`
accumulates). Transformer Engine marks the parameters it handles so with
`skip_backward_post_hook`, and Megatron's DDP (`DistributedDataParallelConfig.delay_wgrad_compute`)
then hooks the module instead of the parameter's gradient accumulator.

A split backward (`backward_split`) uses exactly that instead of re-running the layer's
Python autograd Function in W (which would repeat the input GEMM and, with fused gradient
accumulation, add the weight gradient twice): for autograd such a parameter is done in B, where
its layer's backward queues the GEMM; W calls `backward_dw()` on every such layer of the
chunk. A fused backward calls it right after. Each stage's backward runs each layer once, so
the queues hold one GEMM per stage whose W is pending; `backward_dw` pops the oldest, which may
be another sub-microbatch's of the same chunk: the sum over the iteration is the same, every
stage's W comes before the chunk's reduction, and only which activations are freed first
differs.

Memory: Transformer Engine delays every layer's GEMM, row-parallel ones included, whose weight
gradients `backward_split` computes in B for Megatron's local layers (their full-width output
gradients would otherwise wait for W); the cost model's pending-W bytes
(`StageCost.weight_bytes`) price the local layers' split, so under TE a pending W holds more than
planned (not measured: no GPU has run this). Megatron's DDP must hook the layers
(`check_accumulated`): `backward_dw` assigns the gradient it pops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

#: Transformer Engine's mark on a parameter whose gradient its layer's `backward_dw` computes.
DELAYED_MARK = "skip_backward_post_hook"


def is_delayed(param: torch.Tensor) -> bool:
    """Whether `param`'s gradient comes from its layer's `backward_dw`, not from autograd."""
    return bool(getattr(param, DELAYED_MARK, False))


def delayed_modules(chunk: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The layers of `chunk` that own a trainable delayed parameter, in module order (a parent
    whose `backward_dw` only calls its children's owns none, so no layer is called twice)."""
    found = []
    for module in chunk.modules():
        owned = module.parameters(recurse=False)
        if any(p.requires_grad and is_delayed(p) for p in owned):
            if not callable(getattr(module, "backward_dw", None)):
                raise TypeError(
                    f"{type(module).__name__} marks parameters {DELAYED_MARK} but has no "
                    "backward_dw(): their weight gradients would never be computed"
                )
            found.append(module)
    return tuple(found)


def check_accumulated(wrapper: torch.nn.Module, modules: Sequence[torch.nn.Module]) -> None:
    """Refuse delayed layers whose gradients nothing would sum: `backward_dw` assigns each
    popped gradient (`.grad =`), and only the hooks Megatron's DDP puts on the layers when built
    with `delay_wgrad_compute` add it to `main_grad`; without them a chunk whose sub-microbatches
    each pop one would keep the last one's. `wrapper`: the chunk as the executor holds it."""
    if not modules:
        return
    ddp_config = getattr(wrapper, "ddp_config", None)
    if not getattr(ddp_config, "delay_wgrad_compute", False):
        names = sorted({type(m).__name__ for m in modules})
        raise ValueError(
            f"{len(modules)} layers ({', '.join(names)}) delay their weight gradients to "
            "backward_dw(), but their chunk is not wrapped in Megatron-Core's "
            "DistributedDataParallel with DistributedDataParallelConfig(delay_wgrad_compute="
            "True): their gradients would be overwritten instead of summed"
        )


def compute_delayed(modules: Iterable[torch.nn.Module]) -> None:
    """W of the delayed layers: each computes its oldest queued weight gradient."""
    for module in modules:
        module.backward_dw()
