"""One batch -> work pipeline: batch -> replicas -> microbatches -> sub-microbatches -> totals.

`layout_batch` is the one place where a global batch's metadata becomes the work of every
data-parallel replica; the DIP planner, the training loop (DIP and the stock baselines), the
simulation study and the reference runs use it, with one `packing_limits`. Two ways to give the
replicas their share:

* DIP (`cost` given): the samples are balanced over the replicas by estimated cost
  (`data.packing.split_replicas`), then each replica packs its share;
* Megatron (no `cost`): the global batch is packed once and every replica takes an equal,
  contiguous share of the microbatches (G / DP each, the first ones one more when uneven).

Message shapes of the work are `messages.MessageShapes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_dip.data.packing import PackingLimits, pack_microbatches, split_replicas
from megatron_dip.data.sample import BatchMeta, SampleMeta
from megatron_dip.modalities import modality_of
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.schedule.ir import BatchTotals, Dependency, MicrobatchInfo, SubMicrobatch

from .split import WHOLE, MicrobatchWork, split_microbatch

SampleCost = Callable[[SampleMeta], float]


def packing_limits(model: MultimodalSpec, seq_length: int) -> PackingLimits:
    """What one microbatch of `model` holds: its loss module's modality's caps (a VLM's packed
    sequence of `seq_length` tokens; text-to-video: <= 8 clips, 64 latent frames, captions
    within `seq_length`)."""
    loss = model.loss_module
    return PackingLimits(**modality_of(loss).packing_caps(loss, seq_length=seq_length))


@dataclass(frozen=True)
class LayoutConfig:
    """How a run cuts batches: sequence length, packing, sub-microbatch sizes per split module
    (missing ones: all instances in one), padding multiple (the TP size under sequence
    parallelism) and data-parallel size."""

    seq_length: int
    packing: PackingLimits
    sub_sizes: Mapping[str, int] = field(default_factory=dict)
    pad_multiple: int = 1
    data_parallel: int = 1

    def with_whole_modules(self) -> LayoutConfig:
        """The same layout with every module's instances in one sub-microbatch (Megatron)."""
        return replace(self, sub_sizes={})


@dataclass(frozen=True)
class ReplicaLayout:
    """One replica's microbatches (their samples) and their work."""

    replica: int
    microbatches: tuple[tuple[SampleMeta, ...], ...]
    works: tuple[MicrobatchWork, ...]

    @property
    def infos(self) -> tuple[MicrobatchInfo, ...]:
        return tuple(w.info for w in self.works)

    @property
    def submicrobatches(self) -> tuple[SubMicrobatch, ...]:
        return tuple(s for w in self.works for s in w.submicrobatches)

    @property
    def dependencies(self) -> tuple[Dependency, ...]:
        return tuple(d for w in self.works for d in w.dependencies)

    def sub_of(self) -> dict:
        """Sub-microbatch by `WorkId`."""
        return {s.work: s for s in self.submicrobatches}

    @property
    def samples(self) -> tuple[SampleMeta, ...]:
        return tuple(s for mb in self.microbatches for s in mb)


@dataclass(frozen=True)
class BatchLayout:
    """A global batch laid out over the data-parallel replicas, with the global denominators."""

    iteration: int
    replicas: tuple[ReplicaLayout, ...]
    totals: BatchTotals


def split_microbatches(
    model: MultimodalSpec,
    microbatches: Sequence[Sequence[SampleMeta]],
    config: LayoutConfig,
) -> tuple[MicrobatchWork, ...]:
    """Each microbatch (its samples, in order) cut into sub-microbatches, numbered in order."""
    sizes = {m.name: config.sub_sizes.get(m.name, WHOLE) for m in model.modules}
    return tuple(
        split_microbatch(
            model,
            samples,
            index=i,
            seq_length=config.seq_length,
            sub_sizes=sizes,
            pad_multiple=config.pad_multiple,
        )
        for i, samples in enumerate(microbatches)
    )


def pack(samples: Sequence[SampleMeta], limits: PackingLimits) -> list[tuple[SampleMeta, ...]]:
    """`samples` packed into microbatches (their samples, in order)."""
    by_id = {s.sample_id: s for s in samples}
    return [
        tuple(by_id[i] for i in mb.sample_ids) for mb in pack_microbatches(samples, limits=limits)
    ]


def _replica_microbatches(
    batch: BatchMeta, config: LayoutConfig, cost: SampleCost | None
) -> list[list[tuple[SampleMeta, ...]]]:
    if not batch.samples:
        raise ValueError(f"iteration {batch.iteration}: empty batch")
    dp = config.data_parallel
    if cost is not None:
        shares = split_replicas(list(batch.samples), num_replicas=dp, cost=cost)
        return [pack(share, config.packing) for share in shares]
    packed = pack(list(batch.samples), config.packing)
    return [[packed[int(i)] for i in part] for part in np.array_split(np.arange(len(packed)), dp)]


def layout_batch(
    model: MultimodalSpec,
    batch: BatchMeta,
    config: LayoutConfig,
    *,
    cost: SampleCost | None = None,
) -> BatchLayout:
    """Every replica's microbatches and sub-microbatches of `batch`, and the batch totals (see
    the module docstring for `cost`)."""
    per_replica = _replica_microbatches(batch, config, cost)
    replicas = tuple(
        ReplicaLayout(r, tuple(mbs), split_microbatches(model, mbs, config))
        for r, mbs in enumerate(per_replica)
    )
    totals = BatchTotals(
        num_microbatches=sum(len(r.works) for r in replicas),
        num_samples=batch.num_samples,
        num_loss_tokens=sum(s.loss_tokens for s in batch.samples),
        data_parallel_size=config.data_parallel,
    )
    return BatchLayout(batch.iteration, replicas, totals)


def resplit(model: MultimodalSpec, replica: ReplicaLayout, config: LayoutConfig) -> ReplicaLayout:
    """The same microbatches of `replica` cut with `config`'s sub-microbatch sizes."""
    return replace(replica, works=split_microbatches(model, replica.microbatches, config))
