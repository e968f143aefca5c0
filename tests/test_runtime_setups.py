"""Helpers, no tests: tiny models, uneven batches, placements and plans of the runtime tests.

(Named test_runtime_*.py to sit with the runtime's tests; a `tests/dist/` package would be
matched by the repository's `.gitignore` rule `dist/`.)

Everything here is deterministic, so every worker process builds identical objects (plans made
by the searched planner are built once on rank 0 and broadcast instead).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from megatron_dip.batching import cross_module_dependencies, message_tensors, split_samples
from megatron_dip.data.sample import Sample, SampleMeta
from megatron_dip.data.synthetic import MixtureSpec, SourceSpec, generate_samples
from megatron_dip.models import ModelConfig
from megatron_dip.modelspec import MultimodalSpec, tiny_omni, tiny_t2v, tiny_vlm
from megatron_dip.parallel import ParallelShape
from megatron_dip.schedule import (
    BatchTotals,
    ChunkSpec,
    Forward,
    MemoryPolicy,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Plan,
    Program,
    Recompute,
    build_megatron_plan,
    build_segment_plan,
)

SEQ = 48
SEED = 11
CFG = ModelConfig(dtype="float64", adaln_zero=False, seed=7)

# VLM samples: 0-6 images (16x16 px = 4 ViT patches = 1 LLM token) interleaved in 2-10 text
# tokens. T2V samples: a caption of 2-9 tokens and one clip of 1-3 latent frames of 4x4 or 4x6.
VLM_MIX = MixtureSpec(
    "test-vlm", "vlm", (SourceSpec("docs", 1.0, (2, 10), (0, 6), "interleaved"),), image_grid=1
)
T2V_MIX = MixtureSpec(
    "test-t2v",
    "diffusion",
    (SourceSpec("clips", 1.0, (2, 9), (1, 1), seconds=(0.05, 0.6)),),
    frame_grids=((2, 2), (2, 3)),
)
# Omni samples: 0-2 images and 0-2 audio segments of 4-20 mel frames (1-5 LLM tokens each) in
# 2-10 text tokens: some with images, some with audio, some with both, some with neither.
OMNI_MIX = MixtureSpec(
    "test-omni",
    "vlm",
    (
        SourceSpec(
            "av", 1.0, (2, 10), (0, 2), "interleaved", audio=(0, 2), audio_seconds=(0.04, 0.2)
        ),
    ),
    image_grid=1,
)
MIXES = {"vlm": VLM_MIX, "omni": OMNI_MIX}


def model_of(kind: str) -> MultimodalSpec:
    """ "vlm", "omni" (ViT + audio encoder + LLM), "t2v" (trainable text encoder) or
    "t2v-frozen"."""
    if kind == "vlm":
        return tiny_vlm()
    if kind == "omni":
        return tiny_omni()
    return tiny_t2v(train_text=kind != "t2v-frozen")


@functools.cache
def samples(kind: str, count: int, start: int = 0) -> tuple[Sample, ...]:
    mix = MIXES.get(kind, T2V_MIX)
    return tuple(
        generate_samples(mix, model=model_of(kind), num_samples=count, seed=SEED, start=start)
    )


def group_samples(items: Sequence[Sample], counts: Sequence[int]) -> list[list[Sample]]:
    """Consecutive groups of `counts[i]` samples (one group per microbatch)."""
    out, at = [], 0
    for n in counts:
        out.append(list(items[at : at + n]))
        at += n
    return out


@dataclass(frozen=True)
class Batch:
    """One replica's microbatches, sub-microbatches and dependencies, and global totals."""

    kind: str
    model: MultimodalSpec
    microbatches: tuple[tuple[Sample, ...], ...]
    infos: tuple[MicrobatchInfo, ...]
    subs: tuple
    deps: tuple
    totals: BatchTotals
    sequence_parallel: int = 0  # the TP size activations are divided by (0: no SP)

    @property
    def by_index(self) -> dict[int, list[Sample]]:
        return {i.index: list(mb) for i, mb in zip(self.infos, self.microbatches)}

    def tensor_fn(self, plan: Plan | None = None) -> Callable:
        """Message shapes from the model for this batch's sub-microbatches, or for `plan`'s
        (a plan may cut the same microbatches differently, e.g. Megatron's order merges them)."""
        subs = plan.submicrobatches if plan is not None else self.subs
        return functools.partial(
            _tensors, self.model, {s.work: s for s in subs}, self.sequence_parallel
        )


