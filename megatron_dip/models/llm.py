"""LLM and text-encoder chunks: token embedding, Megatron GPT layers, final norm, head and loss.

Layers are Megatron-Core `TransformerLayer`s from the GPT layer spec: RMSNorm, SwiGLU MLP,
grouped-query attention and rotary embeddings with positions restarting at every document.
Attention is causal within each packed document (LLM) or caption (text encoder; causal by
default, bidirectional with `ModelConfig.text_causal=False`). In a VLM the ViT's embeddings
replace the IMAGE_TOKEN placeholder positions in chunk 0. The text encoder has no head: its
last chunk hands the normalised hidden states to the DiT as "cond".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch.nn import functional

from megatron_dip.modelspec import ModuleKind

from .chunk import ModelChunk
from .common import (
    build_norm,
    build_transformer_layers,
    cached,
    gpt_layer_spec,
    rotary_table,
    segment_mask,
)
from .inputs import SubBatch


class Parts(torch.nn.Module):
    """A named bag of submodules (the `pre` / `post` parts of a chunk)."""

    def __init__(self, **modules: torch.nn.Module | None) -> None:
        super().__init__()
        for name, module in modules.items():
            if module is not None:
                self.add_module(name, module)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-sharded logits [S, 1, V/tp] over `group`.

    Megatron's own version reads the global tensor-parallel group; this one takes it
    explicitly. Sums over the group are all-reduced forward and passed through unchanged
    backward (every rank holds the same loss).
    """
    logits = (
        logits[:, 0].float() if logits.dtype in (torch.float16, torch.bfloat16) else logits[:, 0]
    )
    if group.size() == 1:
        return functional.cross_entropy(logits, target, reduction="none")
    with torch.no_grad():
        top = logits.max(dim=-1).values
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - top[:, None]
    reduce = tensor_parallel.reduce_from_tensor_model_parallel_region
    sum_exp = reduce(shifted.exp().sum(dim=-1), group=group)
    part = logits.shape[-1]
    local = target - group.rank() * part
    inside = (local >= 0) & (local < part)
    picked = shifted.gather(1, local.clamp(0, part - 1)[:, None])[:, 0] * inside
    return torch.log(sum_exp) - reduce(picked, group=group)


