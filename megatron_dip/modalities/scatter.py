"""Scatter producers: media encoders whose outputs replace their placeholder tokens in the
consumer's sequence (ViT, audio encoder), behind the `base.Modality` protocol.

A scatter producer owns a placeholder token id (`ModuleSpec.placeholder_id`): each of its
instances occupies a run of placeholders as long as its `placeholders` count, and its hand-over
is one tensor named `scatter_name(spec)` with one row per placeholder. Its last chunk normalises,
merges every `pool` consecutive tokens into one vector and projects it with a two-layer MLP into
the consumer's hidden size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch, TensorSpec

from .base import InstanceCounts, Modality, SampleArrays
from .costs import CostContext, Op, Work, gemm, mem
from .stored import Stored


def scatter_name(spec: ModuleSpec) -> str:
    """Name of a scatter producer's hand-over tensor (one row per placeholder token)."""
    return f"{spec.name}.embeddings"


def placeholder_runs(text: np.ndarray, token: int) -> list[int]:
    """Lengths of the maximal runs of `token` in `text`, in order."""
    is_token = np.concatenate(([0], (np.asarray(text) == token).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(is_token))
    return (edges[1::2] - edges[::2]).tolist()


class ScatterProducer(Modality):
    """A media encoder whose outputs replace its placeholder tokens in the consumer's sequence
    (ViT, audio encoder): one hand-over row per placeholder (`consumer_rows`)."""

    default_placeholder: ClassVar[int | None] = None
    # What the tokenizer calls this module's placeholder ("image", "audio"): a run with a real
    # tokenizer takes `ModuleSpec.placeholder_id` from the tokenizer's token of this role.
    placeholder_role: ClassVar[str] = ""

    def placeholder_id(self, spec: ModuleSpec) -> int:
        """The token id of this module's placeholders in the consumer's text."""
        token = spec.placeholder_id if spec.placeholder_id is not None else self.default_placeholder
        if token is None:
            raise ValueError(f"module {spec.name!r} ({spec.kind}) needs a placeholder_id")
        return token

    def pool(self, spec: ModuleSpec) -> int:
        """Module tokens merged into one consumer token."""
        raise NotImplementedError

    def consumer_rows(self, spec: ModuleSpec, tokens: int) -> int:
        """Consumer tokens of `tokens` module tokens (whole instances: exact)."""
        return tokens // self.pool(spec)

    def check_spec(self, spec: ModuleSpec, model: MultimodalSpec) -> None:
        if spec.out_hidden <= 0:
            raise ValueError(
                f"module {spec.name!r}: a {spec.kind} needs out_hidden (its consumer's hidden)"
            )
        if spec.feeds is None:
            raise ValueError(f"module {spec.name!r}: a {spec.kind} must feed a consumer")
        vocab = model.module(spec.feeds).vocab_size
        token = self.placeholder_id(spec)
        if vocab and not 0 <= token < vocab:
            raise ValueError(
                f"module {spec.name!r}: placeholder id {token} outside the vocabulary of {vocab}"
            )

    def hand_over(self, spec: ModuleSpec, sub: SubMicrobatch, *, dtype: str) -> list[TensorSpec]:
        rows = self.consumer_rows(spec, sub.tokens)
        return [TensorSpec(scatter_name(spec), (rows, spec.out_hidden), dtype)]

    def check_placeholders(self, spec: ModuleSpec, text: np.ndarray, counts: Sequence[int]) -> None:
        """Each run of this module's placeholder id must hold whole instances, in order
        (adjacent instances merge runs); raises ValueError naming what disagrees."""
        what = f"{self.instance}s"
        needed = sum(counts)
        if needed > text.size:
            raise ValueError(
                f"its {len(counts)} {what} need {needed} LLM tokens but the sequence has "
                f"only {text.size} tokens"
            )
        runs = placeholder_runs(text, self.placeholder_id(spec))
        if sum(runs) != needed:
            raise ValueError(
                f"{sum(runs)} {self.instance} placeholder tokens in the text, but its "
                f"{len(counts)} {what} need {needed}"
            )
        item = 0
        for r, run in enumerate(runs):
            covered = 0
            while covered < run:
                covered += counts[item]
                item += 1
            if covered != run:
                raise ValueError(
                    f"placeholder run {r} has {run} tokens, which does not match the sizes of "
                    f"{what} up to {item - 1} ({self.instance} {item - 1} needs {counts[item - 1]})"
                )

    def consumer_grid(self, spec: ModuleSpec, array: np.ndarray) -> tuple[int, int, int]:
        """(frames, rows, columns) of an instance's consumer tokens, for a consumer with M-RoPE
        positions (Qwen2-VL); a producer without a grid cannot feed one."""
        del array
        raise ValueError(f"module {spec.name!r} ({spec.kind}) has no M-RoPE token grid")

    def media(self, spec: ModuleSpec, sample: SampleArrays) -> list[np.ndarray]:
        """The sample's arrays of this module, in order."""
        return list(sample.media.get(spec.name, ()))

    def counts_of(self, spec: ModuleSpec, arrays: Sequence[np.ndarray]) -> list[int]:
        """Module tokens of each array (raises ValueError on a malformed one)."""
        raise NotImplementedError

    def instance_counts(
        self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays
    ) -> InstanceCounts:
        tokens = self.counts_of(spec, self.media(spec, sample))
        rows = [self.consumer_rows(spec, t) for t in tokens]
        self.check_placeholders(spec, np.asarray(sample.text), rows)
        return InstanceCounts(tuple(tokens), tuple(rows))

    def output_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        h, rows = spec.layer.hidden, self.consumer_rows(spec, w.tokens)
        width = self.pool(spec) * h
        inner = spec.arch.projector_hidden or width
        return [
            mem(w.tokens * h / c.rep, 2, c),  # final norm
            gemm(rows, width, inner, c, shard_in=False),  # merger fc1 (column-parallel)
            gemm(rows, inner, spec.out_hidden, c, shard_in=True),  # merger fc2 (row-parallel)
        ]

    def output_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        # The final norm; the merger's input (the gathered sequence, pool tokens per row),
        # fc1's output and fc2's input (rows x pool * hidden, split by TP).
        merger = Stored(whole=1.0, sharded=2.0).nbytes(spec.layer.hidden, w, c)
        return super().output_stored(spec, w, c) + merger

    def output_params(self, spec: ModuleSpec) -> int:
        h, width, out = spec.layer.hidden, self.pool(spec) * spec.layer.hidden, spec.out_hidden
        inner = spec.arch.projector_hidden or width
        norm = 2 * h if spec.arch.final_norm else 0
        return width * inner + inner + inner * out + out + norm  # merger and final LayerNorm

    # -- torch parts --------------------------------------------------------------------------

    def embed(self, chunk, inputs: Sequence[Mapping[str, Any]], batch) -> dict:
        if inputs:
            raise ValueError(f"{chunk.chunk.module} takes no producer inputs")
        hidden = self.embed_media(chunk, batch)
        return {"hidden": chunk.scatter_sequence(hidden[:, None, :])}

    def embed_media(self, chunk, batch):
        """[tokens, hidden] input embeddings of the sub-microbatch's instances."""
        raise NotImplementedError

    def handed_rows(self, chunk, hidden, batch):
        """The rows of the real tokens' final hidden states [T, 1, hidden] that are handed
        over (all of them here; a ViT drops its class tokens)."""
        del chunk, batch
        return hidden

    def finish(self, chunk, state: dict, batch) -> dict:
        from torch.nn import functional

        m = chunk.module_spec
        hidden = state["hidden"]
        if m.arch.final_norm:
            hidden = chunk.post.final_norm(hidden)
        hidden = self.handed_rows(chunk, chunk.gather_sequence(hidden)[: batch.num_real], batch)
        merged = hidden.reshape(-1, 1, m.layer.hidden * self.pool(m))
        hidden, _ = chunk.post.merger_fc1(merged)
        hidden, _ = chunk.post.merger_fc2(functional.gelu(hidden))
        return {scatter_name(m): hidden[:, 0, :]}

    def build_post(self, chunk):
        from megatron_dip.models.common import Parts, build_merger, build_norm

        m = chunk.module_spec
        fc1, fc2 = build_merger(
            chunk,
            width=m.layer.hidden * self.pool(m),
            out=m.out_hidden,
            inner=m.arch.projector_hidden,
        )
        norm = (
            build_norm(chunk.backend, chunk.config, m.layer.hidden) if m.arch.final_norm else None
        )
        return Parts(final_norm=norm, merger_fc1=fc1, merger_fc2=fc2)
