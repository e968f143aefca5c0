"""LLM: a decoder over one packed text sequence per microbatch, with output head and loss.

An instance is the microbatch's packed sequence (one sub-microbatch, padded to --seq-length; the
padding attends only to itself). Layers are Megatron-Core `TransformerLayer`s from the GPT layer
spec: RMSNorm, SwiGLU MLP, grouped-query attention and 1-D rotary embeddings with positions
restarting at every document; attention is causal within each document. Chunk 0 embeds the
tokens and scatters every producer's hand-over (`scatter.scatter_name`) into that producer's
placeholder positions; the last chunk normalises, projects to the vocabulary (tied to the input
embedding or not) and sums the next-token cross entropy over the loss targets (`loss_targets`).
`TextModality` holds what the LLM shares with the text encoder (`text_encoder.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch

from .base import Instance, Modality, SampleArrays, SampleInfo
from .costs import LOGIT_BYTES, CostContext, Op, OpKind, Work, gemm, mem
from .registry import modality_of, register
from .scatter import ScatterProducer, scatter_name
from .stored import Stored


def loss_targets(
    text: np.ndarray, labels_mask: np.ndarray | None = None, *, placeholders=()
) -> np.ndarray:
    """Boolean [len(text)]: whether token j is a next-token prediction target.

    True where `labels_mask` is 1 (every token without a mask), except token 0 (nothing precedes
    it within the sample; packed samples never predict across their boundaries) and placeholder
    tokens of the producers (`placeholders`). Position j - 1 of the LLM carries the loss of target
    j; the LLM's loss-token count of the sample is the number of True entries.
    """
    text = np.asarray(text)
    targets = ~np.isin(text, list(placeholders))
    if labels_mask is not None:
        targets &= np.asarray(labels_mask) != 0
    targets[:1] = False
    return targets


def scatter_producers(model: MultimodalSpec, consumer: str) -> list[tuple[ModuleSpec, int]]:
    """(producer, placeholder id) of every producer scattering into `consumer`, in model order."""
    out = []
    for p in model.producers_of(consumer):
        modality = modality_of(p)
        if isinstance(modality, ScatterProducer):
            out.append((p, modality.placeholder_id(p)))
    return out


def placeholder_ids(model: MultimodalSpec, consumer: str) -> tuple[int, ...]:
    """The placeholder ids in `consumer`'s text (none when no producer scatters into it: then
    every id is text, whatever the tokenizer)."""
    return tuple(t for _, t in scatter_producers(model, consumer))


class TextModality(Modality):
    """What the LLM and the text encoder share: token embedding, RMSNorm, no biases."""

    reads_text = True
    causal = True
    normalization = "RMSNorm"
    linear_bias = False

    def check_spec(self, spec: ModuleSpec, model: MultimodalSpec) -> None:
        if spec.vocab_size <= 0:
            raise ValueError(f"module {spec.name!r}: a {spec.kind} needs vocab_size")

    def module_tokens(self, spec: ModuleSpec, meta: SampleInfo) -> tuple[int, int]:
        return meta.text_tokens, 1

    def input_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        # Token embedding: a gather forward; its backward scatter-adds into the vocab gradient.
        h = spec.layer.hidden
        return [mem(w.tokens * h, 2, c), mem(spec.vocab_size * h / c.tp, 1, c)]

    def input_params(self, spec: ModuleSpec) -> int:
        return spec.vocab_size * spec.layer.hidden

    def build_pre(self, chunk):
        from megatron.core import tensor_parallel

        from megatron_dip.models.common import Parts

        embedding = tensor_parallel.VocabParallelEmbedding(
            chunk.module_spec.vocab_size,
            chunk.module_spec.layer.hidden,
            init_method=chunk.config.init_method,
            config=chunk.config,
            tp_group=chunk.groups.tp,
        )
        return Parts(word_embeddings=embedding)

    def embed_tokens(self, chunk, batch):
        """[tokens, 1, hidden] token embeddings (before sequence parallelism)."""
        return chunk.pre.word_embeddings(batch.token_ids[None]).transpose(0, 1).contiguous()


class LlmModality(TextModality):
    """Decoder with head and loss (module docstring)."""

    kind = "llm"
    instance = "sequence"
    whole_microbatch = True

    # -- metadata -----------------------------------------------------------------------------

    def microbatch_instances(
        self, spec: ModuleSpec, samples: Sequence[SampleInfo], *, seq_length: int
    ) -> list[Instance]:
        # One packed sequence of the samples' text; the runtime pads it to seq_length.
        del spec, seq_length
        return [Instance(-1, sum(s.text_tokens for s in samples))]

    def padded_tokens(self, spec: ModuleSpec, tokens: int, *, seq_length: int) -> int:
        del spec, tokens
        return seq_length

    def attention_pairs(
        self,
        spec: ModuleSpec,
        samples: Sequence[SampleInfo],
        items: Sequence[Instance],
        *,
        seq_length: int,
    ) -> int:
        del spec, items
        docs = [s.text_tokens for s in samples]
        pad = seq_length - sum(docs)
        return sum(d * d for d in docs) + pad * pad

    def check_microbatch(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleInfo],
        *,
        index: int,
        seq_length: int,
        pad: int,
    ) -> None:
        text = sum(s.text_tokens for s in samples)
        if text > seq_length:
            ids = [s.sample_id for s in samples]
            raise ValueError(
                f"microbatch {index}: {text} text tokens exceed --seq-length {seq_length} "
                f"(samples {ids})"
            )
        if seq_length % pad:
            # The sequence is split over the tensor-parallel ranks; padding it beyond
            # seq_length would feed the model more positions than it was built for.
            raise ValueError(
                f"--seq-length {seq_length} must be a multiple of the tensor-parallel size {pad} "
                "under sequence parallelism"
            )

    # -- arrays and loss ------------------------------------------------------------------------

    def check_sample(self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays) -> None:
        if sample.labels_mask is None:
            return
        text = np.asarray(sample.text)
        marked = np.asarray(sample.labels_mask)[np.isin(text, placeholder_ids(model, spec.name))]
        if np.any(marked):
            raise ValueError("labels_mask marks placeholder tokens as loss tokens")

    def sample_loss_tokens(
        self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays
    ) -> int:
        ids = placeholder_ids(model, spec.name)
        return int(loss_targets(sample.text, sample.labels_mask, placeholders=ids).sum())

    def microbatch_loss_tokens(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleArrays],
        sub: SubMicrobatch,
    ) -> int:
        del sub  # an LLM sub-microbatch is the whole microbatch
        return sum(self.sample_loss_tokens(spec, model, s) for s in samples)

    # -- costs --------------------------------------------------------------------------------

    def output_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        h, t, v = spec.layer.hidden, w.tokens, spec.vocab_size
        return [
            mem(t * h / c.rep, 2, c),  # final norm
            gemm(t, h, v, c, shard_in=False),
            Op(5 * t * v / c.tp, 3 * t * v / c.tp * LOGIT_BYTES, OpKind.MEM),  # cross entropy
        ]

    def output_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        # The final norm, the head's input, the cross entropy's fp32 softmax of the logits.
        head = Stored(replicated=1.0).nbytes(spec.layer.hidden, w, c)
        logits = LOGIT_BYTES * w.tokens * spec.vocab_size / c.tp
        return super().output_stored(spec, w, c) + head + logits

    def output_params(self, spec: ModuleSpec) -> int:
        return spec.vocab_size * spec.layer.hidden + spec.layer.hidden

    def profile_grid(self, spec: ModuleSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (1024, 2048, 4096, 8192), (1,)  # one packed sequence per sub-microbatch

    # -- torch parts --------------------------------------------------------------------------

    def tied(self, chunk) -> bool:
        return chunk.model_config.tie_embeddings

    def build_layers(self, chunk):
        if self.tied(chunk) and chunk.num_chunks > 1 and chunk.groups.embedding is None:
            raise ValueError(
                f"{chunk.chunk.module}: tied input/output embeddings in different chunks need "
                "ModelGroups.embedding (the group of the ranks holding the first and last chunk) "
                "to sum their gradients; pass it, or set ModelConfig.tie_embeddings=False"
            )
        return super().build_layers(chunk)

    def build_post(self, chunk):
        import torch
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from megatron_dip.models.common import Parts, build_norm

        hidden, tied = chunk.module_spec.layer.hidden, self.tied(chunk)
        norm = build_norm(chunk.backend, chunk.config, hidden)
        head = tensor_parallel.ColumnParallelLinear(
            hidden,
            chunk.module_spec.vocab_size,
            config=chunk.config,
            init_method=chunk.config.init_method,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=tied,
            tp_group=chunk.groups.tp,
        )
        post = Parts(final_norm=norm, output_layer=head)
        if tied and chunk.num_chunks > 1:
            # The last chunk's own copy of the input embedding (same global name, same init).
            weight = torch.nn.Parameter(
                torch.empty(head.output_size_per_partition, hidden, dtype=chunk.dtype)
            )
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
            post.register_parameter("tied_weight", weight)
            chunk.global_aliases["post.tied_weight"] = (
                f"{chunk.chunk.module}.pre.word_embeddings.weight"
            )
        return post

    def tied_embedding_weight(self, chunk):
        if not self.tied(chunk) or chunk.num_chunks == 1:
            return None
        if chunk.is_first:
            return chunk.pre.word_embeddings.weight
        if chunk.is_last:
            return chunk.post.tied_weight
        return None

    def embed(self, chunk, inputs: Sequence[Mapping[str, Any]], batch) -> dict:
        import torch

        hidden = self.embed_tokens(chunk, batch)
        received: dict[str, list] = {}
        for message in inputs:
            for name, tensor in message.items():
                received.setdefault(name, []).append(tensor)
        for producer, _ in scatter_producers(chunk.model_spec, chunk.chunk.module):
            name, where = scatter_name(producer), batch.tensors[f"{producer.name}.positions"]
            rows = received.pop(name, [])
            if not rows:
                if where.numel():
                    raise ValueError(
                        f"{batch.sub.work}: {producer.name} placeholders but no {producer.name} "
                        "inputs"
                    )
                continue
            values = torch.cat(rows).to(hidden.dtype)
            if values.shape[0] != where.shape[0]:
                raise ValueError(
                    f"{batch.sub.work}: {values.shape[0]} {producer.name} embeddings for "
                    f"{where.shape[0]} placeholder positions"
                )
            hidden = hidden.index_put((where, torch.zeros_like(where)), values)
        if received:
            raise ValueError(f"{batch.sub.work}: inputs {sorted(received)} from no producer")
        return {"hidden": chunk.scatter_sequence(hidden)}

    def finish(self, chunk, state: dict, batch) -> dict:
        import torch

        from megatron_dip.models.common import vocab_parallel_cross_entropy

        hidden = chunk.post.final_norm(state["hidden"])
        # Under sequence parallelism the column-parallel head all-gathers the sequence itself
        # (and reduce-scatters the gradient): logits cover the full sequence.
        weight = None
        if self.tied(chunk):
            post, pre = chunk.post, chunk.pre
            weight = post.tied_weight if chunk.num_chunks > 1 else pre.word_embeddings.weight
        logits, _ = chunk.post.output_layer(hidden, weight=weight)
        per_token = vocab_parallel_cross_entropy(logits, batch.labels, group=chunk.groups.tp)
        mask = batch.loss_mask.to(per_token.dtype)
        # where(): a non-finite loss at a masked (padding) position must not poison the sum.
        loss = torch.where(mask > 0, per_token, torch.zeros_like(per_token)) * mask
        return {"loss": loss.sum(), "num_tokens": (mask > 0).sum().to(torch.int64)}

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

        del seed
        if (sub.index, sub.instance_start, sub.instance_end) != (0, 0, 1):
            raise ValueError(
                f"{sub.work}: an LLM microbatch is one sub-microbatch of instance [0, 1)"
            )
        texts = [np.asarray(s.text, dtype=np.int64) for s in samples]
        real = sum(len(t) for t in texts)
        # A plan may count the LLM's whole padded sequence as its tokens (it computes on all).
        whole = sub.tokens == sub.padded_tokens >= real
        check_tokens(sub, [sub.tokens if whole else real], seq_length)
        total = sub.padded_tokens
        pad = spec.pad_id  # the tokenizer's; padding positions carry no loss
        tokens = padded(texts, total, pad)
        labels = padded([np.append(t[1:], pad) for t in texts if len(t)], total, pad)
        ids = placeholder_ids(model, spec.name)
        mask = padded([_loss_mask(s, ids) for s in samples], total, 0.0)
        positions = padded([np.arange(len(t)) for t in texts], total, 0)
        tensors = {
            "token_ids": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(mask.astype(np.float32)),
        }
        for producer, token in scatter_producers(model, spec.name):
            where = np.nonzero(tokens == token)[0]
            modality = modality_of(producer)
            expected = sum(
                modality.consumer_rows(producer, t)
                for s in samples
                for t in modality.counts_of(producer, modality.media(producer, s))
            )
            if expected != len(where):
                raise ValueError(
                    f"{sub.work}: {len(where)} {producer.name} placeholders, its "
                    f"{modality.instance}s give {expected} LLM tokens"
                )
            tensors[f"{producer.name}.positions"] = torch.from_numpy(where.astype(np.int64))
        return SubBatch(
            sub=sub,
            kind=self.kind,
            segments=torch.from_numpy(segment_ids([len(t) for t in texts], total)),
            positions=torch.from_numpy(positions[:, None].astype(np.int64)),
            tensors=tensors,
        )


def _loss_mask(sample: SampleArrays, placeholders: tuple[int, ...]) -> np.ndarray:
    """Loss of position j (predicting token j+1): whether token j+1 is a target."""
    targets = loss_targets(sample.text, sample.labels_mask, placeholders=placeholders)
    targets = targets.astype(np.float32)
    return np.concatenate([targets[1:], np.zeros(min(1, len(targets)), dtype=np.float32)])


LLM = register(LlmModality())