class LlmChunk(ModelChunk):
    """A chunk of an LLM (with head and loss) or of a text encoder (hands over "cond")."""

    @property
    def has_head(self) -> bool:
        return self.module_spec.kind is ModuleKind.LLM

    @property
    def causal(self) -> bool:
        return self.has_head or self.model_config.text_causal

    @property
    def tied(self) -> bool:
        return self.has_head and self.model_config.tie_embeddings

    def _check_tied_group(self) -> None:
        if self.tied and self.num_chunks > 1 and self.groups.embedding is None:
            raise ValueError(
                f"{self.chunk.module}: tied input/output embeddings in different chunks need "
                "ModelGroups.embedding (the group of the ranks holding the first and last chunk) "
                "to sum their gradients; pass it, or set ModelConfig.tie_embeddings=False"
            )

    def _build_layers(self) -> torch.nn.ModuleList:
        self._check_tied_group()
        spec = gpt_layer_spec(self.module_spec, self.backend)
        c = self.chunk
        return build_transformer_layers(
            spec=spec, config=self.config, groups=self.groups, start=c.layer_start, end=c.layer_end
        )

    def _build_pre(self) -> torch.nn.Module:
        embedding = tensor_parallel.VocabParallelEmbedding(
            self.module_spec.vocab_size,
            self.module_spec.layer.hidden,
            init_method=self.config.init_method,
            config=self.config,
            tp_group=self.groups.tp,
        )
        return Parts(word_embeddings=embedding)

    def _build_post(self) -> torch.nn.Module:
        hidden = self.module_spec.layer.hidden
        norm = build_norm(self.backend, self.config, hidden)
        if not self.has_head:
            return Parts(final_norm=norm)
        head = tensor_parallel.ColumnParallelLinear(
            hidden,
            self.module_spec.vocab_size,
            config=self.config,
            init_method=self.config.init_method,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=self.tied,
            tp_group=self.groups.tp,
        )
        post = Parts(final_norm=norm, output_layer=head)
        if self.tied and self.num_chunks > 1:
            # The last chunk's own copy of the input embedding (same global name, same init).
            weight = torch.nn.Parameter(
                torch.empty(head.output_size_per_partition, hidden, dtype=self.dtype)
            )
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
            post.register_parameter("tied_weight", weight)
            self.global_aliases["post.tied_weight"] = (
                f"{self.chunk.module}.pre.word_embeddings.weight"
            )
        return post

    def tied_embedding_weight(self) -> torch.nn.Parameter | None:
        if not self.tied or self.num_chunks == 1:
            return None
        if self.is_first:
            return self.pre.word_embeddings.weight
        if self.is_last:
            return self.post.tied_weight
        return None

    def embed(
        self, inputs: Sequence[Mapping[str, torch.Tensor]], batch: SubBatch
    ) -> dict[str, torch.Tensor]:
        hidden = self.pre.word_embeddings(batch.token_ids[None]).transpose(0, 1).contiguous()
        if not self.has_head and inputs:
            raise ValueError(f"{self.chunk.module} takes no producer inputs")
        if inputs:
            images = torch.cat([m["embeddings"] for m in inputs]).to(hidden.dtype)
            where = batch.image_positions
            if images.shape[0] != where.shape[0]:
                raise ValueError(
                    f"{batch.sub.work}: {images.shape[0]} image embeddings for "
                    f"{where.shape[0]} IMAGE_TOKEN positions"
                )
            hidden = hidden.index_put((where, torch.zeros_like(where)), images)
        elif batch.image_positions is not None and batch.image_positions.numel():
            raise ValueError(f"{batch.sub.work}: image placeholders but no ViT inputs")
        return {"hidden": self.scatter_sequence(hidden)}

    def run_layers(self, state: dict[str, torch.Tensor], batch: SubBatch) -> torch.Tensor:
        shape = self.module_spec.layer
        mask = cached(
            batch, ("mask", self.causal), lambda: segment_mask(batch.segments, causal=self.causal)
        )
        rotary = cached(
            batch,
            ("rotary", shape.head_dim, self.model_config.rotary_base, self.dtype),
            lambda: rotary_table(
                batch.positions,
                head_dim=shape.head_dim,
                base=self.model_config.rotary_base,
                dtype=self.dtype,
            ),
        )
        hidden = state["hidden"]
        for layer in self.layers:
            hidden, _ = layer(hidden, attention_mask=mask, rotary_pos_emb=rotary)
        return hidden

    def finish(self, state: dict[str, torch.Tensor], batch: SubBatch) -> dict[str, torch.Tensor]:
        hidden = self.post.final_norm(state["hidden"])
        if not self.has_head:
            return {"cond": self.gather_sequence(hidden), "cond_index": batch.caption_index}
        # Under sequence parallelism the column-parallel head all-gathers the sequence itself
        # (and reduce-scatters the gradient): logits cover the full sequence.
        weight = None
        if self.tied:
            weight = (
                self.post.tied_weight if self.num_chunks > 1 else self.pre.word_embeddings.weight
            )
        logits, _ = self.post.output_layer(hidden, weight=weight)
        per_token = vocab_parallel_cross_entropy(logits, batch.labels, group=self.groups.tp)
        mask = batch.loss_mask.to(per_token.dtype)
        # where(): a non-finite loss at a masked (padding) position must not poison the sum.
        loss = torch.where(mask > 0, per_token, torch.zeros_like(per_token)) * mask
        return {"loss": loss.sum(), "num_tokens": (mask > 0).sum().to(torch.int64)}
