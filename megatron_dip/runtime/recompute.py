"""Activation recomputation of one chunk on one sub-microbatch, as the plan's Forward says.

* `NONE`: the forward keeps its autograd graph (all activations).
* `FULL`: the whole chunk call runs under a non-reentrant `torch.utils.checkpoint`: the forward
  keeps only the chunk's inputs; the backward re-runs the chunk with grad and differentiates it.
* `BLOCK` N / `UNIFORM` N: Megatron's `--recompute-method block|uniform --recompute-num-layers N`
  inside the chunk: while it runs, its `layers` list is replaced by checkpointed groups (BLOCK:
  each of the first N layers on its own, the others as they are; UNIFORM: every N consecutive
  layers as one group), so each group keeps only its input and is recomputed in backward.
* `SELECTIVE`: Megatron's "selective" recomputation, the attention core only: while the chunk
  runs, the `core_attention` module of every Megatron attention block is wrapped in the same
  checkpoint, so what the attention kernel keeps for backward (its log-sum-exp; SDPA per
  segment also every segment's output) is recomputed in backward instead. Megatron's
  own switch (`Attention.checkpoint_core_attention`, fixed at construction from the config) is
  not used because it cannot vary per sub-microbatch and its `tensor_parallel.checkpoint` reads
  CUDA RNG states, which do not exist without a GPU. A chunk that defines
  `recompute_context(policy)` (a context manager) takes over instead; a chunk without attention
  blocks (e.g. a toy MLP) has nothing to recompute selectively.

Offload (`MemoryPolicy.offload` K, with NONE or BLOCK N): `run_policy` runs the chunk with its
layers [N, N + K) under `offload.ActivationOffload`'s saved-tensor hooks and returns the record,
whose `prefetch` the executor calls before the chunk's backward.

Module recomputation (`MemoryPolicy.modules`, with NONE, SELECTIVE or BLOCK N): `run_policy` runs
the chunk, after the method's switches, under `module_recompute.recomputed_modules` (the norms'
and the MLP activation's outputs of the layers that keep their activations are recomputed).

Random state. `preserve_rng_state` restores the torch CPU/CUDA generators before recomputing;
`megatron_rng_context` also restores the states of Megatron's model-parallel RNG tracker (used
by dropout under tensor parallelism), as Megatron's own `CheckpointFunction` does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from megatron_dip.runtime.checks import chunks_device
from megatron_dip.runtime.module_recompute import recomputed_modules
from megatron_dip.runtime.offload import ActivationOffload, offloaded_layers
from megatron_dip.schedule.ir import MemoryPolicy, Recompute


def _tracker():
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        return None
    if not getattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return mrandom.get_cuda_rng_tracker()


class _TrackerStates:
    """Sets the tracker's states of the forward while a recomputation runs. Re-enterable: a
    split backward (B, then W) recomputes a checkpoint once for each half."""

    def __init__(self, tracker, states) -> None:
        self.tracker, self.states, self.saved = tracker, states, None

    def __enter__(self) -> None:
        if self.tracker is not None and self.states:
            self.saved = self.tracker.get_states()
            self.tracker.set_states(self.states)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            self.tracker.set_states(self.saved)
            self.saved = None


def megatron_rng_context() -> tuple[contextlib.AbstractContextManager, Any]:
    """`context_fn` for `checkpoint`: recompute under the tracker states of the forward."""
    tracker = _tracker()
    states = tracker.get_states() if tracker is not None else None
    return contextlib.nullcontext(), _TrackerStates(tracker, states)


def checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` wrapped in a non-reentrant checkpoint (kwargs and non-tensor outputs allowed)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=megatron_rng_context,
            **kwargs,
        )

    return run


@contextlib.contextmanager
def selective_attention(chunk: torch.nn.Module) -> Iterator[int]:
    """Checkpoint every `core_attention` submodule of `chunk` while inside; yields their count."""
    cores = [
        m.core_attention
        for m in chunk.modules()
        if isinstance(getattr(m, "core_attention", None), torch.nn.Module)
    ]
    for core in cores:
        core.forward = checkpointed(core.forward)
    try:
        yield len(cores)
    finally:
        for core in cores:
            del core.forward  # back to the class's forward


class LayerGroup(torch.nn.Module):
    """Consecutive layers of a chunk run as one checkpointed call: the group keeps only its
    input and recomputes its layers in backward. Layers returning a tuple (Megatron's
    `TransformerLayer`: hidden, context) pass its first element on, as the chunk's loop does.
    `member_kwargs`, when given, adds each member's own keyword arguments (e.g. a layer's
    attention scope where layers differ: windowed and full attention)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList(layers)
        self._run = checkpointed(self._forward)

    def _forward(
        self, hidden: Any, *args: Any, member_kwargs: Sequence[dict] | None = None, **kwargs: Any
    ) -> Any:
        out = hidden
        for i, layer in enumerate(self.members):
            own = member_kwargs[i] if member_kwargs is not None else {}
            out = layer(hidden, *args, **kwargs, **own)
            hidden = out[0] if isinstance(out, tuple) else out
        return out

    @property
    def config(self) -> Any:
        """The members' Megatron config (what the chunk's loop may read of a layer)."""
        return self.members[0].config

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run(hidden, *args, **kwargs)