def _tensors(model, table, sp_tp, key):
    shape = ParallelShape(tp=max(sp_tp, 1), sp=sp_tp > 1, dtype=CFG.dtype)
    return message_tensors(model, key=key, sub_lookup=table.__getitem__, shape=shape)


def loss_tokens(model: MultimodalSpec, microbatches: Sequence[Sequence[Sample]]) -> int:
    """From the metadata, as the planner counts (the executor checks each chunk's count)."""
    return sum(sample_meta(model, s).loss_tokens for mb in microbatches for s in mb)


def make_batch(
    kind: str,
    microbatches: Sequence[Sequence[Sample]],
    *,
    sizes: Mapping[str, int] | None = None,
    all_microbatches: Sequence[Sequence[Sample]] | None = None,
    data_parallel: int = 1,
    sequence_parallel: int = 0,
) -> Batch:
    """This replica's `microbatches`; totals over `all_microbatches` (default: these).
    `sequence_parallel`: the TP size under sequence parallelism (sub-microbatches padded to a
    multiple of it, message shapes divided by it); 0 without."""
    model = model_of(kind)
    everything = list(all_microbatches or microbatches)
    subs = tuple(
        s
        for i, mb in enumerate(microbatches)
        for s in split_samples(
            model,
            mb,
            microbatch=i,
            seq_length=SEQ,
            sizes=sizes,
            pad_multiple=max(sequence_parallel, 1),
        )
    )
    infos = tuple(
        MicrobatchInfo(i, tuple(s.sample_id for s in mb), SEQ) for i, mb in enumerate(microbatches)
    )
    totals = BatchTotals(
        num_microbatches=len(everything),
        num_samples=sum(len(mb) for mb in everything),
        num_loss_tokens=loss_tokens(model, everything),
        data_parallel_size=data_parallel,
    )
    return Batch(
        kind,
        model,
        tuple(tuple(mb) for mb in microbatches),
        infos,
        subs,
        cross_module_dependencies(model, subs),
        totals,
        sequence_parallel,
    )


