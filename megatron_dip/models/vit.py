"""ViT chunks: patch embedding, Megatron encoder layers, final norm, patch merger and projector.

Images of a sub-microbatch are packed along the sequence; each patch attends to every patch of
its own image only (segment mask) and carries a 2-D rotary position (row, column). The last
chunk normalises, merges each merge x merge window of patches into one vector (windows are
contiguous by construction of `inputs.patchify_image`) and projects it with a two-layer MLP
into the LLM's hidden size: one row per LLM image token ("embeddings").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from megatron.core import tensor_parallel
from torch.nn import functional

from .chunk import ModelChunk
from .common import (
    build_norm,
    build_transformer_layers,
    cached,
    gpt_layer_spec,
    rotary_table,
    segment_mask,
    without_sequence_parallel,
)
from .inputs import SubBatch
from .llm import Parts


class VitChunk(ModelChunk):
    """A chunk of a vision encoder feeding an LLM."""

    def _build_layers(self) -> torch.nn.ModuleList:
        spec = gpt_layer_spec(self.module_spec, self.backend)
        c = self.chunk
        return build_transformer_layers(
            spec=spec, config=self.config, groups=self.groups, start=c.layer_start, end=c.layer_end
        )

    def _build_pre(self) -> torch.nn.Module:
        m = self.module_spec
        # Replicated on every tensor-parallel rank: small, and its input is not sharded.
        return Parts(patch_embed=torch.nn.Linear(m.patch_size**2 * m.in_channels, m.layer.hidden))

    def _build_post(self) -> torch.nn.Module:
        m = self.module_spec
        merged = m.layer.hidden * m.merge * m.merge
        # The merger runs on the gathered sequence: no sequence parallelism inside it.
        config = without_sequence_parallel(self.config)
        fc1 = tensor_parallel.ColumnParallelLinear(
            merged,
            merged,
            config=config,
            init_method=self.config.init_method,
            bias=True,
            gather_output=False,
            tp_group=self.groups.tp,
        )
        fc2 = tensor_parallel.RowParallelLinear(
            merged,
            m.out_hidden,
            config=config,
            init_method=self.config.init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=self.groups.tp,
        )
        norm = build_norm(self.backend, self.config, m.layer.hidden)
        return Parts(final_norm=norm, merger_fc1=fc1, merger_fc2=fc2)

    def embed(
        self, inputs: Sequence[Mapping[str, torch.Tensor]], batch: SubBatch
    ) -> dict[str, torch.Tensor]:
        if inputs:
            raise ValueError(f"{self.chunk.module} takes no producer inputs")
        hidden = self.pre.patch_embed(batch.patches.to(self.dtype))
        return {"hidden": self.scatter_sequence(hidden[:, None, :])}

    def run_layers(self, state: dict[str, torch.Tensor], batch: SubBatch) -> torch.Tensor:
        head_dim = self.module_spec.layer.head_dim
        base = self.model_config.rotary_base
        mask = cached(batch, ("mask", False), lambda: segment_mask(batch.segments))
        rotary = cached(
            batch,
            ("rotary", head_dim, base, self.dtype),
            lambda: rotary_table(batch.positions, head_dim=head_dim, base=base, dtype=self.dtype),
        )
        hidden = state["hidden"]
        for layer in self.layers:
            hidden, _ = layer(hidden, attention_mask=mask, rotary_pos_emb=rotary)
        return hidden

    def finish(self, state: dict[str, torch.Tensor], batch: SubBatch) -> dict[str, torch.Tensor]:
        m = self.module_spec
        hidden = self.gather_sequence(self.post.final_norm(state["hidden"]))[: batch.num_real]
        merged = hidden.reshape(-1, 1, m.layer.hidden * m.merge * m.merge)
        hidden, _ = self.post.merger_fc1(merged)
        hidden, _ = self.post.merger_fc2(functional.gelu(hidden))
        return {"embeddings": hidden[:, 0, :]}
