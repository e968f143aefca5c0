"""Modality-specific sub-microbatches and their cross-module dependencies, from metadata only.

A microbatch holding N_i instances of module i (images, clips, captions, audio segments,
sequences: `Modality.microbatch_instances`) is split into M_i = ceil(N_i / B_i) sub-microbatches
of consecutive instances, sizes differing by at most one (a balanced ceil split); a module whose
modality runs the whole microbatch at once (the LLM: one packed sequence) forms one. A consumer
sub-microbatch depends on the producer sub-microbatches of its microbatch that its modality says
it consumes (`Modality.consumes`: an LLM microbatch on every sub-microbatch of every producer,
ViT and audio encoder alike; a DiT sub-microbatch on the text sub-microbatches holding its clips'
captions).

These pure functions are the one definition of the split: the planner, the training loop, the
stock baselines, the simulation and the reference models all reach them through
`layout.layout_batch` (or `split_samples` for samples with arrays).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from megatron_dip.modalities import SampleInfo, modality_of
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.schedule.ir import Dependency, MicrobatchInfo, SubMicrobatch

WHOLE = 10**9  # "every instance in one sub-microbatch" (Megatron runs a module's share at once)


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (>= 1)."""
    return -(-value // multiple) * multiple


def split_sizes(count: int, max_size: int) -> list[int]:
    """Balanced split of `count` items into ceil(count / max_size) groups."""
    if max_size < 1:
        raise ValueError(f"sub-microbatch size must be >= 1, got {max_size}")
    if count == 0:
        return []
    groups = math.ceil(count / max_size)
    base, extra = divmod(count, groups)
    return [base + (1 if g < extra else 0) for g in range(groups)]


@dataclass(frozen=True)
class MicrobatchWork:
    """The sub-microbatches and dependencies of one microbatch."""

    info: MicrobatchInfo
    submicrobatches: tuple[SubMicrobatch, ...]
    dependencies: tuple[Dependency, ...]


def split_microbatch(
    model: MultimodalSpec,
    samples: Sequence[SampleInfo],
    *,
    index: int,
    seq_length: int,
    sub_sizes: Mapping[str, int],
    pad_multiple: int = 1,
) -> MicrobatchWork:
    """Sub-microbatches of every module for microbatch `index` and their dependencies.

    `sub_sizes[module]`: at most this many instances per sub-microbatch of each module that is
    split (balanced split; `WHOLE`: one). Sub-microbatches are padded to a multiple of
    `pad_multiple` (the tensor-parallel size under sequence parallelism). A module without
    instances (no images) gets no sub-microbatch.
    """
    for m in model.modules:
        modality_of(m).check_microbatch(
            m, model, samples, index=index, seq_length=seq_length, pad=pad_multiple
        )
    subs: list[SubMicrobatch] = []
    for m in model.modules:
        modality = modality_of(m)
        items = modality.microbatch_instances(m, samples, seq_length=seq_length)
        size = 1 if modality.whole_microbatch else sub_sizes[m.name]
        start = 0
        for k, n in enumerate(split_sizes(len(items), size)):
            part = items[start : start + n]
            tokens = sum(i.tokens for i in part)
            padded = modality.padded_tokens(m, tokens, seq_length=seq_length)
            pairs = modality.attention_pairs(m, samples, part, seq_length=seq_length)
            context, context_pairs = modality.context(m, samples, part)
            subs.append(
                SubMicrobatch(
                    m.name,
                    index,
                    k,
                    start,
                    start + n,
                    tokens,
                    round_up(padded, pad_multiple),
                    pairs,
                    context_tokens=context,
                    context_pairs=context_pairs,
                )
            )
            start += n
    deps = cross_module_dependencies(model, subs)
    subs = with_input_tokens(model, subs, deps)
    info = MicrobatchInfo(index, tuple(s.sample_id for s in samples), seq_length)
    return MicrobatchWork(info, tuple(subs), deps)


def with_input_tokens(
    model: MultimodalSpec, subs: Sequence[SubMicrobatch], deps: Iterable[Dependency]
) -> list[SubMicrobatch]:
    """`subs` with `input_tokens` set: the rows of the hand-overs of the producer
    sub-microbatches each one depends on (what its first chunk receives)."""
    by_work = {s.work: s for s in subs}
    rows: dict = defaultdict(int)
    for d in deps:
        producer = by_work[d.producer]
        rows[d.consumer] += modality_of(model.module(producer.module)).hand_over_rows(
            model.module(producer.module), producer
        )
    return [replace(s, input_tokens=rows[s.work]) if rows.get(s.work) else s for s in subs]


def cross_module_dependencies(
    model: MultimodalSpec, submicrobatches: Iterable[SubMicrobatch]
) -> tuple[Dependency, ...]:
    """The hand-over dependencies of these sub-microbatches (module docstring): for every
    consumer sub-microbatch, each producer module's sub-microbatches of the same microbatch that
    the consumer's modality consumes, producers in model order."""
    by_key: dict[tuple[str, int], list[SubMicrobatch]] = defaultdict(list)
    for s in submicrobatches:
        by_key[(s.module, s.microbatch)].append(s)
    deps: list[Dependency] = []
    for (name, mb), consumers in sorted(by_key.items()):
        modality = modality_of(model.module(name))
        producers = model.producers_of(name)
        for c in sorted(consumers, key=lambda s: s.index):
            for producer in producers:
                produced = sorted(by_key.get((producer.name, mb), []), key=lambda s: s.index)
                deps += [Dependency(p.work, c.work) for p in produced if modality.consumes(p, c)]
    return tuple(deps)