def even_ranges(num_layers: int, num_chunks: int) -> list[tuple[int, int]]:
    cuts = [round(i * num_layers / num_chunks) for i in range(num_chunks + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def dip_placement(model: MultimodalSpec, num_ranks: int, segments: Mapping[str, int]) -> Placement:
    """Every module over all ranks, `segments[m]` passes; chunk c on rank c mod P."""
    layouts = []
    for m in model.modules:
        n = num_ranks * segments[m.name]
        chunks = tuple(
            ChunkSpec(m.name, c, c % num_ranks, s, e)
            for c, (s, e) in enumerate(even_ranges(m.num_layers, n))
        )
        layouts.append(ModuleLayout(m.name, m.num_layers, m.trainable, chunks))
    return Placement(num_ranks, tuple(layouts))


def stock_placement(model: MultimodalSpec, num_ranks: int, vp: int) -> tuple[Placement, list]:
    """Megatron LLaVA-style: producers whole on rank 0 (one chunk each), the loss module cut
    into P*vp chunks (chunk c on rank c mod P); returns the placement and the stage units."""
    loss = model.loss_module
    producers = [m for m in model.modules if m is not loss]
    n = num_ranks * vp
    layouts = [
        *(
            ModuleLayout(
                p.name, p.num_layers, p.trainable, (ChunkSpec(p.name, 0, 0, 0, p.num_layers),)
            )
            for p in producers
        ),
        ModuleLayout(
            loss.name,
            loss.num_layers,
            loss.trainable,
            tuple(
                ChunkSpec(loss.name, c, c % num_ranks, s, e)
                for c, (s, e) in enumerate(even_ranges(loss.num_layers, n))
            ),
        ),
    ]
    units = [
        [
            ([(p.name, 0) for p in producers] if r == 0 and j == 0 else [])
            + [(loss.name, j * num_ranks + r)]
            for j in range(vp)
        ]
        for r in range(num_ranks)
    ]
    return Placement(num_ranks, tuple(layouts)), units


def rank_chunks(batch: Batch, placement: Placement, groups) -> list[torch.nn.Module]:
    """Rank 0's chunks of `placement`, built with `CFG` on the model groups `groups`."""
    from megatron_dip.modalities import build_chunk

    return [
        build_chunk(
            batch.model,
            c,
            num_chunks=placement.module(c.module).num_chunks,
            config=CFG,
            groups=groups,
        )
        for c in placement.chunks_on_rank(0)
    ]


def rank_runtime(batch: Batch, placement: Placement, chunks, *, pp_group, **options):
    """The `RankRuntime` of `chunks` on `pp_group`, fed with the batch's samples and holding
    plans to the model's message shapes; `options`: the rest of its keywords."""
    from megatron_dip.runtime.data import SampleBatchSource
    from megatron_dip.runtime.rank import RankRuntime

    return RankRuntime(
        placement=placement,
        pp_group=pp_group,
        chunks=chunks,
        batches=functools.partial(SampleBatchSource, model=batch.model, seq_length=SEQ, seed=SEED),
        tensor_fn_for=batch.tensor_fn,
        **options,
    )


def segment_plan(batch: Batch, placement: Placement) -> Plan:
    return build_segment_plan(
        placement=placement,
        microbatches=batch.infos,
        submicrobatches=batch.subs,
        dependencies=batch.deps,
        totals=batch.totals,
        tensors=batch.tensor_fn(),
    )


def megatron_plan(batch: Batch, placement: Placement, units, *, vp: int) -> Plan:
    return build_megatron_plan(
        placement=placement,
        stage_units=units,
        submicrobatches=batch.subs,
        dependencies=batch.deps,
        microbatches=batch.infos,
        totals=batch.totals,
        num_model_chunks=vp,
        tensors=batch.tensor_fn(),
    )


def with_recompute(plan: Plan, choose: Callable[[Forward], MemoryPolicy]) -> Plan:
    """The same plan with each Forward's memory policy set by `choose`."""
    programs = tuple(
        Program(
            p.rank,
            tuple(
                Forward(i.stage, choose(i)) if isinstance(i, Forward) else i for i in p.instructions
            ),
        )
        for p in plan.programs
    )
    return replace(plan, programs=programs, name=plan.name + "+recompute")


def cycle_recompute(ins: Forward) -> MemoryPolicy:
    """Every recompute mode in turn: none, full, selective, Megatron's block (first layer) and
    uniform (2-layer groups) methods, and cheap module recomputation (`MemoryPolicy.modules`)
    alone and in the layers block recomputation leaves."""
    modes = (
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.FULL, 0),
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.BLOCK, 1),
        MemoryPolicy(Recompute.UNIFORM, 2),
        MemoryPolicy(Recompute.NONE, 0, 0, ("layernorm", "mlp_act")),
        MemoryPolicy(Recompute.BLOCK, 1, 0, ("layernorm",)),
    )
    s = ins.stage
    return modes[(s.chunk + s.microbatch + s.sub) % len(modes)]


