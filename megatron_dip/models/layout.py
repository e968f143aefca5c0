"""What crosses chunk boundaries, and how instances map to sub-microbatches (torch-free).

The planner imports this module to fill plans; the runtime checks every sent tensor against
`message_tensors`; the chunks in this package produce exactly these tensors (tested).

Conventions (micro batch size 1, packed; Megatron's [seq, batch, hidden] layout):

* Instances, in microbatch order: ViT — the images of the microbatch's samples, sample by sample;
  LLM — one packed sequence per microbatch (a single sub-microbatch, instances [0, 1));
  text encoder — one caption per sample; DiT — one latent clip per sample, clip i conditioned on
  caption i.
* Chunk-to-chunk messages of one module: "hidden" [padded_tokens, 1, hidden] (padded_tokens
  divided by the tensor-parallel size under sequence parallelism). DiT messages also carry the
  conditioning every DiT layer needs: "temb" [clips, hidden] (timestep embedding), "cond"
  [caption tokens, 1, hidden] (projected text encoding of the producer captions, padding
  removed) and "cond_index" int64 [captions] (microbatch caption index of each caption in
  "cond", in order).
* Hand-overs between modules (producer's last chunk -> consumer's chunk 0): ViT -> LLM
  "embeddings" [sub tokens / merge^2, llm hidden] (one row per LLM image token); text encoder ->
  DiT "cond" [padded_tokens, 1, text hidden] and "cond_index" int64 [captions].
  A consumer chunk 0 receives one message per producer sub-microbatch, in producer order.
* Gradient messages carry the floating-point tensors of the activation message, same shapes.
* Sub-microbatches and dependencies are the planner's (`planner.submicrobatch`, pure functions
  on metadata; re-exported here for the models and tests): an LLM microbatch depends on every
  ViT sub-microbatch of that microbatch; a DiT sub-microbatch on every text sub-microbatch whose
  captions overlap its clips.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

from megatron_dip.data.sample import Sample, SampleMeta, loss_targets
from megatron_dip.modelspec import ModuleKind, ModuleSpec, MultimodalSpec
from megatron_dip.planner.submicrobatch import (
    cross_module_dependencies,  # noqa: F401 (re-export)
    instances_overlap,
    module_instances,
    split_microbatch,
)
from megatron_dip.schedule.ir import (
    MessageKey,
    MessageKind,
    SubMicrobatch,
    TensorSpec,
    WorkId,
)

INDEX_DTYPE = "int64"


def instance_tokens(module: ModuleSpec, samples: Sequence[Sample]) -> list[int]:
    """Tokens of each instance of `module` in a microbatch made of `samples` (see conventions)."""
    if module.kind is ModuleKind.LLM:
        return [sum(len(s.text) for s in samples)]
    if module.kind is ModuleKind.TEXT_ENCODER:
        return [len(s.text) for s in samples]
    p = module.patch_size
    if module.kind is ModuleKind.VIT:
        return [(img.shape[-2] // p) * (img.shape[-1] // p) for s in samples for img in s.images]
    counts = []
    for s in samples:
        if len(s.images) != 1:
            raise ValueError(
                f"sample {s.sample_id}: a text-to-video sample holds exactly one clip, "
                f"got {len(s.images)}"
            )
        frames, _, h, w = s.images[0].shape
        counts.append(frames * (h // p) * (w // p))
    return counts


def loss_tokens_of(
    model: MultimodalSpec, samples: Sequence[Sample], sub: SubMicrobatch | None = None
) -> int:
    """Tokens of `samples` (one microbatch, in order) that carry a loss: exactly the
    "num_tokens" the loss module's last chunk reports for them (torch-free).

    LLM: the next-token targets (`data.sample.loss_targets`: labelled, no image placeholder, not
    a sample's first token); DiT: every latent token of the clips (the flow-matching loss is
    summed over them). With `sub`, a sub-microbatch of the loss module, only its instances count
    (an LLM sub-microbatch is the whole microbatch). Equals the sum of the samples'
    `SampleMeta.loss_tokens`.
    """
    module = model.loss_module
    if sub is not None:
        if sub.module != module.name:
            raise ValueError(f"{sub.work} is not a sub-microbatch of loss module {module.name}")
        if module.kind is not ModuleKind.LLM:
            samples = samples[sub.instance_start : sub.instance_end]
    if module.kind is ModuleKind.LLM:
        return sum(int(loss_targets(s.text, s.labels_mask).sum()) for s in samples)
    return sum(instance_tokens(module, samples))


def _sample_meta(model: MultimodalSpec, sample: Sample) -> SampleMeta:
    """The token counts of `sample` that the split needs (as `instance_tokens` counts them)."""
    vision = next((m for m in model.modules if m.kind in (ModuleKind.VIT, ModuleKind.DIT)), None)
    counts = () if vision is None else tuple(instance_tokens(vision, [sample]))
    return SampleMeta(sample.sample_id, len(sample.text), counts)


def split_submicrobatches(
    model: MultimodalSpec,
    samples: Sequence[Sample],
    *,
    microbatch: int,
    seq_length: int,
    sizes: Mapping[str, int] | None = None,
    pad_multiple: int = 1,
) -> tuple[SubMicrobatch, ...]:
    """Sub-microbatches of every module for one microbatch: the planner's
    `split_microbatch` on the samples' token counts, so reference runs split exactly as plans do.

    `sizes[module]` instances per sub-microbatch at most (balanced split; default: all instances
    in one). The LLM always forms one sub-microbatch padded to `seq_length`; other modules are
    padded to a multiple of `pad_multiple` (the tensor-parallel size under sequence
    parallelism). A module without instances (no images) gets no sub-microbatch.
    """
    metas = [_sample_meta(model, s) for s in samples]
    counts = {m.name: len(module_instances(m, metas, seq_length=seq_length)) for m in model.modules}
    sub_sizes = {
        name: (sizes or {}).get(name, max(1, n))
        for name, n in counts.items()
        if model.module(name).kind is not ModuleKind.LLM
    }
    work = split_microbatch(
        model,
        metas,
        index=microbatch,
        seq_length=seq_length,
        sub_sizes=sub_sizes,
        pad_multiple=pad_multiple,
    )
    return work.submicrobatches


def _single_producer(model: MultimodalSpec, consumer: str) -> ModuleSpec:
    producers = model.producers_of(consumer)
    if len(producers) != 1:
        raise ValueError(
            f"model {model.name!r}: module {consumer!r} needs exactly one producer module, "
            f"has {[p.name for p in producers]}"
        )
    return producers[0]


def _seq(tokens: int, tensor_parallel: int, sequence_parallel: bool) -> int:
    if not sequence_parallel:
        return tokens
    if tokens % tensor_parallel:
        raise ValueError(
            f"{tokens} padded tokens do not divide by tensor parallel size {tensor_parallel} "
            "under sequence parallelism: pad sub-microbatches to a multiple of it"
        )
    return tokens // tensor_parallel


def dit_condition_producers(
    model: MultimodalSpec, dit_sub: SubMicrobatch, sub_lookup: Callable[[WorkId], SubMicrobatch]
) -> list[SubMicrobatch]:
    """The text sub-microbatches whose captions condition `dit_sub` (in index order).

    Text sub-microbatches of the microbatch are looked up as index 0, 1, ... until
    `sub_lookup` raises KeyError (as `Plan.submicrobatch` does).
    """
    text = _single_producer(model, dit_sub.module)
    found = []
    for k in itertools.count():
        try:
            sub = sub_lookup(WorkId(text.name, dit_sub.microbatch, k))
        except KeyError:
            break
        if instances_overlap(sub, dit_sub):
            found.append(sub)
    covered = sum(
        min(s.instance_end, dit_sub.instance_end) - max(s.instance_start, dit_sub.instance_start)
        for s in found
    )
    if covered != dit_sub.num_instances:
        raise ValueError(f"captions of {dit_sub.work} are not all produced by {text.name!r}")
    return found


def _intra_module(
    model: MultimodalSpec,
    module: ModuleSpec,
    sub: SubMicrobatch,
    sub_lookup: Callable[[WorkId], SubMicrobatch],
    dtype: str,
    seq: Callable[[int], int],
) -> list[TensorSpec]:
    hidden = module.layer.hidden
    specs = [TensorSpec("hidden", (seq(sub.padded_tokens), 1, hidden), dtype)]
    if module.kind is ModuleKind.DIT:
        producers = dit_condition_producers(model, sub, sub_lookup)
        cond_tokens = sum(p.tokens for p in producers)
        captions = sum(p.num_instances for p in producers)
        specs += [
            TensorSpec("temb", (sub.num_instances, hidden), dtype),
            TensorSpec("cond", (cond_tokens, 1, hidden), dtype),
            TensorSpec("cond_index", (captions,), INDEX_DTYPE),
        ]
    return specs


def _hand_over(module: ModuleSpec, sub: SubMicrobatch, dtype: str) -> list[TensorSpec]:
    if module.kind is ModuleKind.VIT:
        rows = sub.tokens // (module.merge * module.merge)
        return [TensorSpec("embeddings", (rows, module.out_hidden), dtype)]
    if module.kind is ModuleKind.TEXT_ENCODER:
        return [
            TensorSpec("cond", (sub.padded_tokens, 1, module.layer.hidden), dtype),
            TensorSpec("cond_index", (sub.num_instances,), INDEX_DTYPE),
        ]
    raise ValueError(f"module {module.name!r} ({module.kind.value}) hands nothing over")


def message_tensors(
    model: MultimodalSpec,
    *,
    key: MessageKey,
    sub_lookup: Callable[[WorkId], SubMicrobatch],
    dtype: str = "float32",
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
) -> tuple[TensorSpec, ...]:
    """Names, shapes and dtypes of the tensors of message `key`, in a fixed order.

    Activation messages carry all tensors, gradient messages the floating-point ones. The
    sub-microbatch of the producer stage sizes the message (DiT messages also need the text
    sub-microbatches of the microbatch, found through `sub_lookup`).
    """
    producer, consumer = key.producer, key.consumer
    module = model.module(producer.module)
    sub = sub_lookup(producer.work)

    def seq(n: int) -> int:
        return _seq(n, tensor_parallel, sequence_parallel)

    if producer.module == consumer.module:
        if consumer.chunk != producer.chunk + 1 or producer.work != consumer.work:
            raise ValueError(f"message {key} does not connect consecutive chunks of one stage")
        specs = _intra_module(model, module, sub, sub_lookup, dtype, seq)
    else:
        if module.feeds != consumer.module:
            raise ValueError(f"message {key}: {module.name!r} does not feed {consumer.module!r}")
        specs = _hand_over(module, sub, dtype)
    if key.kind is MessageKind.GRADIENT:
        specs = [s for s in specs if s.dtype != INDEX_DTYPE]
    return tuple(specs)


def message_nbytes(specs: Iterable[TensorSpec]) -> int:
    """Total bytes of a message's tensors."""
    return sum(s.nbytes for s in specs)
