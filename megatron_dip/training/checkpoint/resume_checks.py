"""What a resumed run must agree on with the checkpoint it loads, checked before any process
group exists (so a mismatch is one line, exit status 2, before any work).

* The LR schedule (Megatron-LM's rule): a flag of the schedule (--lr, --min-lr, --lr-warmup-iters,
  --lr-decay-iters or --train-iters where it sets the decay's length, --lr-decay-style,
  --weight-decay) that differs from the checkpoint's is refused unless
  --override-opt_param-scheduler (the flags win; the iteration count stays the checkpoint's) or
  --use-checkpoint-opt_param-scheduler (the checkpoint wins) says which wins. Without the
  optimizer state (--no-load-optim, --finetune) the schedule starts afresh from the flags.
* The data order: --seed, the batch and sequence sizes and whether oversize samples stop the run
  (`DATA_FLAGS`: what the data stream a checkpoint continues was formed with); a change is one
  line naming the flag and both values.
"""

from __future__ import annotations

from pathlib import Path

from ..config.arguments import ConfigError
from .dirs import CheckpointError, ResumePoint

# What a checkpoint's LR schedule holds (`OptimizerParamScheduler.state_dict()`'s keys) and the
# flag that sets each.
SCHEDULE_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay", "end_wd": "--weight-decay",
}  # fmt: skip


def schedule_of(t) -> dict:
    """The LR and weight-decay schedule of the --lr* flags (`TrainArgs` `t`), as Megatron-Core's
    `OptimizerParamScheduler` takes it (and its `state_dict` holds it)."""
    return {
        "max_lr": t.lr, "min_lr": t.min_lr, "lr_warmup_steps": t.lr_warmup_iters,
        "lr_decay_steps": t.lr_decay_iters or t.train_iters, "lr_decay_style": t.lr_decay_style,
        "start_wd": t.weight_decay, "end_wd": t.weight_decay,
    }  # fmt: skip


def schedule_differences(t, saved: dict) -> list[tuple[str, object, object]]:
    """(flag, this run's value, the checkpoint's) of each schedule value that differs, in
    `SCHEDULE_FLAGS` order; the decay length only where it changes the decay (not constant)."""
    mine, out = schedule_of(t), []
    for key, flag in SCHEDULE_FLAGS.items():
        if key not in saved or saved[key] == mine[key] or (key == "end_wd" and out):
            continue
        if key == "lr_decay_steps":
            if saved.get("lr_decay_style") == mine["lr_decay_style"] == "constant":
                continue
            if t.lr_decay_iters is None:  # the decay's length is --train-iters
                out.append(("--train-iters", mine[key], saved[key]))
                continue
        out.append((flag, mine[key], saved[key]))
    return out


def scheduler_state_to_load(scheduler, saved: dict) -> dict:
    """`saved` as Megatron's `load_state_dict` should see it: values that change nothing (the
    length of a constant decay or weight-decay schedule) taken from this run, so that its
    equality check (neither --override- nor --use-checkpoint-opt_param-scheduler) holds once
    `resume_checks` has found the rest equal."""
    state = dict(saved)
    if state.get("lr_decay_style") == scheduler.lr_decay_style == "constant":
        state["lr_decay_steps"] = scheduler.lr_decay_steps
    if state.get("wd_incr_style") == scheduler.wd_incr_style == "constant":
        state["wd_incr_steps"] = scheduler.wd_incr_steps
    return state


# The flags whose change breaks the continuation of the data stream a checkpoint saved (its
# order, batch and packing: `StreamConfig.signature`), which `BatchStream.load_state_dict` would
# refuse only after loading. Not the data paths: the data may move.
DATA_FLAGS = {
    "seed": "--seed", "global_batch_size": "--global-batch-size", "seq_length": "--seq-length",
    "dip_bad_samples": "--dip-bad-samples",
}  # fmt: skip


def _data_value(key: str, value):
    """What of a data flag's value the stream depends on (--dip-bad-samples: error or not)."""
    return value == "error" if key == "dip_bad_samples" else value


def check_resume(config, resume: ResumePoint | None) -> dict | None:
    """Refuse (`ConfigError`, one line) a resume whose data configuration or LR schedule differs
    from the checkpoint's (module docstring); reads only the checkpoint's common state, once it
    matches the manifest (a damaged checkpoint is the load's to name). Returns our header of
    that common state, read once here for whatever else start-up asks of it (the layout a
    resumed run keeps); None when not resuming (or `--finetune`) or when it cannot be read."""
    if resume is None or config.checkpoint.finetune:
        return None
    common = _common_state(resume.path)
    header = common.get("megatron_dip") if isinstance(common, dict) else None
    if not isinstance(header, dict):
        return None
    if header.get("content") == "training":
        _check_data(config, header, resume)
        _check_schedule(config, common, resume)
    return header


def _check_data(config, header: dict, resume: ResumePoint) -> None:
    """The data flags (`DATA_FLAGS`) against the checkpoint's."""
    saved_flags = header.get("flags") or {}
    mine = config.flat()
    for key, flag in DATA_FLAGS.items():
        if key in saved_flags and _data_value(key, saved_flags[key]) != _data_value(
            key, mine.get(key)
        ):
            raise ConfigError(
                f"{flag}: {mine.get(key)!r} here, {saved_flags[key]!r} in the checkpoint "
                f"{resume.path}: the data order it saved would not continue; pass "
                f"{flag} {saved_flags[key]} to resume it, or --finetune to take its weights only"
            )


def _check_schedule(config, common: dict, resume: ResumePoint) -> None:
    """The LR schedule's flags against the checkpoint's (unless the optimizer starts afresh or
    an option says which wins)."""
    if config.checkpoint.no_load_optim:
        return
    t = config.train
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler: and --use-checkpoint-opt_param-scheduler exclude "
            "each other (the flags' LR schedule or the checkpoint's): pass one"
        )
    if t.override_opt_param_scheduler or t.use_checkpoint_opt_param_scheduler:
        return
    differ = schedule_differences(t, common["training"]["scheduler"])
    if differ:
        flag, here, there = differ[0]
        more = f" (also {', '.join(f for f, _, _ in differ[1:])})" if len(differ) > 1 else ""
        raise ConfigError(
            f"{flag}: {here} here, {there} in the LR schedule of the checkpoint "
            f"{resume.path}{more}: pass --override-opt_param-scheduler to train with this "
            "run's flags, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )


def _common_state(path: Path) -> dict | None:
    """The common state of checkpoint `path` once its file matches the manifest; None when it
    cannot be read (the load verifies every file and names the damage, on every rank)."""
    from . import checksums, storage

    try:
        manifest = checksums.read_manifest(path)
        files = storage.common_state_files(path)
        if not files or any(f not in manifest for f in files):
            return None
        if checksums.check_files(path, manifest, files):
            return None
        return storage.load_common(path)
    except CheckpointError:
        return None
