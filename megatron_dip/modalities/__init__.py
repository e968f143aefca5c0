"""The modality kinds: one file each, one `Modality` protocol, one registry (torch-free).

A module's kind ("vit", "llm", "text_encoder", "dit", "audio") names its modality; everything
that depends on the kind — what an instance is, its token arithmetic, packing demand, messages,
costs, chunk and loss — lives in that modality's file (`base.py` documents the protocol). The
rest of the package asks the registry (`modality_of(spec)`) instead of branching on kinds.
Importing this package imports no torch: the torch parts of a modality are imported inside the
methods that need them.

Adding a modality: one file here with a `Modality` subclass registered by kind, an import line
below, a preset that uses the kind (`modelspec.py`), and data that carries its instances.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.schedule.ir import ChunkSpec, SubMicrobatch

from . import audio, dit, llm, text_encoder, vit  # noqa: F401  (registers the built-in kinds)
from .base import (
    InstanceCounts,
    Modality,
    SampleArrays,
    SampleInfo,
    instances_overlap,
)
from .registry import (
    check_model,
    known_kinds,
    media_modules,
    modality,
    modality_of,
    register,
    text_module,
)
from .scatter import ScatterProducer, scatter_name

__all__ = [
    "InstanceCounts",
    "Modality",
    "SampleArrays",
    "SampleInfo",
    "ScatterProducer",
    "build_chunk",
    "build_sub_batch",
    "check_model",
    "instances_overlap",
    "known_kinds",
    "media_modules",
    "modality",
    "modality_of",
    "register",
    "scatter_name",
    "text_module",
]


def build_chunk(
    model: MultimodalSpec,
    chunk: ChunkSpec,
    *,
    num_chunks: int,
    config,
    groups,
    shape=None,
    skip_init=None,
):
    """`models.chunk.build_chunk` with the module's modality (call on the owning rank);
    `shape`: the run's `parallel.ParallelShape` (None: `groups`' TP, no sequence parallelism)."""
    from megatron_dip.models.chunk import build_chunk as build

    parts = modality_of(model.module(chunk.module))
    return build(
        model,
        chunk,
        num_chunks=num_chunks,
        config=config,
        groups=groups,
        parts=parts,
        shape=shape,
        skip_init=skip_init,
    )


def build_module_chunks(
    model: MultimodalSpec, module: str, ranges, *, config, groups, shape=None
) -> list:
    """All chunks of one module in this process, cut at `ranges` ((start, end) per chunk)."""
    from megatron_dip.models.chunk import build_module_chunks as build

    parts = modality_of(model.module(module))
    return build(model, module, ranges, config=config, groups=groups, parts=parts, shape=shape)


def build_sub_batch(
    model: MultimodalSpec,
    samples: Sequence[SampleArrays],
    sub: SubMicrobatch,
    *,
    seq_length: int,
    seed: int,
):
    """The `models.batch.SubBatch` of sub-microbatch `sub`, given all samples of its microbatch
    in order. The token counts of `sub` must match the samples (a plan made for other data is
    refused); `seed` seeds the diffusion noise together with each sample's id."""
    spec = model.module(sub.module)
    return modality_of(spec).build_sub_batch(
        spec, model, samples, sub, seq_length=seq_length, seed=seed
    )
