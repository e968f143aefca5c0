"""A resumed DIP run keeps the placement and sub-microbatch sizes its checkpoint was trained with.

The start-up placement search (`layout`) takes minutes on the paper's setups, and its answer
depends only on the run's flags and data, so a run that resumes (`--load`, a restart after a
failure) would find the same answer again. Each training checkpoint therefore records the
layout as the flags that rebuild it without searching (`recorded_layout`: `--dip-segments`,
static placements included, and `--dip-sub-microbatch-size`), and a resumed run takes them
(`size_run`) where

* the user gave neither flag (a given one always wins; `--dip-segments auto` searches again);
* the checkpoint is this run's to resume (not a `--finetune` start) and was saved by DIP with
  the same data-parallel size and the same value of every flag the sizing reads (all but
  `SIZING_FREE`: training length, learning-rate schedule, checkpoint and logging paths,
  timeouts, the planner process's settings), the model's among them.

Otherwise, or when the recorded flags no longer build (a ConfigError), the run searches as a
fresh one does, and says why. The layout changes only how fast a run goes, never its
gradients, so keeping it can never make a resumed run wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .arguments import ConfigError, TrainConfig

logger = logging.getLogger(__name__)

# The checkpoint header's entry (`checkpoint.state.save`).
HEADER_KEY = "layout_flags"

# Flags that do not feed the start-up sizing: they may change on resume.
SIZING_FREE = frozenset(
    {
        # training length and the optimizer's schedule
        "train_iters", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters",
        "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps",
        "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
        # checkpoints, logging, evaluation, data loading processes
        "save", "load", "save_interval", "ckpt_step", "no_load_optim", "no_load_rng",
        "async_save", "ckpt_format", "log_interval", "eval_interval", "eval_iters",
        "tensorboard_dir", "num_workers", "dip_trace_dir", "dip_trace_interval",
        "dip_metrics_json", "dip_log_blend", "dip_allow_outside_paths",
        # waits and the planner process (the start-up search scores greedy plans)
        "distributed_timeout_minutes", "dip_comm_timeout_s", "dip_planner_timeout_s",
        "dip_max_nonfinite_iters", "dip_search_time_ms", "dip_planner_workers",
        "dip_startup_workers", "dip_lookahead", "dip_calibration_window",
        "dip_calibration_frozen",
        # the layout itself (kept only where not given)
        "dip_segments", "dip_sub_microbatch_size",
    }
)  # fmt: skip


@dataclass(frozen=True)
class KeptLayout:
    """The layout flags a checkpoint recorded, and where they come from."""

    segments: str
    sub_sizes: str | None
    source: str  # the checkpoint's directory, for the log


def recorded_layout(segments_flag: str, sub_sizes: Mapping[str, int]) -> dict:
    """The checkpoint header's entry for a DIP run placed by `segments_flag`
    (`layout.placement_flag`) with encoder sub-microbatch sizes `sub_sizes`."""
    sizes = ",".join(f"{k}={v}" for k, v in sub_sizes.items())
    return {"segments": segments_flag, "sub_sizes": sizes or None}


def _changed_flags(saved: Mapping, config: TrainConfig) -> list[str]:
    now = config.flat()
    keys = (set(saved) | set(now)) - SIZING_FREE
    return sorted(k for k in keys if saved.get(k) != now.get(k))


def kept_layout(
    config: TrainConfig, header: Mapping | None, *, source: str, data_parallel: int
) -> KeptLayout | None:
    """The layout that the header of the checkpoint a run resumes (`source`; None: it has none
    that can be read, which the load then names) recorded, if this run of `data_parallel`
    replicas may keep it (module docstring)."""
    if header is None or config.dip.dip_schedule != "dip":
        return None
    recorded = header.get(HEADER_KEY)
    if not isinstance(recorded, Mapping) or not recorded.get("segments"):
        return None  # saved by a stock schedule, or by a release that did not record it
    changed = _changed_flags(header.get("flags", {}), config)
    if header.get("layout", {}).get("data_parallel") != data_parallel:
        changed.append("data-parallel size")
    if changed:
        logger.info(
            "start-up layout: searched again, not kept from %s, whose run differs in %s",
            source,
            ", ".join(k if " " in k else "--" + k.replace("_", "-") for k in changed),
        )
        return None
    return KeptLayout(recorded["segments"], recorded.get("sub_sizes"), source)


def size_run(
    config: TrainConfig,
    build: Callable[[TrainConfig], object],
    kept: KeptLayout | None,
    *,
    segments_given: bool,
    sizes_given: bool,
):
    """`build(config)` (`layout.build_layout` of the run), with the `kept` layout's flags in
    place of those the user did not give (`segments_given`, `sizes_given`: before the
    `--model` preset filled them in); searched as a fresh run where they no longer build."""
    if kept is None or segments_given:
        return build(config)
    flags = {"dip_segments": kept.segments}
    if not sizes_given and kept.sub_sizes:
        flags["dip_sub_microbatch_size"] = kept.sub_sizes
    try:
        layout = build(config.replace(**flags))
    except ConfigError as e:
        logger.warning(
            "start-up layout: the placement recorded in %s no longer builds (%s); searching",
            kept.source,
            e,
        )
        return build(config)
    logger.info(
        "start-up layout: kept from %s without searching: --dip-segments %s%s "
        "(--dip-segments auto searches again)",
        kept.source,
        kept.segments,
        f" --dip-sub-microbatch-size {flags['dip_sub_microbatch_size']}"
        if "dip_sub_microbatch_size" in flags
        else "",
    )
    return layout
