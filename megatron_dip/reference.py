"""A single-process run of a whole multimodal model: the ground truth for pipelined runs.

`LocalPipeline` holds every chunk of every module in one process and runs them stage by stage
the way the runtime does: each message crosses a detach boundary (checked against
`batching.message_tensors`), and backward walks the stages in reverse, feeding each stage the
gradients its consumers computed for the message. `reference_loss_and_grads` is the
non-pipelined reference: every module as one chunk (or any `ranges` you give).

Loss normalisation, as Megatron: by default each microbatch's mean over its loss tokens,
summed and divided by the number of microbatches; with `per_token_loss=True` the sum over all
loss tokens of all microbatches divided by their total count.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megatron_dip.batching import cross_module_dependencies, message_tensors, split_samples
from megatron_dip.cpu_support import seed_model_parallel_rng
from megatron_dip.data.sample import Sample
from megatron_dip.modalities import build_module_chunks, build_sub_batch
from megatron_dip.models.chunk import ModelChunk, ModelGroups, reduce_tied_embedding_grads
from megatron_dip.models.config import ModelConfig
from megatron_dip.models.init import global_param_name
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.parallel import ParallelShape
from megatron_dip.schedule.ir import MessageKey, MessageKind, StageId, SubMicrobatch, WorkId

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
}


class MessageMismatchError(AssertionError):
    """A chunk produced a message that differs from `batching.message_tensors`."""


@dataclass
class _Stage:
    stage: StageId
    received: list[dict[str, torch.Tensor]]  # detached leaves this stage consumed
    outputs: dict[str, torch.Tensor]
    consumers: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def output_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs that take a gradient and, for each, the sum of what its consumers'
        backwards left on their copies of it (after those backwards ran)."""
        outs, grads = [], []
        for name, t in self.outputs.items():
            got = [r[name].grad for r in self.consumers if r[name].grad is not None]
            if t.requires_grad and got:
                outs.append(t)
                grads.append(torch.stack(got).sum(0))
        return outs, grads


def check_message(
    model: MultimodalSpec,
    *,
    key: MessageKey,
    tensors: Mapping[str, torch.Tensor],
    lookup: Callable[[WorkId], SubMicrobatch],
    dtype: str,
) -> None:
    """Raise `MessageMismatchError` unless `tensors` match `batching.message_tensors` exactly."""
    shape = ParallelShape(dtype=dtype)
    expected = message_tensors(model, key=key, sub_lookup=lookup, shape=shape)
    got = [(n, tuple(t.shape), _DTYPE_NAMES.get(t.dtype, str(t.dtype))) for n, t in tensors.items()]
    want = [(s.name, s.shape, s.dtype) for s in expected]
    if sorted(got) != sorted(want):
        raise MessageMismatchError(f"message {key}: produced {got}, layout says {want}")


