"""Sizing a run from its data: sub-microbatch sizes, the placement and the memory limit.

Torch-free, run by `validate.resolve` on every rank before any process group exists. A few
calibration batches of the run's own data stream (metadata only) give each module's average
work per microbatch; from it the cost model chooses DIP's placement (segments per module by the
latency rule, layers per chunk) and the sub-microbatch sizes (the smallest size keeping 95% of
peak efficiency, the host time of a pass through the module's chunks counted), or the stock
Megatron placement for `--dip-schedule 1f1b|interleaved` (encoder whole on the first stage, the
loss module's layers split for the average batch). With host overheads (--dip-host-overheads)
and no --dip-segments, the rule's segments and every coarser combination are scored by
simulating the greedy plan of the first calibration batch (`planner.granularity`), so the run
trades granularity against the overhead.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from megatron_dip.batching import LayoutConfig, MicrobatchWork, pack, split_microbatches
from megatron_dip.data.packing import PackingLimits
from megatron_dip.data.sample import BatchMeta, SampleMeta
from megatron_dip.data.stream import StreamError
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.planner.compare import activation_limits, average_workload
from megatron_dip.planner.dip import DipPlanner, PlannerConfig
from megatron_dip.planner.granularity import Granularity, granularity, greedy_score, trade_segments
from megatron_dip.planner.placement import parse_segments, segments_per_module
from megatron_dip.planner.static_baselines import one_list_pipeline, stock_pipeline
from megatron_dip.planner.submicrobatch import choose_sub_sizes
from megatron_dip.schedule.ir import Placement, Recompute

from .arguments import TrainConfig
from .data_source import DataSpec, make_stream

logger = logging.getLogger(__name__)

CALIBRATION_BATCHES = 4


@dataclass(frozen=True)
class Layout:
    """What `build_layout` decides."""

    sub_sizes: dict[str, int]
    placement: Placement
    stage_units: list | None
    segments: dict[str, int]
    memory_limit: list[float] | None


def _fail(flag: str, message: str) -> ValueError:
    from .validate import ConfigError

    return ConfigError(f"{flag}: {message}")


def calibration_batches(
    config: TrainConfig, model: MultimodalSpec, data: DataSpec, limits: PackingLimits
) -> list[BatchMeta]:
    """The first calibration batches of the run's stream (metadata)."""
    t = config.train
    stream = make_stream(
        data, model, seed=t.seed, global_batch_size=t.global_batch_size, limits=limits
    )
    try:  # the stream bounds its search for usable samples, so this cannot spin
        batches = stream.peek(CALIBRATION_BATCHES)
    except StreamError as e:
        hint = " (or skip such samples: --dip-bad-samples skip)"
        hint = hint if config.dip.dip_bad_samples == "error" and e.position is not None else ""
        if e.oversize:
            raise _fail(
                "--seq-length",
                f"a sample of --dip-data {config.dip.dip_data} fits in no microbatch: {e}{hint}",
            ) from None
        raise _fail("--dip-data", f"cannot form a batch: {e}{hint}") from None
    return list(batches)


def calibration_microbatches(
    batches: Sequence[BatchMeta], limits: PackingLimits
) -> list[list[SampleMeta]]:
    """The samples of each packed microbatch of `batches`."""
    return [list(mb) for batch in batches for mb in pack(list(batch.samples), limits)]


def split_all(model: MultimodalSpec, microbatches, config: LayoutConfig) -> list[MicrobatchWork]:
    """Every microbatch cut into sub-microbatches (`--seq-length` checked)."""
    try:
        return list(split_microbatches(model, microbatches, config))
    except ValueError as e:
        raise _fail("--seq-length", str(e)) from None


