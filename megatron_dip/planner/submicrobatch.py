"""Modality-specific sub-microbatches and their cross-module dependencies, from metadata only.

A microbatch holding N_i instances of modality i (images, clips, captions, sequences) is split
into M_i = ceil(N_i / B_i) sub-microbatches of consecutive instances, sizes differing by at most
one (a balanced ceil split). Dependencies: every ViT sub-microbatch of a microbatch feeds that
microbatch's LLM sequence; a DiT sub-microbatch needs the text-encoder sub-microbatches holding the
captions of its clips (clip i of a microbatch is conditioned on caption i: one clip per sample).

These pure functions on metadata are the one definition of the split: `models.layout` applies
them to samples with arrays, so the planner, the runtime and the reference models agree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..data.sample import SampleMeta
from ..modelspec import ModuleKind, ModuleSpec, MultimodalSpec
from ..schedule.ir import Dependency, MicrobatchInfo, SubMicrobatch


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
    """Sub-microbatches of every module for microbatch `index` and their dependencies.

    `sub_sizes[module]`: at most this many instances per sub-microbatch of each non-LLM module
    (balanced split). The LLM forms one sub-microbatch padded to `seq_length`; other modules are
    padded to a multiple of `pad_multiple` (the tensor-parallel size under sequence
    parallelism). A module without instances (no images) gets no sub-microbatch.
    """
    _check_microbatch(model, samples, index=index, seq_length=seq_length, pad=pad_multiple)
    subs: list[SubMicrobatch] = []
    for module in model.modules:
        items = module_instances(module, samples, seq_length=seq_length)
        size = 1 if module.kind is ModuleKind.LLM else sub_sizes[module.name]
        start = 0
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
            start += n
    deps = cross_module_dependencies(model, subs)
    info = MicrobatchInfo(index, tuple(s.sample_id for s in samples), seq_length)
    return MicrobatchWork(info, tuple(subs), deps)


def _check_microbatch(
    model: MultimodalSpec, samples: Sequence[SampleMeta], *, index: int, seq_length: int, pad: int
) -> None:
    """Clear errors for microbatches the split cannot represent."""
    ids = [s.sample_id for s in samples]
    if model.loss_module.kind is ModuleKind.LLM:
        text = sum(s.text_tokens for s in samples)
        if text > seq_length:
            raise ValueError(
                f"microbatch {index}: {text} text tokens exceed --seq-length {seq_length} "
                f"(samples {ids})"
            )
        if seq_length % pad:
            # The LLM sequence is split over the tensor-parallel ranks; padding it beyond
            # seq_length would feed the model more positions than it was built for.
            raise ValueError(
                f"--seq-length {seq_length} must be a multiple of the tensor-parallel size {pad} "
                "under sequence parallelism"
            )
    if model.loss_module.kind is ModuleKind.DIT:
        # Clip i is conditioned on caption i (see models.layout), so one clip per sample.
        bad = [s.sample_id for s in samples if s.num_instances != 1]
        if bad:
            raise ValueError(
                f"microbatch {index}: text-to-video samples {bad} do not hold exactly one clip"
            )


def instances_overlap(a: SubMicrobatch, b: SubMicrobatch) -> bool:
    """Whether two sub-microbatches of one microbatch share an instance index."""
    return a.instance_start < b.instance_end and b.instance_start < a.instance_end


def cross_module_dependencies(
    model: MultimodalSpec, submicrobatches: Iterable[SubMicrobatch]
) -> tuple[Dependency, ...]:
    """The hand-over dependencies of these sub-microbatches: an LLM microbatch depends on every
    ViT sub-microbatch of that microbatch; a DiT sub-microbatch on every text sub-microbatch whose
    captions overlap its clips (instance ranges; clip i belongs to caption i)."""
    by_key: dict[tuple[str, int], list[SubMicrobatch]] = defaultdict(list)
    for s in submicrobatches:
        by_key[(s.module, s.microbatch)].append(s)
    deps: list[Dependency] = []
    for (name, mb), consumers in sorted(by_key.items()):
        producers = model.producers_of(name)
        if not producers:
            continue
        if len(producers) != 1:
            raise ValueError(
                f"model {model.name!r}: module {name!r} needs exactly one producer module, "
                f"has {[p.name for p in producers]}"
            )
        producer = producers[0]
        produced = sorted(by_key.get((producer.name, mb), []), key=lambda s: s.index)
        for c in sorted(consumers, key=lambda s: s.index):
            for p in produced:
                if producer.kind is ModuleKind.VIT or instances_overlap(p, c):
                    deps.append(Dependency(p.work, c.work))
    return tuple(deps)


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