def layer_groups(layers: Sequence[torch.nn.Module], mode: Recompute, n: int) -> list:
    """The chunk's layers as BLOCK (first `n` checkpointed one by one) or UNIFORM (groups of
    `n`) lists of modules to run in order."""
    if mode is Recompute.BLOCK:
        return [LayerGroup([layer]) for layer in layers[:n]] + list(layers[n:])
    return [LayerGroup(list(layers[k : k + n])) for k in range(0, len(layers), n)]


@contextlib.contextmanager
def grouped_layers(chunk: torch.nn.Module, mode: Recompute, n: int) -> Iterator[None]:
    """`chunk.layers` replaced by `layer_groups` while inside (the same parameters)."""
    original = chunk.layers
    chunk.layers = torch.nn.ModuleList(layer_groups(list(original), mode, n))
    try:
        yield
    finally:
        chunk.layers = original


def run_chunk(
    chunk: torch.nn.Module,
    mode: Recompute,
    call: Callable[[], Any],
    inputs: Any,
    batch: Any,
    layers: int = 0,
) -> Any:
    """Run `call(inputs, batch)`-style chunk forward under recompute `mode` (`layers`: N of
    BLOCK / UNIFORM).

    `chunk` is the unwrapped model chunk (for the selective and layer switches), `call` the
    callable that runs it (e.g. the DDP wrapper). A chunk that defines
    `recompute_context(policy)` (emulated chunks) takes over every mode but FULL.
    """
    if mode is Recompute.NONE or not torch.is_grad_enabled():
        return call(inputs=inputs, batch=batch)
    if mode is Recompute.FULL:
        return checkpointed(call)(inputs=inputs, batch=batch)
    own = getattr(chunk, "recompute_context", None)
    if callable(own):
        context = own(MemoryPolicy(mode, layers))
    elif mode.takes_layers:
        context = grouped_layers(chunk, mode, layers)
    else:
        context = selective_attention(chunk)
    with context:
        return call(inputs=inputs, batch=batch)


def run_policy(
    chunk: torch.nn.Module,
    policy: MemoryPolicy,
    call: Callable[[], Any],
    inputs: Any,
    batch: Any,
) -> tuple[Any, ActivationOffload | None]:
    """`run_chunk` under a whole memory policy: (outputs, the offload record, None when nothing
    is offloaded). Emulated chunks (`recompute_context`) get the policy and sleep its time."""
    policy = policy.check()
    own = getattr(chunk, "recompute_context", None)
    if callable(own) and torch.is_grad_enabled() and (policy.offload or policy.modules):
        with own(policy):
            return call(inputs=inputs, batch=batch), None
    if policy.modules and torch.is_grad_enabled():
        return _run_with_modules(chunk, policy, call, inputs, batch), None
    if not policy.offload or not torch.is_grad_enabled() or callable(own):
        return run_chunk(chunk, policy.method, call, inputs, batch, policy.layers), None
    record = ActivationOffload.for_device(chunks_device([chunk]))
    with contextlib.ExitStack() as stack:
        if policy.method is Recompute.BLOCK:
            stack.enter_context(grouped_layers(chunk, policy.method, policy.layers))
        start = policy.offload_start
        stack.enter_context(offloaded_layers(chunk, start, policy.offload, record))
        return call(inputs=inputs, batch=batch), record


def _run_with_modules(
    chunk: torch.nn.Module, policy: MemoryPolicy, call: Callable[[], Any], inputs: Any, batch: Any
) -> Any:
    """The chunk under NONE, SELECTIVE or BLOCK N (`check` refuses the rest) with its
    `policy.modules` recomputed in the layers that keep their activations."""
    with contextlib.ExitStack() as stack:
        if policy.method is Recompute.BLOCK:
            stack.enter_context(grouped_layers(chunk, policy.method, policy.layers))
        elif policy.method is Recompute.SELECTIVE:
            stack.enter_context(selective_attention(chunk))
        stack.enter_context(recomputed_modules(chunk, policy.modules, policy.label))
        return call(inputs=inputs, batch=batch)
