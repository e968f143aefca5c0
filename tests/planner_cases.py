"""Random and fixed planning cases for the planner's property tests (`test_planner_fuzz.py`).

Hypothesis strategies for multimodal models (VLM: ViT -> LLM; text-to-video: text encoder ->
DiT; frozen encoders; small and large layers), batches (text-only, image-heavy, samples without
images, a single sample) and planner settings (pipeline 1-8, data parallel 1-2, segments 1-4 or
automatic, tensor parallel 1/2/4, search on/off, memory limits from "does not bind" to far
below what fits), and the checks every returned plan must pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from hypothesis import strategies as st
from metas import t2v_meta, vlm_meta

from megatron_dip.data.packing import PackingLimits
from megatron_dip.data.sample import BatchMeta, SampleMeta
from megatron_dip.modelspec import LayerShape, ModuleSpec, MultimodalSpec
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.config import PlannerConfig
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import get_device
from megatron_dip.planner.dip import DipPlanner
from megatron_dip.planner.placement import ModuleWorkload, build_dip_placement
from megatron_dip.planner.search import SearchConfig
from megatron_dip.planner.simulator import activation_peaks, simulate
from megatron_dip.schedule.engine import per_peer_channel, single_channel
from megatron_dip.schedule.ir import NO_RECOMPUTE, Backward, Forward, Plan
from megatron_dip.schedule.serialize import plan_from_bytes, plan_to_bytes
from megatron_dip.schedule.validate import validate_plan

SEQ = 512  # packed LLM sequence; VLM samples are drawn to fit
MERGE = 2  # tiny ViT: 2x2 patches per LLM token
REL_TOL = 1e-9

# -- models -------------------------------------------------------------------------------------

SMALL = (32, 4, 2)  # hidden, heads, kv groups
LARGE = (1024, 16, 4)


def layer_shape(size: tuple[int, int, int], *, gated: bool) -> LayerShape:
    hidden, heads, kv = size
    return LayerShape(hidden, 2 * hidden, heads, kv if gated else heads, gated_mlp=gated)


@st.composite
def models(draw, *, pipeline: int) -> MultimodalSpec:
    """A VLM (ViT -> LLM) or a text-to-video model (text encoder -> DiT), optionally with a
    frozen encoder, whose modules have at least `pipeline` layers each."""
    layers = st.integers(pipeline, 48)
    enc_size, main_size = (
        draw(st.sampled_from([SMALL, LARGE])),
        draw(st.sampled_from([SMALL, LARGE])),
    )
    trainable = draw(st.booleans())
    main = layer_shape(main_size, gated=True)
    if draw(st.sampled_from(["vlm", "t2v"])) == "vlm":
        encoder = ModuleSpec(
            "vit",
            "vit",
            draw(layers),
            layer_shape(enc_size, gated=False),
            trainable=trainable,
            feeds="llm",
            patch_size=8,
            merge=MERGE,
            out_hidden=main.hidden,
        )
        head = ModuleSpec("llm", "llm", draw(layers), main, vocab_size=128)
        return MultimodalSpec("fuzz-vlm", (encoder, head))
    encoder = t2v_encoder(draw(layers), enc_size, trainable=trainable)
    dit = dit_module(draw(layers), main_size, cond_hidden=encoder.layer.hidden)
    return MultimodalSpec("fuzz-t2v", (encoder, dit))


def t2v_encoder(
    layers: int = 4, size: tuple[int, int, int] = SMALL, *, trainable: bool = True
) -> ModuleSpec:
    return ModuleSpec(
        "text",
        "text_encoder",
        layers,
        layer_shape(size, gated=True),
        trainable=trainable,
        feeds="dit",
        vocab_size=128,
    )


def dit_module(
    layers: int = 6, size: tuple[int, int, int] = SMALL, *, cond_hidden: int = SMALL[0]
) -> ModuleSpec:
    return ModuleSpec(
        "dit",
        "dit",
        layers,
        layer_shape(size, gated=False),
        patch_size=2,
        in_channels=4,
        cond_hidden=cond_hidden,
    )


# -- batches ------------------------------------------------------------------------------------


@st.composite
def vlm_sample(draw, sample_id: int, *, kind: str) -> SampleMeta:
    max_images = {"text-only": 0, "image-heavy": 6, "mixed": 2}[kind]
    grids = draw(st.lists(st.integers(1, 5), max_size=max_images))
    llm = tuple(g * g for g in grids)
    text = draw(st.integers(1, 120))
    return vlm_meta(sample_id, text + sum(llm), tuple((g * MERGE) ** 2 for g in grids), llm)


@st.composite
def t2v_sample(draw, sample_id: int, *, kind: str) -> SampleMeta:
    frames = draw(st.integers(1, 4 if kind != "image-heavy" else 8))
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    tokens = frames * rows * cols
    return t2v_meta(sample_id, draw(st.integers(1, 60)), tokens, frames)


@st.composite
def batches(draw, model: MultimodalSpec, *, min_samples: int) -> BatchMeta:
    """Text-only, image-heavy or mixed batches (samples without images included), from one
    sample up, with uneven instance counts."""
    kind = draw(st.sampled_from(["text-only", "image-heavy", "mixed"]))
    n = draw(st.integers(min_samples, 8))
    make = vlm_sample if model.loss_module.kind == "llm" else t2v_sample
    samples = tuple(draw(make(i, kind=kind)) for i in range(n))
    return BatchMeta(draw(st.integers(0, 3)), samples)


# -- planner ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """Everything one planning run depends on (rebuilt from scratch for each run)."""

    model: MultimodalSpec
    batch: BatchMeta
    pipeline: int
    data_parallel: int
    tensor_parallel: int
    sequence_parallel: bool
    segments: tuple[tuple[str, int], ...] | None
    sub_sizes: tuple[tuple[str, int], ...]
    search: bool
    rollouts: int
    seed: int
    fill_bubbles: bool
    lookahead: int
    megatron_candidate: bool
    optimize_memory: bool
    strict_memory: bool
    memory_fraction: float | None  # of the unconstrained plan's peak; None: no limit
    rank_spread: float = 0.0  # rank r gets (1 + spread * r / (P - 1)) times the limit

    @property
    def shape(self) -> ParallelShape:
        """The case's parallel shape, as the cost model and the planner get it."""
        return ParallelShape(
            tp=self.tensor_parallel,
            dp=self.data_parallel,
            sp=self.sequence_parallel,
            seq_length=SEQ,
        )

    def cost_model(self) -> CostModel:
        return CostModel(self.model, get_device("H100"), shape=self.shape)

    def packing(self) -> PackingLimits:
        if self.model.loss_module.kind == "llm":
            return PackingLimits.vlm(seq_length=SEQ, max_images=8)
        return PackingLimits.t2v(max_clips=4, max_frames=10)

    def workload(self) -> dict[str, ModuleWorkload]:
        out = {}
        for m in self.model.modules:
            if m.kind == "llm":
                out[m.name] = ModuleWorkload(1, SEQ)
            elif m.kind == "text_encoder":
                out[m.name] = ModuleWorkload(4, sum(s.text_tokens for s in self.batch.samples))
            else:
                inst = sum(s.num_instances for s in self.batch.samples)
                out[m.name] = ModuleWorkload(
                    inst, sum(s.instance_tokens for s in self.batch.samples)
                )
        return out

    def limits(self, limit: float | None) -> list[float] | None:
        """Per-rank limits from the base `limit` (see `rank_spread`)."""
        if limit is None:
            return None
        span = max(1, self.pipeline - 1)
        return [limit * (1 + self.rank_spread * r / span) for r in range(self.pipeline)]

    def planner(self, memory_limit: float | None = None) -> DipPlanner:
        cost = self.cost_model()
        placement, _ = build_dip_placement(
            self.model,
            cost,
            num_ranks=self.pipeline,
            workload=self.workload(),
            segments=dict(self.segments) if self.segments else None,
        )
        config = PlannerConfig(
            shape=self.shape,
            sub_sizes=dict(self.sub_sizes),
            search=SearchConfig(max_rollouts=self.rollouts, time_budget_s=600.0, seed=self.seed),
            memory_limit_bytes=self.limits(memory_limit),
            lookahead=self.lookahead,
            fill_bubbles=self.fill_bubbles,
            use_search=self.search,
            megatron_candidate=self.megatron_candidate,
            optimize_memory=self.optimize_memory,
            strict_memory=self.strict_memory,
            packing=self.packing(),
        )
        return DipPlanner(self.model, cost, placement, config)


