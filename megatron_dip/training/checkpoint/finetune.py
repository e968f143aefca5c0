"""Starting from pretrained weights, as Megatron-LM does (--finetune, --pretrained-checkpoint),
and per module (--dip-pretrained vit=DIR,llm=DIR).

* `--load DIR --finetune`: the weights of DIR's checkpoint (the tracker's, or --ckpt-step), and
  nothing else: iteration 0, a fresh optimizer, LR schedule, RNG and data position.
* `--pretrained-checkpoint DIR`: the same for DIR when --load holds no checkpoint yet; once the
  run has saved into --load, a restart resumes from there (Megatron-LM's way of making a
  fine-tuning run restartable: `--pretrained-checkpoint A --load B --save B`).
* `--dip-pretrained MODULE=DIR,...`: like --pretrained-checkpoint, each named module's weights
  from its own checkpoint (e.g. a ViT from one run, an LLM imported from Hugging Face by
  tools/hf_checkpoint.py); modules not named keep their initialisation (or
  --pretrained-checkpoint's weights). Only that module's tensors are read, so the checkpoint
  may come from another model holding a module of the same name and shapes.

`pretrained_sources` decides (torch-free, in `validate`); `load_pretrained` loads (collective,
resharding as any load does: any TP / PP / DIP placement).
"""

from __future__ import annotations

import logging

from megatron_dip.modelspec import MultimodalSpec

from ..config.arguments import TrainConfig
from . import dirs
from .dirs import CheckpointError, ResumePoint

logger = logging.getLogger(__name__)

WHOLE_MODEL = ""


def parse_dip_pretrained(text: str | None, model: MultimodalSpec) -> dict[str, str]:
    """`--dip-pretrained vit=DIR,llm=DIR` as {module: directory}."""
    out: dict[str, str] = {}
    names = [m.name for m in model.modules]
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        module, sep, folder = part.partition("=")
        if not sep or not folder:
            raise CheckpointError(f"--dip-pretrained: {part!r} is not MODULE=DIR")
        if module not in names:
            raise CheckpointError(f"--dip-pretrained: the model has no module {module!r} ({names})")
        out[module] = folder
    return out


def _required(flag: str, folder: str) -> ResumePoint:
    try:
        point = dirs.find_resume(folder, None)
    except CheckpointError as e:
        raise CheckpointError(f"{flag}: {e}") from None
    if point is None:
        raise CheckpointError(f"{flag} {folder}: no checkpoint there")
    return point


def pretrained_sources(
    config: TrainConfig, model: MultimodalSpec, resume: ResumePoint | None
) -> tuple[ResumePoint | None, tuple[tuple[str, ResumePoint], ...]]:
    """(the checkpoint to resume from, the (module, checkpoint) weights to start from) under
    the flags (module docstring); CheckpointError naming the flag otherwise."""
    c = config.checkpoint
    per_module = parse_dip_pretrained(c.dip_pretrained, model)
    if c.finetune and c.load is None and c.pretrained_checkpoint is None:
        raise CheckpointError("--finetune: needs --load DIR (or --pretrained-checkpoint DIR)")
    sources: list[tuple[str, ResumePoint]] = []
    if resume is not None and c.finetune:
        sources.append((WHOLE_MODEL, resume))
        resume = None
    elif resume is not None:
        if c.pretrained_checkpoint or per_module:
            logger.info("--load %s holds a checkpoint: resuming, pretrained weights unused", c.load)
        return resume, ()
    elif c.pretrained_checkpoint is not None:
        sources.append((WHOLE_MODEL, _required("--pretrained-checkpoint", c.pretrained_checkpoint)))
    for module, folder in per_module.items():
        sources.append((module, _required("--dip-pretrained", folder)))
    return resume, tuple(sources)


def load_pretrained(sources, *, model: MultimodalSpec, chunks, data_parallel_rank: int) -> None:
    """Load each (module, checkpoint) of `sources` into this rank's `chunks` (unwrapped
    `ModelChunk`s) in place; collective over the world group. The whole model's source must
    have been saved from this model (its signature); a module's source must hold that
    module's tensors with the same global shapes (checked, naming the tensor)."""
    from megatron_dip.models.sharded import chunks_sharded_state_dict

    from . import checksums, storage
    from .state import check_header

    for module, point in sources:
        checksums.verify(point.path)
        whole = module == WHOLE_MODEL
        common = storage.load_common(point.path)
        check_header(common, point.path, model if whole else None)
        mine = [c for c in chunks if whole or c.chunk.module == module]
        request = {"model": chunks_sharded_state_dict(mine, data_parallel_rank=data_parallel_rank)}
        storage.load_sharded(request, point.path)
        logger.info(
            "loaded pretrained weights of %s from %s (iteration %d)",
            "the model" if whole else f"module {module!r}",
            point.path,
            point.iteration,
        )
