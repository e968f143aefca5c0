"""Sizing a run from its data: sub-microbatch sizes, the placement and the memory limit.

Torch-free, run by `validate.resolve` on every rank before any process group exists. A few
calibration batches of the run's own data stream (metadata only) give each module's average
work per microbatch; from it the cost model chooses the sub-microbatch sizes (the smallest size
keeping 95% of peak efficiency), and the placement: for `--dip-schedule 1f1b|interleaved` the
stock Megatron placement of `--dip-stock-placement`; for DIP the `--dip-segments` given, or a
start-up search over DIP's segment counts (the latency rule K_i = floor(T_i / T_min) among them)
and the static Megatron placements (encoder on the first stage, one layer list cut by cost or
parameters, 1 or 2 chunks per rank, the cost cut also 3, 4, 6 or 8; a one-list cut then moved
a layer at a time while that scores lower), scored by simulated greedy plans of the first
calibration batches (`planner.placement_search.search_placement`; the near-ties and the cut the
climb started from then planned as the run plans, `planner.placement_ties`) under the cost model,
host overheads included (--dip-host-overheads): so the search trades granularity against the
runtime's per-instruction cost, and the sub-microbatch sizes count the host time of a pass
through a module's chunks. A static placement keeps its virtual stages, so the planner can
always fall back to Megatron's order on it: DIP never starts slower than them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from megatron_dip.batching import LayoutConfig, MicrobatchWork, pack, split_microbatches
from megatron_dip.data.packing import PackingLimits
from megatron_dip.data.sample import BatchMeta
from megatron_dip.data.stream import StreamError
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.planner.candidate_pool import usable_cores
from megatron_dip.planner.config import PlannerConfig, scoring_config
from megatron_dip.planner.devices import GIB
from megatron_dip.planner.dip import DipPlanner
from megatron_dip.planner.placement import (
    PlacementCandidate,
    build_dip_placement,
    parse_segments,
)
from megatron_dip.planner.placement_neighbours import CUT, named_cut
from megatron_dip.planner.placement_search import (
    rank_load_bound,
    search_placement,
    simulated_score,
    static_candidates,
)
from megatron_dip.planner.sizing import (
    MemoryBudgetError,
    activation_budget,
    automatic_segments,
    average_workload,
)
from megatron_dip.planner.static_baselines import (
    one_list_pipeline,
    static_pipelines,
    stock_pipeline,
)
from megatron_dip.planner.submicrobatch import choose_sub_sizes
from megatron_dip.schedule.ir import Placement

from .arguments import ConfigError, TrainConfig
from .arguments import fail as _fail
from .data_source import DataSpec, make_stream

logger = logging.getLogger(__name__)


CALIBRATION_BATCHES = 4
SCORED_BATCHES = 2  # of them, planned greedily per placement candidate
# --dip-segments static:NAME: the static placement the start-up search names "static NAME"
# (e.g. static:cost-split-v1), without the search (`placement_flag` writes it).
STATIC_PREFIX = "static:"


def placement_flag(name: str, segments: Mapping[str, int]) -> str:
    """The --dip-segments value that gives a run the placement the start-up search chose
    (`name`: its candidate name, `segments`: DIP's segments per module, {} on a static one),
    so that a later run of the same job need not search again."""
    if name.startswith("static "):
        return STATIC_PREFIX + name.removeprefix("static ").replace(" ", "-")
    return ",".join(f"{k}={v}" for k, v in segments.items())


@dataclass(frozen=True)
class Layout:
    """What `build_layout` decides."""

    sub_sizes: dict[str, int]
    placement: Placement
    stage_units: list | None
    segments: dict[str, int]  # DIP's segments per module ({} on a static placement)
    memory_limit: list[float] | None
    placement_name: str = ""  # the start-up search's name of the placement (`placement_flag`)


def gib(nbytes: float) -> str:
    """`nbytes` as GiB text with enough digits for tiny models."""
    value = nbytes / GIB
    digits = max(2, 1 - math.floor(math.log10(value))) if value > 0 else 2
    return f"{value:.{min(digits, 9)}f} GiB"


def calibration_batches(
    config: TrainConfig, model: MultimodalSpec, data: DataSpec, limits: PackingLimits
) -> list[BatchMeta]:
    """The first calibration batches of the run's data stream (metadata)."""
    t = config.train
    try:  # a reader that refuses the dataset or the model (its files, its vocabulary)
        stream = make_stream(
            data, model, seed=t.seed, global_batch_size=t.global_batch_size, limits=limits
        )
    except (ImportError, OSError, ValueError) as e:
        text = str(e) if str(e).startswith(str(data.value)) else f"{data.value}: {e}"
        raise _fail("--dip-data", f"cannot read {text}") from None
    try:  # the stream bounds its search for usable samples, so this cannot spin
        return stream.peek(CALIBRATION_BATCHES)
    except StreamError as e:
        hint = " (or skip such samples: --dip-bad-samples skip|truncate)"
        hint = hint if config.dip.dip_bad_samples == "error" and e.position is not None else ""
        if e.oversize:
            raise _fail(
                "--seq-length",
                f"a sample of --dip-data {config.dip.dip_data} fits in no microbatch: {e}{hint}",
            ) from None
        raise _fail("--dip-data", f"cannot form a batch: {e}{hint}") from None


def split_all(model: MultimodalSpec, microbatches, config: LayoutConfig) -> list[MicrobatchWork]:
    """Every microbatch cut into sub-microbatches (`--seq-length` checked)."""
    try:
        return list(split_microbatches(model, microbatches, config))
    except ValueError as e:
        raise _fail("--seq-length", str(e)) from None


# Megatron's interleaved schedule without --num-virtual-stages-per-pipeline-rank: its usual 2.
DEFAULT_VIRTUAL_STAGES = 2


def stock_virtual_stages(config: TrainConfig, model: MultimodalSpec) -> int:
    """Model chunks per rank of the stock schedule: 1 for 1F1B; for the interleaved schedule
    --num-virtual-stages-per-pipeline-rank (>= 2) or, as Megatron-LM derives it, the loss
    module's layers (--num-layers) / (PP x --num-layers-per-virtual-pipeline-stage); by default
    `DEFAULT_VIRTUAL_STAGES`. A ConfigError naming the flag where it does not apply (DIP
    chooses its own chunks) or does not divide."""
    schedule = config.dip.dip_schedule
    given = _virtual_stages_given(config, model.loss_module.num_layers)
    if given is not None and schedule != "interleaved":
        flag = given[0]
        where = (
            "DIP's start-up search chooses its chunks per rank (--dip-segments "
            "static:cost-split-v4 names Megatron's cost cut over 4)"
            if schedule == "dip"
            else "1F1B runs one model chunk per rank"
        )
        raise _fail(flag, f"applies to --dip-schedule interleaved, not {schedule}: {where}")
    if schedule != "interleaved":
        return 1
    if given is None:
        return DEFAULT_VIRTUAL_STAGES
    flag, stages = given
    if stages < 2:
        raise _fail(
            flag, f"the interleaved schedule needs >= 2 model chunks per rank, got {stages}"
        )
    return stages


def _virtual_stages_given(config: TrainConfig, layers: int) -> tuple[str, int] | None:
    """(the flag, the chunks per rank it asks for) of Megatron-LM's two virtual-pipeline flags,
    or None; both at once, or a layer count that does not divide, is refused."""
    p = config.parallel
    stages, per_stage = (
        p.num_virtual_stages_per_pipeline_rank,
        p.num_layers_per_virtual_pipeline_stage,
    )
    if per_stage is None:
        return None if stages is None else ("--num-virtual-stages-per-pipeline-rank", stages)
    flag = "--num-layers-per-virtual-pipeline-stage"
    if stages is not None:
        raise _fail(flag, "and --num-virtual-stages-per-pipeline-rank exclude each other: pass one")
    pp = p.pipeline_model_parallel_size
    if per_stage < 1 or layers % (pp * per_stage):
        raise _fail(
            flag,
            f"{per_stage} layers per virtual stage do not divide the {layers} layers "
            f"(--num-layers) over PP={pp}; pass --num-virtual-stages-per-pipeline-rank instead",
        )
    return flag, layers // (pp * per_stage)


def _stock(config: TrainConfig, model, cost_model, workload, pp: int, vp: int):
    """Megatron's placement of the stock schedule over `vp` model chunks per rank
    (`stock_virtual_stages`) and its virtual stages."""
    schedule = config.dip.dip_schedule
    if config.dip.dip_segments not in (None, "auto"):
        raise _fail("--dip-segments", f"applies to --dip-schedule dip, not {schedule}")
    if vp > 1 and pp < 2:
        raise _fail("--pipeline-model-parallel-size", "--dip-schedule interleaved needs PP >= 2")
    loss = model.loss_module
    if loss.num_layers < pp * vp:
        raise _fail(
            "--pipeline-model-parallel-size",
            f"--dip-schedule {schedule} cuts the {loss.num_layers} layers of {loss.name!r} into "
            f"PP x V = {pp} x {vp} stages; lower PP or add layers (--num-layers)",
        )
    if config.dip.dip_stock_placement == "llava":
        pipe = stock_pipeline(
            model, cost_model, num_ranks=pp, num_model_chunks=vp, workload=workload
        )
    else:  # encoder and LLM layers as one list, cut by parameters or by cost
        pipe = one_list_pipeline(
            model,
            cost_model,
            num_ranks=pp,
            num_model_chunks=vp,
            workload=workload,
            by=config.dip.dip_stock_placement,
        )
    return pipe.placement, pipe.stage_units


def _memory_limit(config, placement, cost_model, works, model, *, device):
    """`planner.sizing.activation_budget` of --dip-memory-limit-gb or the device, with the
    flag to change when no plan fits."""
    given = config.dip.dip_memory_limit_gb
    try:
        return activation_budget(
            placement,
            cost_model,
            works,
            model,
            given_bytes=None if given is None else given * GIB,
            device=device,
        )
    except MemoryBudgetError as e:
        if e.given:
            raise _fail(
                "--dip-memory-limit-gb",
                f"{given} GiB is below the {gib(e.need)} that {e.where} holds even with full "
                "recomputation; no plan fits",
            ) from None
        raise _fail(
            "--pipeline-model-parallel-size/--tensor-model-parallel-size",
            f"weights and optimizer state leave {gib(e.budget)} for activations on some rank, "
            f"below the {gib(e.need)} that {e.where} needs; use more model parallelism",
        ) from None


@dataclass(frozen=True)
class _Sizing:
    """What every placement candidate of a run is sized and scored with."""

    config: TrainConfig
    model: MultimodalSpec
    cost_model: object
    batches: list[BatchMeta]
    works: list[MicrobatchWork]  # calibration microbatches cut with the chosen sub sizes
    workload: dict
    sub_sizes: dict[str, int]
    pp: int
    device: object
    base: PlannerConfig  # the run's planner configuration, sized here

    def memory_limit(self, placement: Placement) -> list[float] | None:
        return _memory_limit(
            self.config,
            placement,
            self.cost_model,
            self.works,
            self.model,
            device=self.device,
        )

    def score(self, cand: PlacementCandidate) -> float:
        """`simulated_score` of the first calibration batches by the greedy planner; inf when
        no plan can fit."""
        return self._simulated(cand, greedy=True)

    def plan_score(self, cand: PlacementCandidate) -> float:
        """`simulated_score` of the same batches planned as the run plans them, but without
        the search (a function of the data): the start-up search's near-ties' score."""
        return self._simulated(cand, greedy=False)

    def bound(self, cand: PlacementCandidate) -> float:
        """`rank_load_bound` of the scored batches: no score of `cand` is lower."""
        return rank_load_bound(self.planner(cand, None), self.batches[:SCORED_BATCHES])

    def planner(
        self, cand: PlacementCandidate, limit: list[float] | None, *, greedy: bool = True
    ) -> DipPlanner:
        """The run's planner (`scoring_config`) on the candidate placement."""
        config = replace(self.base, sub_sizes=dict(self.sub_sizes), memory_limit_bytes=limit)
        config = scoring_config(config, greedy=greedy)
        return DipPlanner(
            self.model, self.cost_model, cand.placement, config, stage_units=cand.stage_units
        )

    def _simulated(self, cand: PlacementCandidate, *, greedy: bool) -> float:
        try:
            limit = self.memory_limit(cand.placement)
        except ConfigError:
            return math.inf
        planner = self.planner(cand, limit, greedy=greedy)
        return simulated_score(planner, self.batches[:SCORED_BATCHES], limits=limit)


def _wanted_segments(config: TrainConfig, model, cost_model, workload, pp: int):
    """(segments, given): --dip-segments as given, else the latency rule's (also for
    static:NAME, whose sub-microbatch sizes are the search's)."""
    given = config.dip.dip_segments
    named = given is not None and given.startswith(STATIC_PREFIX)
    override = {} if given in (None, "auto") or named else parse_segments(given)
    return (
        (override, True)
        if override
        else (automatic_segments(model, cost_model, workload, pp), False)
    )


def _named_static(sizing: _Sizing, flag: str) -> PlacementCandidate:
    """The static placement --dip-segments static:NAME names (no search); NAME-cut-SIZES
    (layers per stage, "cost-split-v1-cut-18/19/19/39") is a cut the start-up search moved."""
    static = static_pipelines(
        sizing.model, sizing.cost_model, num_ranks=sizing.pp, workload=sizing.workload
    )
    known = {placement_flag(c.name, {}): c for c in static_candidates(static)}
    try:  # a cut the start-up search moved: "static:cost-split-v1-cut-18/19/19/39"
        return named_cut(sizing.model, known, flag, marker=CUT.replace(" ", "-"))
    except KeyError as e:
        raise _fail("--dip-segments", e.args[0]) from None
    except ValueError as e:
        raise _fail("--dip-segments", f"{flag!r}: {e}") from None


def _dip_placement(sizing: _Sizing, segments: dict[str, int], *, given: bool):
    """The placement of `segments` (`given`: --dip-segments; static:NAME names a static one),
    or for PP > 1 the start-up search: DIP's segment counts (`segments`, the latency rule's,
    among them) and the static Megatron placements, scored by simulated greedy plans; a static
    one-list cut that wins is then moved a layer at a time while that scores lower
    (`placement_climb`), and near-ties are settled by the run's own plans (`placement_ties`)."""
    model, cost, pp = sizing.model, sizing.cost_model, sizing.pp
    flag = sizing.config.dip.dip_segments or ""
    if flag.startswith(STATIC_PREFIX):
        return _named_static(sizing, flag)
    if given or pp == 1:  # one rank: nothing to place, the rule's chunks are all there is
        placement, _ = build_dip_placement(
            model, cost, num_ranks=pp, workload=sizing.workload, segments=segments
        )
        return PlacementCandidate("--dip-segments" if given else "rule", placement)
    started = time.perf_counter()  # for the log only: the choice depends on the data alone
    workers = sizing.config.dip.dip_startup_workers or usable_cores()
    chosen, scores, _ = search_placement(
        model,
        cost,
        num_ranks=pp,
        workload=sizing.workload,
        unit_instances=sizing.sub_sizes,
        static=static_pipelines(model, cost, num_ranks=pp, workload=sizing.workload),
        score=sizing.score,
        plan_score=sizing.plan_score,
        bound=sizing.bound,
        workers=workers,
    )
    segments = {m.name: m.num_chunks // pp for m in chosen.placement.modules}
    logger.info(
        "start-up placement search: %d candidates scored in %.1f s (up to %d processes); "
        "placement %r chosen (--dip-segments %s skips the search); simulated seconds per "
        "candidate: %s",
        len(scores),
        time.perf_counter() - started,
        workers,
        chosen.name,
        placement_flag(chosen.name, segments),
        scores,
    )
    return chosen


def build_layout(
    config: TrainConfig,
    model: MultimodalSpec,
    cost_model,
    *,
    data: DataSpec,
    base: PlannerConfig,
    pp: int,
    sub_sizes: Mapping[str, int] | None,
    device,
) -> Layout:
    """Sub-microbatch sizes, placement (DIP's choice or stock) and per-rank activation limit;
    `base`: the run's planner configuration before sizing (its packing, TP, starting recompute
    mode), which the placement search's planners use too."""
    vp = stock_virtual_stages(config, model)  # refuses its flags early, where they do not apply
    limits = base.packing
    batches = calibration_batches(config, model, data, limits)
    microbatches = [list(mb) for b in batches for mb in pack(list(b.samples), limits)]
    whole = LayoutConfig(seq_length=config.train.seq_length, packing=limits)
    workload = average_workload(model, split_all(model, microbatches, whole))
    if config.dip.dip_schedule != "dip":
        sizes = choose_sub_sizes(model, cost_model, workload, given=sub_sizes)
        placement, units = _stock(config, model, cost_model, workload, pp, vp)
        return Layout(sizes, placement, units, {}, None)
    try:
        segments, given = _wanted_segments(config, model, cost_model, workload, pp)
        chunks = {name: pp * k for name, k in segments.items()}
        sizes = choose_sub_sizes(model, cost_model, workload, given=sub_sizes, chunks=chunks)
        split = split_all(model, microbatches, replace(whole, sub_sizes=sizes))
        sizing = _Sizing(
            config,
            model,
            cost_model,
            batches,
            split,
            workload,
            sizes,
            pp=pp,
            device=device,
            base=base,
        )
        chosen = _dip_placement(sizing, segments, given=given)
    except ValueError as e:
        text = str(e)
        if text.startswith("--"):  # the planner already names the flag
            flag, _, rest = text.partition(" ")
            raise _fail(flag.rstrip(":"), rest) from None
        raise _fail("--pipeline-model-parallel-size", text) from None
    limit = sizing.memory_limit(chosen.placement)
    segments = {}
    if chosen.stage_units is None:  # DIP's own placement: segments per module
        segments = {m.name: m.num_chunks // pp for m in chosen.placement.modules}
    return Layout(sizes, chosen.placement, chosen.stage_units, segments, limit, chosen.name)
