"""The DiT layer, built from Megatron-Core attention and MLP modules (a torch building block).

PixArt-style: adaptive LayerNorm modulated by the clip's timestep embedding (shift, scale and gate
for attention and MLP), self-attention within each clip, cross-attention of every clip token to
its own caption's tokens, gated MLP. `modalities/dit.py` builds chunks of these layers; the
profiler times them. Under sequence parallelism only `hidden` (and `token_clip`) is this rank's
sequence shard; `temb` and `cond` are replicated across the tensor-parallel ranks, and the
cross-attention key/value projection of `cond` runs without sequence parallelism.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch.nn import functional

from megatron_dip.parallel import sequence_parallel_in_effect

from .attention import mask_type
from .common import ModelGroups, build_norm, without_sequence_parallel


@dataclass(frozen=True)
class DitLayerSpecs:
    """Megatron module specs of one DiT layer's attention and MLP parts (unfused norms)."""

    self_attention: Any
    cross_attention: Any
    mlp: Any


def dit_layer_specs(backend, *, tp_group: torch.distributed.ProcessGroup) -> DitLayerSpecs:
    """Self-attention, cross-attention and MLP specs from the backend's linear/attention modules.

    Megatron's CrossAttention builds linear_q/linear_kv without a tensor-parallel group (they
    would fall back to `parallel_state`'s), so the group is bound into their builders here.
    Under sequence parallelism linear_kv is built without it: its input "cond" is replicated
    across the tensor-parallel ranks, not a sequence shard.
    """
    # Packed sequences (THD): within each clip, and clip -> its caption; never a dense mask.
    packed = {"attn_mask_type": mask_type(causal=False)}
    column_in_group = functools.partial(backend.column_linear, tp_group=tp_group)
    kv_in_group = functools.partial(
        _column_without_sequence_parallel, column=backend.column_linear, tp_group=tp_group
    )
    return DitLayerSpecs(
        self_attention=ModuleSpec(
            module=SelfAttention,
            params=packed,
            submodules=SelfAttentionSubmodules(
                linear_qkv=backend.column_linear,
                core_attention=backend.core_attention,
                linear_proj=backend.row_linear,
                q_layernorm=IdentityOp,
                k_layernorm=IdentityOp,
            ),
        ),
        cross_attention=ModuleSpec(
            module=CrossAttention,
            params=packed,
            submodules=CrossAttentionSubmodules(
                linear_q=column_in_group,
                linear_kv=kv_in_group,
                core_attention=backend.core_attention,
                linear_proj=backend.row_linear,
            ),
        ),
        mlp=ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(
                linear_fc1=backend.column_linear, linear_fc2=backend.row_linear
            ),
        ),
    )


def _column_without_sequence_parallel(*args, column, tp_group, config, **kwargs):
    return column(*args, config=without_sequence_parallel(config), tp_group=tp_group, **kwargs)


def _with_bias(output_and_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    out, bias = output_and_bias
    return out if bias is None else out + bias


class DitLayer(MegatronModule):
    """One DiT layer; `layer_number` is the 1-based global layer index."""

    def __init__(
        self, *, config, backend, specs: DitLayerSpecs, layer_number: int, groups: ModelGroups
    ) -> None:
        super().__init__(config=config)
        hidden = config.hidden_size
        collection = groups.collection()
        self.layer_number = layer_number
        self.norm1 = torch.nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.self_attention = build_module(
            specs.self_attention,
            config=config,
            layer_number=layer_number,
            pg_collection=collection,
        )
        self.cross_norm = build_norm(backend, config, hidden)
        self.cross_attention = build_module(
            specs.cross_attention,
            config=config,
            layer_number=layer_number,
            pg_collection=collection,
        )
        self.norm2 = torch.nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = build_module(specs.mlp, config=config, tp_group=groups.tp)
        # Replicated across tensor-parallel ranks: its input (the clip's temb) is not sharded.
        self.modulation = torch.nn.Linear(hidden, 6 * hidden)
        self.tp_group = groups.tp
        self.sequence_parallel = sequence_parallel_in_effect(
            config.sequence_parallel, groups.tp_size
        )

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        temb: torch.Tensor,
        token_clip: torch.Tensor,
        cond: torch.Tensor,
        self_attention: dict,
        cross_attention: dict,
        rotary: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [P, 1, H], temb [clips, H], token_clip [P], cond [C, 1, H] -> [P, 1, H].

        `self_attention` / `cross_attention`: the keyword arguments of the two attention blocks
        (their `PackedSeqParams`, `models.attention`); cond holds the clips' caption rows in clip
        order, as the cross-attention's packed parameters segment them.

        Under sequence parallelism hidden and token_clip are this rank's shard (P / TP tokens);
        temb and cond are replicated. The modulation then sees only this shard's tokens: its
        output's gradient is summed over the tensor-parallel group (forward identity), so the
        modulation weights and temb get the complete gradient on every rank.
        """
        mod = self.modulation(functional.silu(temb))
        if self.sequence_parallel:
            mod = tensor_parallel.copy_to_tensor_model_parallel_region(mod, group=self.tp_group)
        mod = mod[token_clip][:, None, :]
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)
        x = self.norm1(hidden) * (1 + scale1) + shift1
        x = _with_bias(self.self_attention(x, rotary_pos_emb=rotary, **self_attention))
        hidden = hidden + gate1 * x
        x = _with_bias(
            self.cross_attention(self.cross_norm(hidden), key_value_states=cond, **cross_attention)
        )
        hidden = hidden + x
        x = self.norm2(hidden) * (1 + scale2) + shift2
        return hidden + gate2 * _with_bias(self.mlp(x))
