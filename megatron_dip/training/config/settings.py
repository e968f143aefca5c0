"""The settings a `RunSpec` carries, read off the checked flags (presets already filled in): the
optimisation, checkpointing, reporting, the runtime's limits and the planner process's search.
Each flag is read here once; everything after `validate.resolve` reads these values."""

from __future__ import annotations

from megatron_dip.planner.search import SearchConfig

from ..checkpoint.resume_checks import schedule_of
from .arguments import TrainConfig
from .run import Checkpointing, Reporting, RuntimeLimits, Training


def training_settings(config: TrainConfig) -> Training:
    """The optimisation settings of `config` (preset defaults already filled in), resolved."""
    t, m = config.train, config.model
    return Training(
        iterations=t.train_iters,
        global_batch_size=t.global_batch_size,
        seq_length=t.seq_length,
        seed=t.seed,
        init_std=m.init_method_std,
        per_token_loss=m.calculate_per_token_loss,
        attention=config.dip.dip_attention,
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        clip_grad=t.clip_grad,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        schedule=schedule_of(t),
        override_opt_param_scheduler=t.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
    )


def checkpointing_settings(config: TrainConfig) -> Checkpointing:
    """Where and when the run saves, and what it loads (the flags checked by
    `checkpoint_flags`)."""
    c = config.checkpoint
    return Checkpointing(
        save=c.save,
        save_interval=c.save_interval,
        async_save=c.async_save,
        load=c.load,
        no_load_optim=c.no_load_optim,
        no_load_rng=c.no_load_rng,
    )


def reporting_settings(config: TrainConfig) -> Reporting:
    """What the run logs, evaluates, traces and writes as metrics, and how often."""
    lg, d = config.logging, config.dip
    return Reporting(
        log_interval=lg.log_interval,
        eval_interval=lg.eval_interval,
        eval_iters=lg.eval_iters,
        tensorboard_dir=lg.tensorboard_dir,
        trace_dir=d.dip_trace_dir,
        trace_interval=d.dip_trace_interval,
        metrics_json=d.dip_metrics_json,
        log_blend=d.dip_log_blend,
    )


def runtime_limits(config: TrainConfig) -> RuntimeLimits:
    """The runtime's waits, plan look-ahead, cost calibration and non-finite tolerance."""
    d = config.dip
    return RuntimeLimits(
        comm_timeout_s=d.dip_comm_timeout_s,
        planner_timeout_s=d.dip_planner_timeout_s,
        lookahead=d.dip_lookahead,
        calibration_window=d.dip_calibration_window,
        calibration_frozen=d.dip_calibration_frozen,
        max_nonfinite_iters=d.dip_max_nonfinite_iters,
    )


def startup_timeout_s(config: TrainConfig) -> float:
    """Seconds the other ranks wait for rank 0's start-up sizing (the placement search):
    Megatron-LM's --distributed-timeout-minutes where given (its launch scripts pass it, and a
    search on a large model may take longer than any pipeline wait), else --dip-comm-timeout-s."""
    minutes = config.parallel.distributed_timeout_minutes
    return config.dip.dip_comm_timeout_s if minutes is None else 60.0 * minutes


def search_settings(config: TrainConfig) -> SearchConfig:
    """The planner process's search: it stops after its rollout budget or --dip-search-time-ms,
    whichever comes first (only the planner process searches; every rank runs its plan)."""
    d = config.dip
    return SearchConfig(
        time_budget_s=d.dip_search_time_ms / 1e3,
        workers=d.dip_planner_workers,
        seed=config.train.seed,
    )
