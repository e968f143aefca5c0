"""Optimizer state as dist_checkpointing ShardedTensors, in the weights' global coordinates.

Keys are Megatron-Core's model-space names, `optimizer.state.<name>.<parameter key>` with name
exp_avg, exp_avg_sq and fp32_param (the fp32 master copy of a 16-bit parameter; a float32
parameter is its own master), and every tensor lies where its parameter does (`models.sharded`):

* a non-distributed optimizer (`PlainAdamW`, Megatron's fp32 / mixed-precision optimizers) holds
  each state tensor in the parameter's local shape: saved like the weight (one copy per data
  parallel replica is written);
* Megatron's `DistributedOptimizer` holds, on each data-parallel rank, a contiguous range of every
  parameter's flattened shard: saved as the hyper-rectangles that range covers, so each rank
  writes exactly the elements it owns, with no gather.

Either kind loads what the other saved, at any TP, PP or DP: each rank asks for its own tensors
(the local shape, or its flat range) and dist_checkpointing reads the overlapping parts. Adam's
step count is one number in the common state.

Megatron's own `DistributedOptimizer.sharded_state_dict` is not used: in megatron-core 0.16.1 its
model-space format ('fully_sharded_model_space') builds ShardedTensors with `flattened_range`,
which that release refuses; 'fully_reshardable' gathers every replica's state onto each rank
(the full-tensor gather this format avoids); 'dp_reshardable' stores the flat buffers and
reshards over DP only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_dip.models.sharded import ParamLayout

from ..assembly.optim import (
    distributed_parts,
    group_of,
    optimizer_pairs,
    set_step,
    uses_group_steps,
)

logger = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "fp32_param"


def state_key(name: str, param_key: str) -> str:
    """The checkpoint key of optimizer state `name` of the parameter keyed `param_key`."""
    return f"optimizer.state.{name}.{param_key}"


@dataclass
class _Held:
    """One parameter's optimizer state on this rank."""

    param: torch.nn.Parameter
    main: torch.Tensor  # the tensor the torch optimizer updates
    inner: torch.optim.Optimizer
    flat_start: int | None  # distributed: start of this rank's range in the flat shard

    def state(self, *, create: bool) -> dict:
        """The torch optimizer's state of `main`; with `create`, zero moments where none exist
        yet (to load into)."""
        state = self.inner.state.get(self.main, {})
        if create and not all(k in state for k in MOMENTS):
            state = self.inner.state.setdefault(self.main, {})
            for k in MOMENTS:
                state[k] = torch.zeros_like(self.main)
            state.setdefault("step", torch.tensor(0.0))
        return state

    def tensors(self, layout: ParamLayout, values: dict[str, torch.Tensor], *, dp_rank: int):
        """ShardedTensors of `values` (name -> tensor shaped like `main`)."""
        out = {}
        for name, value in values.items():
            key = state_key(name, layout.key)
            if self.flat_start is None:
                found = layout.tensors(key, value, data_parallel=dp_rank)
            else:
                found = layout.flat_tensors(key, value.view(-1), start=self.flat_start)
            if found:
                out[name] = found
        return out


def _held(optimizer) -> list[_Held]:
    """Every (parameter, main tensor) this rank's optimizer updates."""
    parts = distributed_parts(optimizer)
    if not parts:
        return [_Held(p, main, inner, None) for p, main, inner in optimizer_pairs(optimizer)]
    out = []
    for opt in parts:
        for p, (gi, go) in opt.model_param_group_index_map.items():
            r = opt._get_model_param_range_map(p)["param"]
            main = opt.optimizer.param_groups[gi]["params"][go]
            out.append(_Held(p, main, opt.optimizer, r.start))
    return out


def _values(held: _Held, state: dict) -> dict[str, torch.Tensor]:
    values = {k: state[k] for k in MOMENTS}
    if held.param.dtype != torch.float32 and held.main is not held.param:
        values[MASTER] = held.main
    return values


def _step_of(held: _Held, state: dict) -> int | None:
    if uses_group_steps(held.inner):
        step = group_of(held.inner, held.main).get("step")
    else:
        step = state.get("step")
    return None if step is None else int(step)


def sharded_state(optimizer, layouts: dict[int, ParamLayout], *, dp_rank: int) -> tuple:
    """(sharded state dict, common state) of this rank's optimizer state (module docstring).
    Empty before the optimizer's first step."""
    sharded, steps = {}, set()
    for held in _held(optimizer):
        state = held.state(create=False)
        if not all(k in state for k in MOMENTS):
            continue  # never stepped: nothing to save
        layout = layouts[id(held.param)]
        sharded[layout.key] = held.tensors(layout, _values(held, state), dp_rank=dp_rank)
        steps.add(_step_of(held, state))
    steps.discard(None)
    if len(steps) > 1:
        logger.warning("optimizer steps differ between parameters (%s): saving the largest", steps)
    return sharded, {"step": max(steps) if steps else None}


def load_request(
    optimizer, layouts: dict[int, ParamLayout], *, dp_rank: int, saved_keys: set[str]
) -> tuple[dict, bool, Callable[[int], None]]:
    """(sharded state dict whose tensors are this rank's optimizer state, to be filled in place;
    whether it includes the fp32 masters; a function that sets Adam's step once loaded).
    Masters are asked for only where the checkpoint has them (a 16-bit run saved it)."""
    request, with_masters, helds = {}, False, _held(optimizer)
    for held in helds:
        layout = layouts[id(held.param)]
        values = _values(held, held.state(create=True))
        if MASTER in values and state_key(MASTER, layout.key) not in saved_keys:
            del values[MASTER]
        with_masters |= MASTER in values
        request[layout.key] = held.tensors(layout, values, dp_rank=dp_rank)
    return request, with_masters, functools.partial(_set_steps, helds)


def _set_steps(helds: list[_Held], step: int) -> None:
    for held in helds:
        state = held.state(create=False)
        set_step(held.inner, group_of(held.inner, held.main), state, torch.tensor(step))
