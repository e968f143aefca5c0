"""The checkpoint flags checked, alone (`check_checkpoint_flags`) and against the file system
(`check_checkpoints`: --load, --finetune, the pretrained weights, --save, --train-iters), before
the start-up placement search so that a bad directory fails in seconds; `create_save` makes --save
once every check of the run has passed. Nothing here writes before then."""

from __future__ import annotations

from megatron_dip.modelspec import MultimodalSpec

from ..checkpoint import dirs
from ..checkpoint.dirs import CheckpointError
from .arguments import ConfigError, TrainConfig
from .arguments import fail as _fail


def check_checkpoint_flags(config: TrainConfig) -> None:
    """The checkpoint flags' own combinations (`ConfigError` naming the flag), before any
    file is looked at."""
    c = config.checkpoint
    if c.save_interval is not None and (c.save_interval < 1 or c.save is None):
        raise _fail("--save-interval", "needs --save and a value >= 1")
    if c.ckpt_format != "torch_dist":  # Megatron-LM's parser allows others
        raise _fail("--ckpt-format", f"only torch_dist is supported, got {c.ckpt_format!r}")
    if c.async_save and c.save is None:
        raise _fail("--async-save", "needs --save")
    if c.ckpt_step is not None and c.load is None:
        raise _fail("--ckpt-step", "needs --load")


def check_checkpoints(config: TrainConfig, model: MultimodalSpec) -> tuple:
    """(the checkpoint --load resumes from or None, the pretrained weights to start from, our
    header of the resumed checkpoint's common state or None), after checking --load,
    --finetune, --pretrained-checkpoint, --dip-pretrained, --save and --train-iters against the
    file system (`checkpoint.dirs`, `finetune`), touching nothing (`create_save` makes
    --save)."""
    from ..checkpoint.finetune import pretrained_sources
    from ..checkpoint.resume_checks import check_resume

    c = config.checkpoint
    try:
        if c.load and not (c.pretrained_checkpoint or c.dip_pretrained):
            # (with pretrained weights, a --load that is not there yet is Megatron's idiom for
            # "fine-tune from them until this run has its own checkpoints")
            dirs.check_load_exists(c.load, save=c.save)
        resume = dirs.find_resume(c.load, c.ckpt_step) if c.load else None
        resume, pretrained = pretrained_sources(config, model, resume)
        dirs.check_train_iters(resume, config.train.train_iters)
        if c.save is not None:
            dirs.check_save(c.save, load=None if c.finetune else c.load)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    header = check_resume(config, resume)
    return resume, pretrained, header


def create_save(config: TrainConfig) -> None:
    """Make --save once the run's every check has passed (`dirs.create_save`)."""
    if config.checkpoint.save is None:
        return
    try:
        dirs.create_save(config.checkpoint.save)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
