"""DiT chunks: latent patch embedding, timestep embedding, caption projection, adaLN-Zero layers
with self- and cross-attention built from Megatron-Core modules, final layer and flow-matching loss.

Each DiT layer (PixArt-style): adaptive LayerNorm modulated by the clip's timestep embedding
(shift, scale and gate for attention and MLP), self-attention within each clip (3-D rotary over
frame, row, column), cross-attention of every clip token to its own caption's tokens, gated MLP.
The conditioning travels with the activations: chunk 0 computes "temb" (per clip) and "cond"
(projected text encoding, padding removed) and every chunk passes them on, so their gradients
reach chunk 0's embedders and, through "cond", a trainable text encoder.
Under sequence parallelism only "hidden" is sharded along the sequence; "temb", "cond" and
"cond_index" stay replicated across the tensor-parallel ranks (each rank indexes the modulation
with its own tokens' clips; the cross-attention key/value projection of "cond" runs without
sequence parallelism), and every message gradient of them is complete on every rank.
Loss: rectified flow — the model predicts the velocity noise - x0 from x_t = (1-t) x0 + t noise;
per latent token the mean squared error over its p*p*C values, summed over real tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
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
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch.nn import functional

from .chunk import ModelChunk
from .common import (
    ModelGroups,
    build_norm,
    cached,
    rotary_table,
    segment_mask,
    sequence_slice,
    sinusoidal_embedding,
    without_sequence_parallel,
)
from .inputs import SubBatch
from .llm import Parts


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
    arbitrary = {"attn_mask_type": AttnMaskType.arbitrary}
    column_in_group = functools.partial(backend.column_linear, tp_group=tp_group)
    kv_in_group = functools.partial(
        _column_without_sequence_parallel, column=backend.column_linear, tp_group=tp_group
    )
    return DitLayerSpecs(
        self_attention=ModuleSpec(
            module=SelfAttention,
            params=arbitrary,
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
            params=arbitrary,
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
        self.sequence_parallel = bool(config.sequence_parallel) and groups.tp_size > 1

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        temb: torch.Tensor,
        token_clip: torch.Tensor,
        cond: torch.Tensor,
        self_mask: torch.Tensor,
        cross_mask: torch.Tensor,
        rotary: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [P, 1, H], temb [clips, H], token_clip [P], cond [C, 1, H] -> [P, 1, H].

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
        x = _with_bias(self.self_attention(x, attention_mask=self_mask, rotary_pos_emb=rotary))
        hidden = hidden + gate1 * x
        x = _with_bias(
            self.cross_attention(
                self.cross_norm(hidden), attention_mask=cross_mask, key_value_states=cond
            )
        )
        hidden = hidden + x
        x = self.norm2(hidden) * (1 + scale2) + shift2
        return hidden + gate2 * _with_bias(self.mlp(x))


class DitChunk(ModelChunk):
    """A chunk of a diffusion transformer conditioned by a text encoder."""

    message_names = ("hidden", "temb", "cond", "cond_index")

    def zero_init_prefixes(self) -> tuple[str, ...]:
        if not self.model_config.adaln_zero:
            return ()
        layers = tuple(f"layers.{k}.modulation." for k in range(len(self.layers)))
        return (*layers, "post.final_modulation.", "post.final_linear.")

    def _build_layers(self) -> torch.nn.ModuleList:
        specs = dit_layer_specs(self.backend, tp_group=self.groups.tp)
        return torch.nn.ModuleList(
            DitLayer(
                config=self.config,
                backend=self.backend,
                specs=specs,
                layer_number=i + 1,
                groups=self.groups,
            )
            for i in range(self.chunk.layer_start, self.chunk.layer_end)
        )

    def _build_pre(self) -> torch.nn.Module:
        m = self.module_spec
        hidden, temb_dim = m.layer.hidden, self.model_config.timestep_embed_dim
        linear = torch.nn.Linear
        return Parts(
            x_embed=linear(m.patch_size**2 * m.in_channels, hidden),
            t_fc1=linear(temb_dim, hidden),
            t_fc2=linear(hidden, hidden),
            cond_fc1=linear(m.cond_hidden, hidden),
            cond_fc2=linear(hidden, hidden),
        )

    def _build_post(self) -> torch.nn.Module:
        m = self.module_spec
        hidden = m.layer.hidden
        return Parts(
            final_norm=torch.nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6),
            final_modulation=torch.nn.Linear(hidden, 2 * hidden),
            final_linear=torch.nn.Linear(hidden, m.patch_size**2 * m.in_channels),
        )

    def _gather_cond(self, inputs: Sequence[Mapping[str, torch.Tensor]], batch: SubBatch):
        """Concatenate the producers' caption encodings without their padding."""
        if not inputs:
            raise ValueError(f"{batch.sub.work}: the DiT needs the text encoder's output")
        pieces, indices = [], []
        for message in inputs:
            index = message["cond_index"].to(self.device)
            real = int(batch.caption_lengths[index].sum())
            pieces.append(message["cond"][:real])
            indices.append(index)
        return torch.cat(pieces).to(self.dtype), torch.cat(indices)

    def embed(
        self, inputs: Sequence[Mapping[str, torch.Tensor]], batch: SubBatch
    ) -> dict[str, torch.Tensor]:
        pre = self.pre
        hidden = self.scatter_sequence(pre.x_embed(batch.noisy.to(self.dtype))[:, None, :])
        freq = sinusoidal_embedding(batch.timesteps * 1000.0, self.model_config.timestep_embed_dim)
        temb = pre.t_fc2(functional.silu(pre.t_fc1(freq.to(self.dtype))))
        cond, cond_index = self._gather_cond(inputs, batch)
        cond = pre.cond_fc2(functional.gelu(pre.cond_fc1(cond), approximate="tanh"))
        return {"hidden": hidden, "temb": temb, "cond": cond, "cond_index": cond_index}

    def _cross_mask(self, cond_index: torch.Tensor, batch: SubBatch) -> torch.Tensor:
        """Clip tokens see their own caption's rows of "cond"; padding tokens see row 0."""
        missing = set(batch.clip_caption.tolist()) - set(cond_index.tolist())
        if missing:
            raise ValueError(f"{batch.sub.work}: captions {sorted(missing)} missing from cond")
        rows = torch.repeat_interleave(cond_index, batch.caption_lengths[cond_index])
        segments = batch.segments
        caption = torch.where(
            segments >= 0, batch.clip_caption[segments.clamp(min=0)], torch.full_like(segments, -2)
        )
        mask = caption[:, None] != rows[None, :]
        mask[segments < 0, 0] = False
        return mask[None, None]

    def run_layers(self, state: dict[str, torch.Tensor], batch: SubBatch) -> torch.Tensor:
        head_dim, base = self.module_spec.layer.head_dim, self.model_config.rotary_base
        self_mask = cached(batch, ("mask", False), lambda: segment_mask(batch.segments))
        rotary = cached(
            batch,
            ("rotary", head_dim, base, self.dtype),
            lambda: rotary_table(batch.positions, head_dim=head_dim, base=base, dtype=self.dtype),
        )
        cond_index = state["cond_index"]
        cross_mask = cached(
            batch,
            ("cross", tuple(cond_index.tolist())),
            lambda: self._cross_mask(cond_index, batch),
        )
        token_clip = sequence_slice(batch.segments.clamp(min=0), self.config, self.groups)
        hidden = state["hidden"]
        for layer in self.layers:
            hidden = layer(
                hidden,
                temb=state["temb"],
                token_clip=token_clip,
                cond=state["cond"],
                self_mask=self_mask,
                cross_mask=cross_mask,
                rotary=rotary,
            )
        return hidden

    def finish(self, state: dict[str, torch.Tensor], batch: SubBatch) -> dict[str, torch.Tensor]:
        post = self.post
        token_clip = batch.segments.clamp(min=0)
        shift, scale = post.final_modulation(functional.silu(state["temb"]))[token_clip].chunk(
            2, dim=-1
        )
        # The final norm has no weights: gather the sequence, then finish on every TP rank.
        x = self.gather_sequence(post.final_norm(state["hidden"]))[:, 0, :] * (1 + scale) + shift
        prediction = post.final_linear(x)[: batch.num_real]
        # The loss is summed over many tokens: accumulate it in at least fp32.
        prediction = prediction.to(torch.promote_types(prediction.dtype, torch.float32))
        target = batch.target[: batch.num_real].to(prediction.dtype)
        per_token = (prediction - target).pow(2).mean(dim=-1)
        return {
            "loss": per_token.sum(),
            "num_tokens": torch.tensor(batch.num_real, dtype=torch.int64, device=self.device),
        }
