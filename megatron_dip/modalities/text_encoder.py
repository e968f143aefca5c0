"""Text encoder: an LLM without head whose normalised hidden states condition a DiT.

An instance is one caption (one per sample). Layers are the LLM's (`llm.TextModality`); attention
is causal within each caption (the paper's text encoders are decoder LLMs), bidirectional with
`ModelConfig.text_causal=False`. The last chunk hands its consumer "cond" [padded tokens, 1,
hidden] (the final-normed hidden states) and "cond_index" int64 [captions] (the microbatch
caption index of each caption in "cond", in order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch, TensorSpec

from .base import INDEX_DTYPE, Instance, SampleArrays, SampleInfo
from .costs import CostContext, Op, Work, mem
from .llm import TextModality
from .registry import register


class TextEncoderModality(TextModality):
    """Text encoder feeding a DiT (module docstring)."""

    kind = "text_encoder"
    instance = "caption"

    def is_causal(self, chunk) -> bool:
        return chunk.model_config.text_causal

    def microbatch_instances(
        self, spec: ModuleSpec, samples: Sequence[SampleInfo], *, seq_length: int
    ) -> list[Instance]:
        del spec, seq_length
        return [Instance(i, s.text_tokens) for i, s in enumerate(samples)]

    def check_sample(self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays) -> None:
        text = np.asarray(sample.text)
        if text.size == 0:
            raise ValueError("the caption is empty")

    def hand_over(self, spec: ModuleSpec, sub: SubMicrobatch, *, dtype: str) -> list[TensorSpec]:
        return [
            TensorSpec("cond", (sub.padded_tokens, 1, spec.layer.hidden), dtype),
            TensorSpec("cond_index", (sub.num_instances,), INDEX_DTYPE),
        ]

    def output_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        return [mem(w.tokens * spec.layer.hidden / c.rep, 2, c)]  # final norm

    def profile_grid(self, spec: ModuleSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (64, 128, 256), (1, 4, 16)  # captions

    # -- torch parts --------------------------------------------------------------------------

    def build_post(self, chunk):
        from megatron_dip.models.common import Parts, build_norm

        return Parts(
            final_norm=build_norm(chunk.backend, chunk.config, chunk.module_spec.layer.hidden)
        )

    def embed(self, chunk, inputs: Sequence[Mapping[str, Any]], batch) -> dict:
        if inputs:
            raise ValueError(f"{chunk.chunk.module} takes no producer inputs")
        return {"hidden": chunk.scatter_sequence(self.embed_tokens(chunk, batch))}

    def finish(self, chunk, state: dict, batch) -> dict:
        hidden = chunk.post.final_norm(state["hidden"])
        return {"cond": chunk.gather_sequence(hidden), "cond_index": batch.caption_index}

    def build_sub_batch(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleArrays],
        sub: SubMicrobatch,
        *,
        seq_length: int,
        seed: int,
    ):
        import torch

        from megatron_dip.models.batch import SubBatch, check_tokens, padded, segment_ids

        del model, seq_length, seed
        all_lengths = [len(s.text) for s in samples]
        if any(n == 0 for n in all_lengths):
            raise ValueError(f"{sub.work}: every caption needs at least one token")
        chosen = samples[sub.instance_start : sub.instance_end]
        texts = [np.asarray(s.text, dtype=np.int64) for s in chosen]
        check_tokens(sub, [len(t) for t in texts], None)
        total = sub.padded_tokens
        positions = padded([np.arange(len(t)) for t in texts], total)[:, None]
        return SubBatch(
            sub=sub,
            kind=self.kind,
            segments=torch.from_numpy(segment_ids([len(t) for t in texts], total)),
            positions=torch.from_numpy(positions),
            tensors={
                "token_ids": torch.from_numpy(padded(texts, total, spec.pad_id)),
                "caption_index": torch.arange(
                    sub.instance_start, sub.instance_end, dtype=torch.int64
                ),
                "caption_lengths": torch.tensor(all_lengths, dtype=torch.int64),
            },
        )


TEXT_ENCODER = register(TextEncoderModality())
