"""Modality-specific sub-microbatches and their cross-module dependencies, from metadata only.

A microbatch holding N_i instances of modality i (images, clips, captions, sequences) is split
into M_i = ceil(N_i / B_i) sub-microbatches of consecutive instances, sizes differing by at most
one (a balanced ceil split). Dependencies: every ViT sub-microbatch of a microbatch feeds that
microbatch's LLM sequence; a DiT sub-microbatch needs the text-encoder sub-microbatches holding the
captions of its clips.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..data.sample import SampleMeta
from ..modelspec import ModuleKind, ModuleSpec, MultimodalSpec
from ..schedule.ir import Dependency, MicrobatchInfo, SubMicrobatch, WorkId


@dataclass(frozen=True)
class Instance:
    """One instance of a module inside a microbatch: owning sample and token count."""

    sample_index: int  # position of the sample inside the microbatch
    tokens: int


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (>= 1)."""
    return -(-value // multiple) * multiple


def module_instances(
    module: ModuleSpec, samples: Sequence[SampleMeta], *, seq_length: int
) -> list[Instance]:
    """The instances `module` computes on for one microbatch, in data order."""
    if module.kind is ModuleKind.LLM:
        # One packed sequence of the samples' text; the runtime pads it to seq_length (see
        # split_microbatch), and the padding attends only to itself.
        return [Instance(-1, sum(s.text_tokens for s in samples))]
    if module.kind is ModuleKind.TEXT_ENCODER:
        return [Instance(i, s.text_tokens) for i, s in enumerate(samples)]
    return [Instance(i, t) for i, s in enumerate(samples) for t in s.vision_tokens]


def split_sizes(count: int, max_size: int) -> list[int]:
    """Balanced split of `count` items into ceil(count / max_size) groups."""
    if max_size < 1:
        raise ValueError(f"sub-microbatch size must be >= 1, got {max_size}")
    if count == 0:
        return []
    groups = math.ceil(count / max_size)
    base, extra = divmod(count, groups)
    return [base + (1 if g < extra else 0) for g in range(groups)]


def _attention_pairs(
    module: ModuleSpec, samples: Sequence[SampleMeta], items: Sequence[Instance], seq_length: int
) -> int:
    if module.kind is ModuleKind.LLM:
        docs = [s.text_tokens for s in samples]
        pad = seq_length - sum(docs)
        return sum(d * d for d in docs) + pad * pad
    return sum(i.tokens * i.tokens for i in items)


@dataclass(frozen=True)
class MicrobatchWork:
    """The sub-microbatches and dependencies of one microbatch."""

    info: MicrobatchInfo
    submicrobatches: tuple[SubMicrobatch, ...]
    dependencies: tuple[Dependency, ...]


def split_microbatch(
    model: MultimodalSpec,
    samples: Sequence[SampleMeta],
    *,
    index: int,
    seq_length: int,
    sub_sizes: Mapping[str, int],
    pad_multiple: int = 1,
) -> MicrobatchWork:
    """Sub-microbatches of every module for microbatch `index` and their dependencies."""
    text = sum(s.text_tokens for s in samples)
    if model.loss_module.kind is ModuleKind.LLM and text > seq_length:
        raise ValueError(
            f"microbatch {index}: {text} text tokens exceed --seq-length {seq_length} "
            f"(samples {[s.sample_id for s in samples]})"
        )
    subs: list[SubMicrobatch] = []
    owner: dict[str, list[list[int]]] = {}  # module -> per sub, sample indices it covers
    for module in model.modules:
        items = module_instances(module, samples, seq_length=seq_length)
        size = 1 if module.kind is ModuleKind.LLM else sub_sizes[module.name]
        start = 0
        owner[module.name] = []
        for k, n in enumerate(split_sizes(len(items), size)):
            part = items[start : start + n]
            tokens = sum(i.tokens for i in part)
            padded = seq_length if module.kind is ModuleKind.LLM else tokens
            subs.append(
                SubMicrobatch(
                    module.name,
                    index,
                    k,
                    start,
                    start + n,
                    tokens,
                    round_up(padded, pad_multiple),
                    _attention_pairs(module, samples, part, seq_length),
                )
            )
            owner[module.name].append(sorted({i.sample_index for i in part}))
            start += n
    deps = _dependencies(model, index, owner)
    info = MicrobatchInfo(index, tuple(s.sample_id for s in samples), seq_length)
    return MicrobatchWork(info, tuple(subs), tuple(deps))


def _dependencies(
    model: MultimodalSpec, index: int, owner: Mapping[str, list[list[int]]]
) -> list[Dependency]:
    deps = []
    for producer in model.modules:
        if producer.feeds is None:
            continue
        consumer = model.module(producer.feeds)
        for cs, c_samples in enumerate(owner[consumer.name]):
            for ps, p_samples in enumerate(owner[producer.name]):
                # An LLM sequence (sample index -1) takes every vision sub-microbatch; otherwise
                # a consumer needs the producer sub-microbatches of the same samples.
                if c_samples == [-1] or set(c_samples) & set(p_samples):
                    deps.append(
                        Dependency(
                            WorkId(producer.name, index, ps), WorkId(consumer.name, index, cs)
                        )
                    )
    return deps


def choose_sub_size(
    cost_model,
    module: str,
    *,
    tokens_per_instance: int,
    max_size: int = 64,
    threshold: float = 0.95,
) -> int:
    """Smallest sub-microbatch size whose efficiency keeps `threshold` of the peak efficiency."""
    curve = [
        cost_model.efficiency(module, instances=b, tokens_per_instance=tokens_per_instance)
        for b in range(1, max_size + 1)
    ]
    peak = max(curve)
    return next(b for b, e in enumerate(curve, start=1) if e >= threshold * peak)
