"""From parsed flags to a checked `RunSpec`, before any process group exists (torch-free).

`resolve(config, world_size=..., cuda=...)` fills the `--model` preset's defaults, checks every
flag and every combination that can be checked without communicating (sizes, divisibility, the
placement, the memory limit, the cost profile, the data), and builds what every rank needs
identically: the model spec, the cost model, the placement, the planner's configuration. Each
problem is a `ConfigError` whose message starts with the flag to change. Every rank runs the same
deterministic resolution, so no rank starts while another refuses. Beside it: the checkpoint
flags' checks (`checkpoint_flags`), Megatron's recompute flags (`recompute_flags`) and the
settings read off the flags (`settings`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import replace

from megatron_dip import megatron_compat
from megatron_dip.batching import packing_limits
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.parallel import ParallelShape, ShapeError
from megatron_dip.planner.config import COARSER_SUB_SIZES, PlannerConfig, planner_config
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.submicrobatch import split_modules
from megatron_dip.schedule.ir import NO_RECOMPUTE, RECOMPUTE_MODULES

from .arguments import ConfigError, TrainConfig
from .arguments import fail as _fail
from .checkpoint_flags import check_checkpoint_flags, check_checkpoints, create_save
from .data_config import data_spec, model_spec
from .presets import RunPreset, get_run_preset
from .pricing import run_cost_model, run_device, run_kernels
from .recompute_flags import recompute_mode
from .resumed_layout import kept_layout, size_run
from .run import RunSpec, delays_weight_gradients
from .settings import (
    checkpointing_settings,
    reporting_settings,
    runtime_limits,
    search_settings,
    training_settings,
)

logger = logging.getLogger(__name__)


def apply_preset(config: TrainConfig) -> tuple[TrainConfig, RunPreset]:
    """Fill the fields left unset from the `--model` preset."""
    name = config.model.model
    if name is None:
        raise _fail("--model", "choose a run preset (tiny-vlm, tiny-t2v, vlm-s, ..., t2v-l)")
    try:
        preset = get_run_preset(name)
    except KeyError as e:
        raise _fail("--model", str(e.args[0])) from None
    defaults = {
        "tensor_model_parallel_size": preset.tensor_parallel,
        "pipeline_model_parallel_size": preset.pipeline_parallel,
        "global_batch_size": preset.global_batch_size,
        "seq_length": preset.seq_length,
        "dip_data": preset.data,
        "dip_data_scale": preset.data_scale,
        "dip_image_size": preset.image_size,
        "dip_sub_microbatch_size": preset.sub_microbatch_size,
    }
    if config.dip.dip_schedule == "dip":
        defaults["dip_segments"] = preset.segments
    flat = config.flat()
    missing = {k: v for k, v in defaults.items() if flat[k] is None}
    return config.replace(**missing), preset


def _check_sizes(config: TrainConfig, world_size: int) -> tuple[int, int, int]:
    p, t = config.parallel, config.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    try:
        dp = ParallelShape.for_world(world_size, tp=tp, pp=pp).dp
    except ShapeError as e:
        raise ConfigError(str(e)) from None
    if t.micro_batch_size != 1:
        raise _fail(
            "--micro-batch-size",
            f"must be 1: samples are packed, a microbatch is one packed sequence of "
            f"--seq-length tokens (got {t.micro_batch_size}); size the batch with "
            "--global-batch-size (packed microbatches per iteration)",
        )
    if t.global_batch_size < dp:
        raise _fail(
            "--global-batch-size",
            f"{t.global_batch_size} packed microbatches cannot feed {dp} data-parallel replicas",
        )
    if t.seq_length < 1:
        raise _fail("--seq-length", f"must be >= 1, got {t.seq_length}")
    _check_stock_batch(config, dp=dp, pp=pp)
    return tp, pp, dp


def _check_stock_batch(config: TrainConfig, *, dp: int, pp: int) -> None:
    """Megatron's schedules give every replica the same number of microbatches, and the
    interleaved one a multiple of PP per replica."""
    schedule, g = config.dip.dip_schedule, config.train.global_batch_size
    if schedule == "dip":
        return
    if g % dp:
        raise _fail(
            "--global-batch-size",
            f"--dip-schedule {schedule} gives every replica G/DP microbatches: G={g} is not "
            f"divisible by DP={dp}",
        )
    if schedule == "interleaved" and (g // dp) % pp:
        raise _fail(
            "--global-batch-size",
            f"Megatron's interleaved schedule needs the microbatches per replica (G/DP = "
            f"{g // dp}) to be a multiple of PP={pp}",
        )


def _check_training(config: TrainConfig) -> None:
    t, lg = config.train, config.logging
    if t.train_iters is None or t.train_iters < 1:
        raise _fail("--train-iters", f"set the number of iterations (>= 1), got {t.train_iters}")
    if t.lr is None or not t.lr > 0:
        raise _fail("--lr", f"set a positive peak learning rate, got {t.lr}")
    if not 0 <= t.min_lr <= t.lr:
        raise _fail("--min-lr", f"must lie in [0, --lr={t.lr}], got {t.min_lr}")
    if t.lr_warmup_iters < 0:
        raise _fail("--lr-warmup-iters", f"must be >= 0, got {t.lr_warmup_iters}")
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if decay < 1 or t.lr_warmup_iters >= decay:
        raise _fail("--lr-decay-iters", f"{decay} must be >= 1 and > --lr-warmup-iters")
    if t.clip_grad < 0 or t.weight_decay < 0:
        raise _fail("--clip-grad/--weight-decay", "must be >= 0")
    if lg.log_interval < 1:
        raise _fail("--log-interval", f"must be >= 1, got {lg.log_interval}")
    if lg.eval_interval is not None and (lg.eval_interval < 1 or lg.eval_iters < 1):
        raise _fail("--eval-interval/--eval-iters", "must be >= 1")
    if config.dip.dip_trace_interval < 1:
        raise _fail("--dip-trace-interval", "must be >= 1")
    if config.dip.dip_max_nonfinite_iters < 0:
        raise _fail("--dip-max-nonfinite-iters", "must be >= 0 (0: never stop)")
    check_checkpoint_flags(config)


def _sized(config: TrainConfig, *, model, cost, data, base, pp, device):
    """`layout.build_layout` of the run under `config`'s layout flags."""
    from .layout import build_layout  # the placement and sizing step

    sub_sizes = parse_sub_sizes(config.dip.dip_sub_microbatch_size, model)
    return build_layout(
        config, model, cost, data=data, base=base, pp=pp, sub_sizes=sub_sizes, device=device
    )