def automatic_segments(model: MultimodalSpec, cost_model, workload, pp: int) -> dict[str, int]:
    """K_i = floor(T_i / T_min) per module (the paper's rule), capped so that each of the
    P * K_i chunks keeps at least one layer (logged when the cap applies)."""
    per_sample = {
        m.name: cost_model.module_time(
            m.name, instances=workload[m.name].instances, tokens=workload[m.name].tokens
        )
        / max(1, workload[m.name].instances)
        for m in model.modules
    }
    wanted = segments_per_module(model, per_sample)
    capped = {m.name: max(1, min(wanted[m.name], m.num_layers // pp)) for m in model.modules}
    if capped != wanted:
        logger.info(
            "segments per module %s capped to %s: %d pipeline ranks need a layer per chunk",
            wanted,
            capped,
            pp,
        )
    return capped


def _stock(config: TrainConfig, model, cost_model, workload, pp: int):
    schedule = config.dip.dip_schedule
    if config.dip.dip_segments is not None:
        raise _fail("--dip-segments", f"applies to --dip-schedule dip, not {schedule}")
    vp = 2 if schedule == "interleaved" else 1
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
            model, cost_model, num_ranks=pp, num_model_chunks=vp, workload=workload,
            by=config.dip.dip_stock_placement,
        )  # fmt: skip
    return pipe.placement, pipe.stage_units


def activation_need(
    placement: Placement, cost_model, works: list[MicrobatchWork], model: MultimodalSpec
) -> tuple[float, str]:
    """Bytes the largest stage holds even under full recomputation: no plan needs less on its
    rank. Returns (bytes, which stage)."""
    best, where = 0.0, ""
    trainable = {m.name for m in model.modules if m.trainable}
    for layout in placement.modules:
        if layout.name not in trainable:
            continue
        subs = [s for w in works for s in w.submicrobatches if s.module == layout.name]
        for chunk in layout.chunks:
            for sub in subs:
                need = cost_model.chunk_activation_bytes(chunk, sub, Recompute.FULL)
                if need > best:
                    best, where = need, f"{layout.name} chunk {chunk.index} on rank {chunk.rank}"
    return best, where


def _memory_limit(config, placement, cost_model, works, model, *, tp: int, device):
    from .validate import gib

    need, where = activation_need(placement, cost_model, works, model)
    given = config.dip.dip_memory_limit_gb
    if given is not None:
        limit = [given * 2**30] * placement.num_ranks
        if given * 2**30 < need:
            raise _fail(
                "--dip-memory-limit-gb",
                f"{given} GiB is below the {gib(need)} that {where} holds even with full "
                "recomputation; no plan fits",
            )
        return limit
    if device is None:
        return None  # CPU: no activation limit
    limit = activation_limits(placement, cost_model, device=device, tensor_parallel=tp)
    if min(limit) < need:
        raise _fail(
            "--pipeline-model-parallel-size/--tensor-model-parallel-size",
            f"weights and optimizer state leave {gib(min(limit))} for activations on some rank, "
            f"below the {gib(need)} that {where} needs; use more model parallelism",
        )
    return limit


@dataclass(frozen=True)
class _Sizing:
    """What the DIP layout is sized from (calibration data, parallel sizes, flags)."""

    config: TrainConfig
    model: MultimodalSpec
    cost_model: object
    workload: dict
    batches: list
    microbatches: list
    whole: LayoutConfig
    limits: PackingLimits
    tp: int
    pp: int
    dp: int
    dtype: str
    device: object


def _granularity(sizing: _Sizing, segments: dict[str, int], *, trade: bool, given) -> Granularity:
    """The segments' placement and sizes; with `trade`, the fastest of them and their coarser
    variants in simulation (`planner.granularity.trade_segments`)."""
    make = dict(num_ranks=sizing.pp, workload=sizing.workload, segments=segments, given_sizes=given)
    if not trade:
        return granularity(sizing.model, sizing.cost_model, **make)
    chosen, _ = trade_segments(
        sizing.model, sizing.cost_model, evaluate=functools.partial(_score, sizing), **make
    )
    return chosen


def _score(sizing: _Sizing, g: Granularity) -> float:
    """Simulated time of the greedy plan of the first calibration batch under `g` (a
    placement whose activations cannot fit at all scores infinity)."""
    from .validate import ConfigError, recompute_mode

    split = split_all(
        sizing.model, sizing.microbatches, replace(sizing.whole, sub_sizes=g.sub_sizes)
    )
    try:
        limit = _memory_limit(
            sizing.config, g.placement, sizing.cost_model, split, sizing.model,
            tp=sizing.tp, device=sizing.device,
        )  # fmt: skip
    except ConfigError:
        return math.inf
    mode = recompute_mode(sizing.config)
    c = sizing.config
    planner_config = PlannerConfig(
        seq_length=c.train.seq_length, data_parallel=sizing.dp, sub_sizes=g.sub_sizes,
        memory_limit_bytes=limit, tensor_parallel=sizing.tp,
        sequence_parallel=c.parallel.sequence_parallel and sizing.tp > 1, dtype=sizing.dtype,
        use_search=False, megatron_candidate=False, strict_memory=False, packing=sizing.limits,
        uniform_recompute=None if mode[0] is Recompute.NONE else mode,
    )  # fmt: skip
    planner = DipPlanner(sizing.model, sizing.cost_model, g.placement, planner_config)
    return greedy_score(planner, sizing.batches[:1], limits=limit)


def build_layout(
    config: TrainConfig,
    model: MultimodalSpec,
    cost_model,
    *,
    data: DataSpec,
    limits: PackingLimits,
    tp: int,
    pp: int,
    dtype: str,
    sub_sizes: Mapping[str, int] | None,
    device,
    dp: int = 1,
) -> Layout:
    """Placement (DIP or stock), sub-microbatch sizes and per-rank activation limit."""
    batches = calibration_batches(config, model, data, limits)
    microbatches = calibration_microbatches(batches, limits)
    whole = LayoutConfig(seq_length=config.train.seq_length, packing=limits)
    workload = average_workload(model, split_all(model, microbatches, whole))
    if config.dip.dip_schedule != "dip":
        sizes = choose_sub_sizes(model, cost_model, workload, given=sub_sizes)
        placement, units = _stock(config, model, cost_model, workload, pp)
        return Layout(sizes, placement, units, {}, None)
    sizing = _Sizing(
        config, model, cost_model, workload, batches, microbatches, whole, limits,
        tp, pp, dp, dtype, device,
    )  # fmt: skip
    try:
        override = parse_segments(config.dip.dip_segments or "")
        segments = override or automatic_segments(model, cost_model, workload, pp)
        g = _granularity(sizing, segments, trade=not override, given=sub_sizes)
    except ValueError as e:
        text = str(e)
        if text.startswith("--"):  # the planner already names the flag
            flag, _, rest = text.partition(" ")
            raise _fail(flag.rstrip(":"), rest) from None
        raise _fail("--pipeline-model-parallel-size", text) from None
    split = split_all(model, microbatches, replace(whole, sub_sizes=g.sub_sizes))
    limit = _memory_limit(config, g.placement, cost_model, split, model, tp=tp, device=device)
    return Layout(g.sub_sizes, g.placement, None, dict(g.segments), limit)