@st.composite
def cases(draw) -> Case:
    pipeline = draw(st.integers(1, 8))
    model = draw(models(pipeline=pipeline))
    dp = draw(st.integers(1, 2))
    batch = draw(batches(model, min_samples=dp))
    segments = None
    if draw(st.booleans()):
        segments = tuple(
            (m.name, draw(st.integers(1, max(1, min(4, m.num_layers // pipeline)))))
            for m in model.modules
        )
    tp = draw(st.sampled_from([1, 2, 4]))
    encoder = model.modules[0]
    sub_sizes = [(encoder.name, draw(st.integers(1, 6)))]
    if model.loss_module.kind == "dit":
        sub_sizes.append(("dit", draw(st.integers(1, 4))))
    return Case(
        model=model,
        batch=batch,
        pipeline=pipeline,
        data_parallel=dp,
        tensor_parallel=tp,
        sequence_parallel=tp > 1 and draw(st.booleans()),
        segments=segments,
        sub_sizes=tuple(sub_sizes),
        search=draw(st.booleans()),
        rollouts=draw(st.integers(2, 6)),
        seed=draw(st.integers(0, 3)),
        fill_bubbles=draw(st.booleans()),
        lookahead=draw(st.integers(0, 2)),
        megatron_candidate=draw(st.booleans()),
        optimize_memory=draw(st.sampled_from([True, True, True, False])),
        strict_memory=draw(st.sampled_from([True, True, True, False])),
        memory_fraction=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        rank_spread=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
    )


# -- properties ---------------------------------------------------------------------------------


def bubble_free_bound(plan: Plan, cost: CostModel) -> float:
    """Busiest rank's compute without any recomputation: no schedule of these stages is faster."""
    busy = []
    for program in plan.programs:
        total = 0.0
        for ins in program.instructions:
            if isinstance(ins, (Forward, Backward)):
                chunk = plan.placement.module(ins.stage.module).chunks[ins.stage.chunk]
                c = cost.stage_cost(chunk, plan.submicrobatch(ins.stage.work), NO_RECOMPUTE)
                total += c.forward if isinstance(ins, Forward) else c.backward
        busy.append(total)
    return max(busy)


def check_plan(
    plan: Plan, cost: CostModel, limits: list[float] | None, *, overcommitted: bool = False
) -> None:
    """`plan` validates, runs without deadlock under both channel models, is no faster than
    the bubble-free bound, exceeds `limits` on some rank exactly when `overcommitted` (its
    peaks, as the order alone gives them, the simulated ones), and serializes
    byte-identically."""
    validate_plan(plan)
    bound = bubble_free_bound(plan, cost)
    peaks = activation_peaks(plan, cost)
    for channel in (single_channel, per_peer_channel):
        sim = simulate(plan, cost, channel=channel)  # raises DeadlockError on a hang
        assert sim.peak_activation_bytes == peaks
        assert sim.iteration_time >= bound * (1 - REL_TOL) - 1e-15
        assert sim.iteration_time >= sim.lower_bound * (1 - REL_TOL)
        if limits is not None:
            over = [
                (r, p, lim)
                for r, (p, lim) in enumerate(zip(sim.peak_activation_bytes, limits))
                if p > lim
            ]
            assert bool(over) == overcommitted, f"(rank, peak, limit) over the limit: {over}"
    data = plan_to_bytes(plan)
    assert plan_to_bytes(plan_from_bytes(data)) == data


def plan_bytes(case: Case, limit: float | None) -> list[bytes]:
    """Serialized plans of every replica, from a planner built from scratch."""
    return [plan_to_bytes(r.plan) for r in case.planner(limit).plan_batch(case.batch)]


def limit_for(case: Case) -> float | None:
    """The case's memory limit: a fraction of the largest peak of the unconstrained greedy plan
    (a scale only, so the cheapest plan)."""
    if case.memory_fraction is None:
        return None
    free = (
        replace(case, search=False, megatron_candidate=False).planner(None).plan_batch(case.batch)
    )
    cost = case.cost_model()
    peak = max(max(simulate(r.plan, cost).peak_activation_bytes) for r in free)
    return max(1.0, case.memory_fraction * peak)


def tiny_case(**overrides) -> Case:
    """A fixed VLM case: 2 pipeline ranks, images in some samples, search on."""
    model = MultimodalSpec(
        "fixed-vlm",
        (
            ModuleSpec(
                "vit",
                "vit",
                4,
                layer_shape(SMALL, gated=False),
                feeds="llm",
                patch_size=8,
                merge=MERGE,
                out_hidden=SMALL[0],
            ),
            ModuleSpec("llm", "llm", 6, layer_shape(SMALL, gated=True), vocab_size=128),
        ),
    )
    grids = [(), (2, 3), (1,), (), (4, 4, 1), (3,), (), (2,)]
    samples = tuple(
        vlm_meta(
            i,
            50 + 7 * i + sum(g * g for g in gs),
            tuple((g * MERGE) ** 2 for g in gs),
            tuple(g * g for g in gs),
        )
        for i, gs in enumerate(grids)
    )
    base = dict(
        model=model,
        batch=BatchMeta(1, samples),
        pipeline=2,
        data_parallel=1,
        tensor_parallel=1,
        sequence_parallel=False,
        segments=None,
        sub_sizes=(("vit", 2),),
        search=True,
        rollouts=8,
        seed=1,
        fill_bubbles=True,
        lookahead=1,
        megatron_candidate=True,
        optimize_memory=True,
        strict_memory=True,
        memory_fraction=None,
    )
    return Case(**{**base, **overrides})


def fixed_cases() -> list[Case]:
    """A few cases covering search, a binding memory limit, data parallelism and T2V."""
    t2v = MultimodalSpec("fixed-t2v", (t2v_encoder(), dit_module()))
    clips = tuple(t2v_meta(i, 5 + 3 * i, f * 6, f) for i, f in enumerate([1, 3, 2, 4, 1, 2]))
    return [
        tiny_case(),
        tiny_case(memory_fraction=0.5, data_parallel=2, pipeline=3, seed=2),
        tiny_case(
            model=t2v,
            batch=BatchMeta(0, clips),
            sub_sizes=(("text", 2), ("dit", 1)),
            tensor_parallel=2,
            sequence_parallel=True,
        ),
    ]


def planning_digest() -> str:
    """sha256 over the serialized plans of `fixed_cases` (run in fresh processes)."""
    h = hashlib.sha256()
    for case in fixed_cases():
        for data in plan_bytes(case, limit_for(case)):
            h.update(data)
    return h.hexdigest()