def _receive(outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the receiving rank holds: detached copies, differentiable where the sender's were."""
    received = {}
    for name, t in outputs.items():
        leaf = t.detach().clone()
        if t.requires_grad and t.is_floating_point():
            leaf.requires_grad_(True)
        received[name] = leaf
    return received


class LocalPipeline:
    """Every chunk of a model in one process, run stage by stage like the runtime."""

    def __init__(
        self,
        model: MultimodalSpec,
        chunks: Mapping[str, Sequence[ModelChunk]],
        *,
        config: ModelConfig,
        groups: ModelGroups,
        seq_length: int,
        seed: int,
        pad_multiple: int = 1,
    ) -> None:
        self.model, self.chunks, self.config, self.groups = model, dict(chunks), config, groups
        self.seq_length, self.seed, self.pad_multiple = seq_length, seed, pad_multiple

    @classmethod
    def build(
        cls,
        model: MultimodalSpec,
        *,
        config: ModelConfig,
        groups: ModelGroups,
        seq_length: int,
        seed: int,
        ranges: Mapping[str, Sequence[tuple[int, int]]] | None = None,
        pad_multiple: int = 1,
    ) -> LocalPipeline:
        """Build all chunks (`ranges[module]`: (start, end) per chunk; default one chunk).
        `pad_multiple`: sub-microbatches padded to a multiple of it, as under sequence
        parallelism (`batching.split_samples`)."""
        seed_model_parallel_rng(config.seed)
        ranges = dict(ranges or {})
        chunks = {
            m.name: build_module_chunks(
                model, m.name, ranges.get(m.name, [(0, m.num_layers)]), config=config, groups=groups
            )
            for m in model.modules
        }
        return cls(
            model,
            chunks,
            config=config,
            groups=groups,
            seq_length=seq_length,
            seed=seed,
            pad_multiple=pad_multiple,
        )

    def all_chunks(self) -> list[ModelChunk]:
        return [c for chunks in self.chunks.values() for c in chunks]

    def zero_grad(self) -> None:
        for chunk in self.all_chunks():
            chunk.zero_grad(set_to_none=True)

    def run_chunk(self, chunk: ModelChunk, inputs: list, batch, sub: SubMicrobatch) -> dict:
        """One chunk's forward on `sub` (a subclass may wrap it, e.g. to measure memory)."""
        del sub
        return chunk(inputs=inputs, batch=batch)

    def _run_sub(self, samples, sub: SubMicrobatch, produced, deps, lookup, stages) -> None:
        batch = build_sub_batch(
            self.model, samples, sub, seq_length=self.seq_length, seed=self.seed
        )
        chunks = self.chunks[sub.module]
        sources = [produced[p] for p in deps.get(sub.work, [])]
        for c, chunk in enumerate(chunks):
            stage = StageId(sub.module, c, sub.microbatch, sub.index)
            received = [_receive(s.outputs) for s in sources]
            for s, r in zip(sources, received):
                s.consumers.append(r)
            record = _Stage(stage, received, self.run_chunk(chunk, received, batch, sub))
            stages.append(record)
            if c + 1 < len(chunks):
                nxt = StageId(sub.module, c + 1, sub.microbatch, sub.index)
                key = MessageKey(MessageKind.ACTIVATION, stage, nxt)
                check_message(
                    self.model,
                    key=key,
                    tensors=record.outputs,
                    lookup=lookup,
                    dtype=self.config.dtype,
                )
            sources = [record]
        produced[sub.work] = sources[0]

    def forward(
        self, samples: Sequence[Sample], *, microbatch: int, sizes: Mapping[str, int] | None
    ) -> tuple[list[_Stage], torch.Tensor, torch.Tensor]:
        """Forward of one microbatch; returns its stages, summed loss and loss-token count."""
        subs = split_samples(
            self.model,
            samples,
            microbatch=microbatch,
            seq_length=self.seq_length,
            sizes=sizes,
            pad_multiple=self.pad_multiple,
        )
        lookup_table = {s.work: s for s in subs}

        def lookup(work: WorkId) -> SubMicrobatch:
            return lookup_table[work]

        deps: dict[WorkId, list[WorkId]] = defaultdict(list)
        for d in cross_module_dependencies(self.model, subs):
            deps[d.consumer].append(d.producer)
        produced: dict[WorkId, _Stage] = {}
        stages: list[_Stage] = []
        for module in self.model.modules:
            for sub in (s for s in subs if s.module == module.name):
                self._run_sub(samples, sub, produced, deps, lookup, stages)
        for work, stage in produced.items():
            for consumer in (c for c, ps in deps.items() if work in ps):
                key = MessageKey(
                    MessageKind.ACTIVATION,
                    stage.stage,
                    StageId(consumer.module, 0, consumer.microbatch, consumer.sub),
                )
                check_message(
                    self.model,
                    key=key,
                    tensors=stage.outputs,
                    lookup=lookup,
                    dtype=self.config.dtype,
                )
        losses = [produced[s.work].outputs for s in subs if s.module == self.model.loss_module.name]
        loss = torch.stack([o["loss"] for o in losses]).sum()
        num_tokens = torch.stack([o["num_tokens"] for o in losses]).sum()
        return stages, loss, num_tokens

    @staticmethod
    def _backward(stages: list[_Stage], loss: torch.Tensor) -> None:
        """Backward of the loss, then of every stage in reverse, from its consumers' grads."""
        if loss.requires_grad:
            loss.backward()
        for record in reversed(stages):
            outs, grads = record.output_grads()
            if outs:
                torch.autograd.backward(outs, grads)

    def forward_backward(
        self,
        microbatches: Sequence[Sequence[Sample]],
        *,
        sizes: Mapping[str, int] | None = None,
        per_token_loss: bool = False,
    ) -> torch.Tensor:
        """Loss of a global batch (normalised as the module docstring says) and its gradients.

        Gradients accumulate into the chunks' parameters (call `zero_grad()` first).
        """
        runs = [self.forward(s, microbatch=i, sizes=sizes) for i, s in enumerate(microbatches)]
        total_tokens = sum(int(n) for _, _, n in runs)
        loss_value = torch.zeros((), dtype=torch.float64)
        for stages, loss, num in runs:
            if per_token_loss:
                scale = 1.0 / max(total_tokens, 1)
            else:
                scale = 1.0 / (max(int(num), 1) * len(runs))
            scaled = loss * scale
            loss_value += scaled.detach().to(torch.float64).cpu()
            self._backward(stages, scaled)
        tied = self.groups.embedding
        if tied is not None:
            reduce_tied_embedding_grads(self.all_chunks(), group=tied)
        return loss_value

    def grads(self) -> dict[str, torch.Tensor]:
        """Gradient of every trainable parameter by global name (zeros where unused)."""
        out: dict[str, torch.Tensor] = {}
        for chunk in self.all_chunks():
            for local, p in chunk.named_parameters():
                if not p.requires_grad:
                    continue
                name = global_param_name(chunk, local)
                if name not in out:
                    out[name] = (
                        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                    )
        return out

    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter by global name."""
        return {
            global_param_name(c, n): p.detach().clone()
            for c in self.all_chunks()
            for n, p in c.named_parameters()
        }


def reference_loss_and_grads(
    model: MultimodalSpec,
    samples_per_microbatch: Sequence[Sequence[Sample]],
    *,
    seed: int,
    seq_length: int,
    groups: ModelGroups,
    config: ModelConfig | None = None,
    sizes: Mapping[str, int] | None = None,
    ranges: Mapping[str, Sequence[tuple[int, int]]] | None = None,
    per_token_loss: bool = False,
    pad_multiple: int = 1,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the whole model on a global batch, in one process, not pipelined.

    `seed` seeds the diffusion noise/timesteps; the weights come from `config.seed`
    (default `ModelConfig(seed=seed)`). `groups` must be of size 1 (e.g. a 1-process gloo
    world). Gradients are keyed by `global_param_name`, so any pipelined layout can be compared.
    `pad_multiple`: pad every sub-microbatch to a multiple of it (padding changes nothing).
    """
    config = config or ModelConfig(seed=seed)
    pipe = LocalPipeline.build(
        model,
        config=config,
        groups=groups,
        seq_length=seq_length,
        seed=seed,
        ranges=ranges,
        pad_multiple=pad_multiple,
    )
    loss = pipe.forward_backward(samples_per_microbatch, sizes=sizes, per_token_loss=per_token_loss)
    return float(loss), pipe.grads()
