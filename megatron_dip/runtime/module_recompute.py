"""Cheap module recomputation inside a chunk's layers (`MemoryPolicy.modules`), exactly.

Some saved tensors cost far less to recompute than their size: a norm's output (the input that
linear_qkv, linear_fc1 or a DiT's modulation saves) and the MLP activation's output (fc2's
input; for SwiGLU also the SiLU output and the offset linear half the product keeps). While a
chunk runs under `recomputed_modules`, in every layer that keeps its activations (a block
recomputation's checkpointed layers are `LayerGroup`s and keep their own hooks):

* "layernorm": each direct child of the layer that is a norm (Megatron's `input_layernorm`,
  `pre_mlp_layernorm`; a DiT layer's `norm1`, `cross_norm`, `norm2`) runs under a non-reentrant
  checkpoint, so it keeps only its input (the residual stream) and recomputes its statistics in
  backward, as Megatron's `recompute_modules=["layernorm"]` (`CheckpointWithoutOutput`) does;
* "mlp_act": the layer's Megatron `MLP` runs its activation (after fc1's bias, Megatron's
  unfused path) under the same checkpoint, keeping only fc1's output (Megatron's "moe_act" for
  experts; it has no switch for a dense MLP).

The checkpointed call's output is a fresh tensor that the next operator saves. A
saved-tensor pack hook recognises it (same storage, shape and strides, while it is alive) and
saves a `Recipe` instead: the function and its input, which the checkpoint keeps anyway; the
unpack hook recomputes the output (the same kernel on the same input: the same bits). So the
output's memory is freed after the forward.

Saved-tensor hooks do not nest (the innermost wins), so these hooks hand every packed value on
to the hooks that were active when they were entered (the split backward's `SavedStore`, the
memory probes), a `Recipe` as an opaque object: a store keeps or frees it like a tensor (its
`tensors()` are what it holds), a probe that counts tensors sees its input where the checkpoint
saved it. Offload's hooks would move the recipes' inputs too: `MemoryPolicy.check` refuses the
combination.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


class Recipe:
    """A saved tensor left out of memory: `fn(input)` recomputes it (no grad)."""

    __slots__ = ("fn", "input")

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], input: torch.Tensor) -> None:
        self.fn, self.input = fn, input

    def tensors(self) -> Iterator[torch.Tensor]:
        """What the recipe holds."""
        yield self.input

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            return self.fn(self.input)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` views the same elements as `a` (the strides of size-1 dimensions do not
    matter: a consumer's `view` may restride them)."""
    strides = [(x, y) for x, y, n in zip(a.stride(), b.stride(), a.shape) if n != 1]
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.dtype == b.dtype
        and all(x == y for x, y in strides)
    )


class _Recipes:
    """The outputs of the checkpointed calls of one chunk forward, by data pointer."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[weakref.ref, Recipe]] = {}

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`fn(x)` keeping only `x`; its output registered for the pack hook."""
        if not torch.is_grad_enabled():
            return fn(x)
        out = checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)
        self.made[out.data_ptr()] = (weakref.ref(out), Recipe(fn, x))
        return out

    def match(self, t: torch.Tensor) -> Recipe | None:
        """The recipe of `t` when it is a registered output still alive."""
        if not isinstance(t, torch.Tensor):
            return None
        found = self.made.get(t.data_ptr())
        if found is None:
            return None
        out = found[0]()
        return found[1] if out is not None and _same_view(out, t) else None


def _is_norm(module: torch.nn.Module) -> bool:
    """Torch's, Megatron's, Transformer Engine's and our norms (`SequenceParallelNorm`)."""
    return type(module).__name__.endswith("Norm")


def _mlp_activation(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Megatron `MLP.forward`'s unfused activation of fc1's (biased) output."""
    config = mlp.config
    if not config.gated_linear_unit:
        return mlp.activation_func(x)
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    if (val := config.activation_func_clamp_value) is not None:
        x_glu = x_glu.clamp(min=None, max=val)
        x_linear = x_linear.clamp(min=-val, max=val)
    return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)


def _mlp_forward(mlp: torch.nn.Module, recipes: _Recipes, hidden_states, per_token_scale=None, **_):
    """Megatron `MLP.forward` (unfused activation) with the activation under `recipes`."""
    if per_token_scale is not None:
        raise ValueError("mlp_act recomputation: per-token scales (experts) are not supported")
    intermediate, bias = mlp.linear_fc1(hidden_states)
    if bias is not None:
        intermediate = intermediate + bias
    out = recipes.run(functools.partial(_mlp_activation, mlp), intermediate)
    return mlp.linear_fc2(out)


def _check_mlp(mlp: torch.nn.Module, policy_label: str) -> None:
    config = mlp.config
    if config.use_te_activation_func or config.bias_activation_fusion:
        raise ValueError(
            f"memory policy {policy_label}: mlp_act recomputation needs Megatron's unfused MLP "
            "activation (no bias_activation_fusion, no use_te_activation_func)"
        )


def _patch_targets(
    layers: Sequence[torch.nn.Module], modules: Sequence[str], label: str
) -> list[tuple[torch.nn.Module, str]]:
    """(module, what) to wrap: the norms and MLPs of the layers that keep their activations."""
    from megatron.core.transformer.mlp import MLP

    targets = []
    for layer in layers:
        if getattr(layer, "members", None) is not None:  # `recompute.LayerGroup`: checkpointed
            continue
        for _, child in layer.named_children():
            if "layernorm" in modules and _is_norm(child):
                targets.append((child, "norm"))
            elif "mlp_act" in modules and isinstance(child, MLP):
                _check_mlp(child, label)
                targets.append((child, "mlp"))
    return targets


@contextlib.contextmanager
def recomputed_modules(
    chunk: torch.nn.Module, modules: Sequence[str], label: str = ""
) -> Iterator[_Recipes]:
    """Run `chunk` (its `layers`) with `modules` recomputed (module docstring) while inside."""
    recipes = _Recipes()
    layers = list(getattr(chunk, "layers", ()))
    targets = _patch_targets(layers, modules, label)
    for module, what in targets:
        if what == "norm":
            own = type(module).forward.__get__(module)
            module.forward = functools.partial(recipes.run, own)
        else:
            module.forward = functools.partial(_mlp_forward, module, recipes)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    hooks = torch.autograd.graph.saved_tensors_hooks(
        functools.partial(_pack, recipes, outer), functools.partial(_unpack, outer)
    )
    try:
        with hooks:
            yield recipes
    finally:
        recipes.made.clear()
        for module, _ in targets:
            del module.forward  # back to the class's forward


def _pack(recipes: _Recipes, outer, t: torch.Tensor) -> Any:
    recipe = recipes.match(t)
    value = recipe if recipe is not None else t
    return outer[0](value) if outer is not None else value


def _unpack(outer, packed: Any) -> torch.Tensor:
    value = outer[1](packed) if outer is not None else packed
    return value() if isinstance(value, Recipe) else value