def cycle_policy(placement: Placement) -> Callable[[Forward], MemoryPolicy]:
    """`cycle_recompute`'s modes plus offload of one layer, alone and after block recompute of
    the first one (offload and recompute in one plan), as far as the chunk has the layers, and
    module recomputation (alone and with selective) beside them."""
    modes = (
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.FULL, 0),
        MemoryPolicy(Recompute.NONE, 0, 1),
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.BLOCK, 1, 1),
        MemoryPolicy(Recompute.BLOCK, 1),
        MemoryPolicy(Recompute.UNIFORM, 2),
        MemoryPolicy(Recompute.SELECTIVE, 0, 0, ("mlp_act",)),
        MemoryPolicy(Recompute.NONE, 0, 0, ("layernorm", "mlp_act")),
    )

    def choose(ins: Forward) -> MemoryPolicy:
        s = ins.stage
        policy = modes[(s.chunk + s.microbatch + s.sub) % len(modes)]
        return policy.fitted(placement.module(s.module).chunks[s.chunk].num_layers)

    return choose


def sample_meta(model: MultimodalSpec, sample: Sample) -> SampleMeta:
    from megatron_dip.data.meta import sample_meta as meta

    return meta(sample, model=model)


def dip_plan(
    batch: Batch, placement: Placement, *, memory_limit: float | None, receive_lead: int = 0
) -> Plan:
    """A searched DIP plan for `batch` (sub-microbatch sizes 2; recompute under the limit;
    `receive_lead` 1: receives posted one compute ahead, on per-pair channels)."""
    from megatron_dip.batching import split_microbatch
    from megatron_dip.planner.config import PlannerConfig
    from megatron_dip.planner.cost_model import CostModel
    from megatron_dip.planner.devices import get_device
    from megatron_dip.planner.dip import DipPlanner
    from megatron_dip.planner.search import SearchConfig

    model = batch.model
    cost = CostModel(model, get_device("h100"), dtype_bytes=8)
    sizes = {m.name: 2 for m in model.modules}
    config = PlannerConfig(
        shape=ParallelShape(dtype=CFG.dtype, seq_length=SEQ),
        sub_sizes=sizes,
        memory_limit_bytes=memory_limit,
        search=SearchConfig(max_rollouts=8, time_budget_s=60.0, seed=0),
        # These scenarios exercise DIP's own schedules (sub-microbatches, recompute), not the
        # Megatron-order candidate the planner may prefer on such tiny batches.
        megatron_candidate=False,
        receive_lead=receive_lead,
    )
    planner = DipPlanner(model, cost, placement, config)
    works = [
        split_microbatch(
            model,
            [sample_meta(model, s) for s in mb],
            index=i,
            seq_length=SEQ,
            sub_sizes=sizes,
        )
        for i, mb in enumerate(batch.microbatches)
    ]
    return planner.plan_replica(works, iteration=0, replica=0, totals=batch.totals).plan


def as_numpy(grads: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in grads.items()}


def split_plan(plan: Plan) -> Plan:
    """`plan` with its backwards split into B and W and explicit gradient reductions: the W of
    even microbatches right after its B, those of odd ones deferred to the end of the program
    (graphs held across other stages' backwards), as far as a W can move; every third
    microbatch's backwards stay fused (a mixed plan, as the planner makes at its memory
    limit)."""
    from megatron_dip.schedule.backward_split import split_backwards, with_reductions
    from megatron_dip.schedule.ir import Backward, BackwardWeight, ReduceGrads

    fused = {
        i.stage
        for p in plan.programs
        for i in p.instructions
        if type(i) is Backward and i.stage.microbatch % 3 == 2
    }
    programs = []
    for p in split_backwards(plan, fused):
        body = [i for i in p.instructions if not isinstance(i, ReduceGrads)]
        late = [i for i in body if isinstance(i, BackwardWeight) and i.stage.microbatch % 2]
        body = [i for i in body if not (isinstance(i, BackwardWeight) and i.stage.microbatch % 2)]
        programs.append(
            Program(p.rank, tuple(with_reductions(body + late, plan.placement, p.rank)))
        )
    return replace(plan, programs=tuple(programs), name=plan.name + "+split")