def _sized_or_kept(config, build, resume, header, *, dp, segments_given, sizes_given):
    """The run's layout: kept from the checkpoint it resumes (`resume`, with its `header` as
    `check_checkpoints` read it) where it may (`resumed_layout`), else sized and searched
    (`build`). Runs on the rank that sizes the job."""
    kept = None
    if resume is not None and not segments_given:  # (no "searched again" line for a given one)
        kept = kept_layout(config, header, source=str(resume.path), data_parallel=dp)
    return size_run(config, build, kept, segments_given=segments_given, sizes_given=sizes_given)


def _check_emulation(config: TrainConfig) -> None:
    d = config.dip
    if not (d.dip_emulate_scale >= 0 and math.isfinite(d.dip_emulate_scale)):
        raise _fail(
            "--dip-emulate-scale", f"must be a finite number >= 0, got {d.dip_emulate_scale}"
        )
    if config.parallel.use_distributed_optimizer or config.model.bf16:
        raise _fail(
            "--dip-emulate-compute",
            "emulated chunks have one float32 parameter each: drop --bf16 and "
            "--use-distributed-optimizer (the cost model already prices the bf16 run)",
        )


def _check_dip(config: TrainConfig) -> None:
    d = config.dip
    if d.dip_search_time_ms < 0:
        raise _fail("--dip-search-time-ms", f"must be >= 0, got {d.dip_search_time_ms}")
    if d.dip_lookahead < 0:
        raise _fail("--dip-lookahead", f"must be >= 0, got {d.dip_lookahead}")
    if d.dip_receive_lead not in (0, 1):
        raise _fail(
            "--dip-receive-lead",
            f"must be 0 or 1 (computes a receive is posted ahead), got {d.dip_receive_lead}",
        )
    if not d.dip_comm_timeout_s > 0:  # also refuses NaN
        raise _fail(
            "--dip-comm-timeout-s",
            f"must be > 0 seconds (how long a blocking pipeline wait may take), "
            f"got {d.dip_comm_timeout_s}",
        )
    minutes = config.parallel.distributed_timeout_minutes
    if minutes is not None and not minutes > 0:
        raise _fail(
            "--distributed-timeout-minutes",
            f"must be > 0 minutes (how long the ranks wait for rank 0's start-up sizing), "
            f"got {minutes}",
        )
    if not d.dip_planner_timeout_s > 0:
        raise _fail(
            "--dip-planner-timeout-s",
            f"must be > 0 seconds (how long the planner process may stay silent), "
            f"got {d.dip_planner_timeout_s}",
        )
    half = max(1, (os.cpu_count() or 2) // 2)
    if not 1 <= d.dip_planner_workers <= half:
        raise _fail(
            "--dip-planner-workers",
            f"must lie in [1, {half}] (half of this machine's {os.cpu_count()} cores: the rest "
            f"feed the accelerators), got {d.dip_planner_workers}",
        )
    if d.dip_startup_workers < 0:
        raise _fail(
            "--dip-startup-workers",
            f"must be >= 0 (0: one per usable CPU core), got {d.dip_startup_workers}",
        )
    for flag, value in (
        ("--dip-split-search", d.dip_split_search),
        ("--dip-split-backward-always", d.dip_split_backward_always),
    ):
        if value and not d.dip_split_backward:
            raise _fail(flag, "needs --dip-split-backward")
    if d.dip_memory_limit_gb is not None and not d.dip_memory_limit_gb > 0:
        raise _fail("--dip-memory-limit-gb", f"must be > 0, got {d.dip_memory_limit_gb}")
    if d.dip_data_scale is not None and not d.dip_data_scale > 0:
        raise _fail("--dip-data-scale", f"must be > 0, got {d.dip_data_scale}")


def parse_sub_sizes(text: str | None, model: MultimodalSpec) -> dict[str, int] | None:
    """`--dip-sub-microbatch-size`: "N" for every module split into sub-microbatches, or
    "vit=12,text=4"."""
    if text is None:
        return None
    encoders = [m.name for m in split_modules(model)]
    flag = "--dip-sub-microbatch-size"
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.rpartition("=") if "=" in part else ("", "", part)
        try:
            size = int(value)
        except ValueError:
            raise _fail(flag, f"{part!r} is not N or MODULE=N") from None
        if size < 1:
            raise _fail(flag, f"sub-microbatch sizes must be >= 1, got {size} in {part!r}")
        targets = [name.strip()] if sep else encoders
        for t in targets:
            if t not in encoders:
                raise _fail(
                    flag,
                    f"module {t!r} is not split into sub-microbatches; choose among {encoders} "
                    "(an LLM microbatch is one packed sequence)",
                )
            sizes[t] = size
    return sizes


def _run_shape(config: TrainConfig, *, tp: int, pp: int, dp: int, dtype: str) -> ParallelShape:
    """The run's parallel shape as the cost model and planner price it (the real run's under
    --dip-emulate-compute), built once here: --sequence-parallel checked (it needs TP > 1 and a
    --seq-length TP divides); whether it is in effect is the shape's to say."""
    shape = ParallelShape(
        tp=tp,
        pp=pp,
        dp=dp,
        sp=config.parallel.sequence_parallel,
        dtype=dtype,
        seq_length=config.train.seq_length,
    )
    try:
        shape.check_sequence_parallel()
    except ShapeError as e:
        raise ConfigError(str(e)) from None
    return shape


def _process_shape(
    shape: ParallelShape, *, emulate: bool, dtype: str, stock: bool, stage_units
) -> ParallelShape:
    """The shape of the processes themselves (`RunSpec.shape`): an emulated run folds TP into
    the cost model (one process per pipeline rank and replica, no sequence parallelism) and
    computes in the flags' dtype; a stock interleaved run has virtual stages."""
    interleaved = stock and stage_units and len(stage_units[0]) > 1
    vp = len(stage_units[0]) if interleaved else None
    if emulate:
        shape = shape.replace(tp=1, sp=False)
    return shape.replace(dtype=dtype, vp=vp)


def check_tensor_parallel(model: MultimodalSpec, tp: int) -> None:
    """ConfigError naming --tensor-model-parallel-size unless TP divides every sharded size."""
    for m in model.modules:
        lay = m.layer
        for what, value in (("heads", lay.heads), ("kv groups", lay.kv_groups), ("FFN", lay.ffn)):
            if value % tp:
                raise _fail(
                    "--tensor-model-parallel-size",
                    f"TP={tp} does not divide the {what} ({value}) of module {m.name!r}",
                )
        if m.vocab_size and m.vocab_size % tp:
            raise _fail(
                "--tensor-model-parallel-size",
                f"TP={tp} does not divide the vocabulary ({m.vocab_size}) of module {m.name!r}",
            )


def _check_tied_embeddings(config: TrainConfig, model: MultimodalSpec, placement) -> None:
    """Tied embeddings in two chunks (their gradients summed over Megatron's embedding group
    after the data-parallel reduction) need whole gradients on every rank: not with the
    distributed optimizer, whose ranks each hold a shard of the reduced gradients."""
    if not config.parallel.use_distributed_optimizer:
        return
    for m in model.modules:
        chunks = placement.module(m.name).num_chunks
        if m.arch.tie_embeddings and chunks > 1:
            raise _fail(
                "--use-distributed-optimizer",
                f"module {m.name!r} has tied input/output embeddings (its preset or "
                f"--dip-hf-config's tie_word_embeddings) in {chunks} chunks, which the "
                "distributed optimizer does not support here: drop it, pass "
                "--untie-embeddings-and-output-weights (the head starts as a copy of the "
                f"embedding) or use one chunk (--pipeline-model-parallel-size 1 --dip-segments "
                f"{m.name}=1)",
            )


def resolve(
    config: TrainConfig, *, world_size: int, cuda: bool, shared: Callable | None = None
) -> RunSpec:
    """Check `config` for a world of `world_size` processes and build the `RunSpec`.
    `shared(compute)`: how the ranks of a job share the sizing step (`build_layout`, with its
    start-up placement search): computed on one rank and handed to the others (default: here)."""
    # Before the preset fills them in: whether the user chose the layout (`resumed_layout`).
    given = {"segments_given": config.dip.dip_segments is not None}
    given["sizes_given"] = config.dip.dip_sub_microbatch_size is not None
    config, preset = apply_preset(config)
    model, tokenizer_spec, tokenizer = model_spec(config, preset)
    emulate = config.dip.dip_emulate_compute
    tp, pp, dp = _parallel_sizes(config, world_size, emulate=emulate)
    _check_training(config)
    recompute = recompute_mode(config)  # refuses a bad combination
    _check_dip(config)
    check_tensor_parallel(model, tp)
    dtype = "bfloat16" if config.model.bf16 else "float32"
    # An emulated run prices and shapes messages as the real (bf16, GPU) run it stands for.
    shape = _run_shape(config, tp=tp, pp=pp, dp=dp, dtype="bfloat16" if emulate else dtype)
    data = data_spec(config, model, tokenizer_spec, tokenizer, dp=dp)
    device = run_device(config, cuda=cuda)
    cost = _priced(config, model, device, shape=shape, cuda=cuda, dtype=dtype)
    base = _base_planner(config, model, shape=shape, recompute=recompute)
    # Read-only, before the minutes of the placement search: a bad --load / --save fails now.
    resume, pretrained, header = check_checkpoints(config, model)
    build = functools.partial(
        _sized,
        model=model,
        cost=cost,
        data=data,
        base=base,
        pp=pp,
        device=device if cuda or emulate else None,
    )
    sizing = functools.partial(_sized_or_kept, config, build, resume, header, dp=dp, **given)
    layout = sizing() if shared is None else shared(sizing)
    _check_tied_embeddings(config, model, layout.placement)
    planner = replace(
        base, sub_sizes=dict(layout.sub_sizes), memory_limit_bytes=layout.memory_limit
    )
    create_save(config)  # last: every check has passed
    return RunSpec(
        preset=preset,
        model=model,
        schedule=config.dip.dip_schedule,
        cuda=cuda,
        dtype=dtype,
        shape=_process_shape(
            shape,
            emulate=emulate,
            dtype=dtype,
            stock=config.dip.dip_schedule != "dip",
            stage_units=layout.stage_units,
        ),
        distributed_optimizer=config.parallel.use_distributed_optimizer,
        overlap_grad_reduce=config.parallel.overlap_grad_reduce,
        data=data,
        limits=base.packing,
        sub_sizes=layout.sub_sizes,
        device=device,
        cost_model=cost,
        placement=layout.placement,
        stage_units=layout.stage_units,
        planner=planner,
        memory_limit_bytes=layout.memory_limit,
        training=training_settings(config),
        checkpointing=checkpointing_settings(config),
        reporting=reporting_settings(config),
        runtime=runtime_limits(config),
        stock_placement=config.dip.dip_stock_placement,
        segments=layout.segments,
        placement_name=layout.placement_name,
        emulate_scale=config.dip.dip_emulate_scale if emulate else None,
        recompute=recompute,
        resume=resume,
        pretrained=pretrained,
        flags=config.flat(),
    )


def _parallel_sizes(config: TrainConfig, world_size: int, *, emulate: bool) -> tuple[int, ...]:
    """(TP, PP, DP) of the run, checked against the world."""
    if not emulate:
        return _check_sizes(config, world_size)
    # Emulated cluster: one process per pipeline rank (and replica); TP is folded into the
    # cost model, which prices each stage as a TP rank of the real run would compute it.
    _check_emulation(config)
    _, pp, dp = _check_sizes(config.replace(tensor_model_parallel_size=1), world_size)
    return config.parallel.tensor_model_parallel_size, pp, dp


def _priced(config: TrainConfig, model, device, *, shape, cuda: bool, dtype: str) -> CostModel:
    """The run's cost model: the kernels its chunks run (Transformer Engine's queued weight
    GEMMs included) on `device`."""
    emulate = config.dip.dip_emulate_compute
    delay = delays_weight_gradients(
        config.dip.dip_schedule, split_backward=config.dip.dip_split_backward
    )
    kernels = run_kernels(config, cuda=cuda, dtype=dtype, emulate=emulate, delay_wgrad=delay)
    _warn_split_without_delayed_wgrad(config, cuda=cuda, emulate=emulate)
    return run_cost_model(config, model, device, shape=shape, kernels=kernels)


def _base_planner(config: TrainConfig, model, *, shape, recompute) -> PlannerConfig:
    """The planner's configuration from the flags, before the sizing step fixes its
    sub-microbatch sizes and memory limit."""
    d = config.dip
    return planner_config(
        shape=shape,
        packing=packing_limits(model, config.train.seq_length),
        search=search_settings(config),
        use_search=d.dip_search_time_ms > 0,
        uniform_recompute=None if recompute == NO_RECOMPUTE else recompute,
        offload_activations=d.dip_offload_activations,
        split_backward=d.dip_split_backward,
        split_search=d.dip_split_search,
        split_always=d.dip_split_backward_always,
        recompute_modules=RECOMPUTE_MODULES if d.dip_recompute_modules else (),
        sub_size_scales=COARSER_SUB_SIZES if d.dip_coarser_sub_microbatches else (),
        # Safe on the per-pair communicators every pipeline of a run gets (`RunGroups`).
        receive_lead=d.dip_receive_lead if shape.pp > 1 else 0,
    )


def _warn_split_without_delayed_wgrad(config: TrainConfig, *, cuda: bool, emulate: bool) -> None:
    """--dip-split-backward on Transformer Engine layers too old to queue their weight GEMMs
    (TE < 2.3): the split stays exact, but W re-runs those layers' backwards, which the cost
    model does not price; say so once, at start-up."""
    if not config.dip.dip_split_backward or emulate or not cuda:
        return
    te = megatron_compat.transformer_engine_available()
    if te and not megatron_compat.te_delays_weight_gradients():
        logger.warning(
            "--dip-split-backward: Transformer Engine < %s cannot delay its layers' weight "
            "GEMMs; each split backward's W re-runs those layers' backwards (exact, slower "
            "than planned)",
            megatron_compat.TE_DELAYED_WGRAD,
        )
