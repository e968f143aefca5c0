"""Training checkpoints in Megatron-Core's dist_checkpointing `torch_dist` format, keyed globally,
so a checkpoint loads under any PP, TP, DP, --dip-schedule and --use-distributed-optimizer.

What one checkpoint holds (the files: `storage`; the directories and tracker:
`checkpoint.dirs`):

* the weights: every chunk's `sharded_state_dict()` (`models.sharded`): global parameter name
  (module, GLOBAL layer index), global shape, this rank's TP offset, replica ids;
* the optimizer state in the same coordinates (`optim_state`): Adam's moments, fp32 masters of
  16-bit weights, saved by each data-parallel rank for the elements it holds;
* each rank's RNG states (python, numpy, torch, CUDA) as one `ShardedObject` per rank, restored
  only when the world layout is the same;
* the common state (`common.pt`, rank 0): "megatron_dip" (format, content "training" or
  "weights", iteration, model signature, layout, schedule, flags, the modules' records:
  `modelspec.module_record`, and a DIP run's placement and sub-microbatch sizes as flags, which
  a resumed run keeps: `config.resumed_layout`), "training" (consumed samples,
  LR schedule, positions of the training and evaluation data streams, cost-model calibration:
  a resumed run recalibrates at the same iterations) and Adam's step.

Resharding is dist_checkpointing's: each rank asks for the tensors it holds in the loading run
and reads the parts of the saved chunks that overlap them. Every rank writes only its shards;
no tensor is gathered. `save_weights` / `load_weights` write and read the weights alone (no
optimizer, no training state) for any placement and TP layout: what an importer of Hugging Face
weights writes, and `--load ... --no-load-optim` starts from.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_dip.models.sharded import chunks_sharded_state_dict
from megatron_dip.modelspec import ModuleSpec, MultimodalSpec, module_record
from megatron_dip.runtime.checks import unwrap_chunk

from ..assembly.build import LocalModel
from ..assembly.setup import ParallelContext
from ..config.resumed_layout import HEADER_KEY as LAYOUT_FLAGS
from ..config.run import RunSpec
from . import checksums, optim_state, storage
from .dirs import (
    FORMAT,
    CheckpointError,
    find_resume,
    load_hint,
)
from .resume_checks import scheduler_state_to_load
from .storage import CheckpointWriter

logger = logging.getLogger(__name__)

_RNG_KEY = "rng_state"


@dataclass(frozen=True)
class Restored:
    """What a loaded checkpoint hands back to the loop (None: not in it, e.g. weights only)."""

    iteration: int
    consumed_samples: int = 0
    stream: dict | None = None
    calibration: dict | None = None
    eval_stream: dict | None = None  # None: no evaluation had run before the save


def module_signature(m: ModuleSpec) -> list:
    """One module's entry of `model_signature`."""
    return [m.name, m.kind, m.num_layers, m.layer.hidden, m.layer.ffn, m.layer.heads, m.vocab_size]


def model_signature(model: MultimodalSpec) -> list:
    """What must match between a checkpoint and the model loading it (shapes per module)."""
    return [module_signature(m) for m in model.modules]


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_object(ctx: ParallelContext, data):
    from megatron.core.dist_checkpointing import ShardedObject

    return ShardedObject(_RNG_KEY, data, (ctx.world_size,), (ctx.rank,), replica_id=0)


def _layout(spec: RunSpec) -> dict:
    shape = spec.shape
    return {
        "world_size": shape.world_size, "tensor_parallel": shape.tp,
        "pipeline_parallel": shape.pp, "data_parallel": shape.dp,
    }  # fmt: skip


def save(
    root: str | Path,
    *,
    iteration: int,
    spec: RunSpec,
    ctx: ParallelContext,
    model: LocalModel,
    optimizer,
    scheduler,
    stream_state: dict,
    calibration: dict,
    consumed_samples: int,
    eval_stream_state: dict | None = None,
    writer: CheckpointWriter | None = None,
) -> Path:
    """Write the checkpoint of `iteration` as `root/iter_N` (call on every rank). `writer`: the
    run's (it may save asynchronously); a synchronous one by default."""
    optimizer_sd, optimizer_common = optim_state.sharded_state(
        optimizer, model.param_layouts(), dp_rank=ctx.dp_rank
    )
    header = {
        "format": FORMAT, "content": "training", "iteration": iteration,
        "model": model_signature(spec.model), "layout": _layout(spec),
        "schedule": spec.schedule, "flags": dict(spec.flags),
        "modules": [module_record(m) for m in spec.model.modules],
        LAYOUT_FLAGS: spec.layout_flags,  # what a resumed run keeps (`resumed_layout`)
    }  # fmt: skip
    training = {
        "consumed_samples": consumed_samples, "scheduler": scheduler.state_dict(),
        "stream": stream_state, "eval_stream": eval_stream_state, "calibration": calibration,
    }  # fmt: skip
    state = {
        "model": model.sharded_state_dict(data_parallel_rank=ctx.dp_rank),
        "optimizer": optimizer_sd,
        "rng": _rng_object(ctx, _rng_state()),
        "megatron_dip": header,
        "training": training,
        "optimizer_common": optimizer_common,
    }
    writer = writer or CheckpointWriter(group=ctx.dp, async_save=False)
    return writer.save(state, root, iteration)


def check_header(common: Mapping, path: Path, model: MultimodalSpec | None) -> dict:
    """The header of a checkpoint's common state: one of ours, saved from `model` (any model
    when None: a per-module load checks the tensors themselves)."""
    header = common.get("megatron_dip") if isinstance(common, Mapping) else None
    if not isinstance(header, Mapping) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, Mapping) else None
        raise CheckpointError(
            f"{path}: a torch_dist checkpoint, but not one of megatron-dip's {FORMAT!r} "
            f"(format {found!r}); its tensors are not keyed by our global parameter names"
        )
    if model is not None and header["model"] != model_signature(model):
        raise CheckpointError(
            f"{path}: saved from model {header['model']}, this run builds {model_signature(model)}"
        )
    return dict(header)


def load(
    path: Path,
    *,
    spec: RunSpec,
    ctx: ParallelContext,
    model: LocalModel,
    optimizer,
    scheduler,
) -> Restored:
    """Load `path` into this rank's chunks, optimizer, scheduler and RNG (module docstring);
    collective. Every file is checked against the manifest first."""
    checksums.verify(path, hint=load_hint(path))
    common = storage.load_common(path)
    header = check_header(common, path, spec.model)
    c = spec.checkpointing
    training = header["content"] == "training"
    if not c.no_load_optim and not training:
        raise CheckpointError(
            f"{path}: holds model weights only (no optimizer or training state): pass "
            "--no-load-optim to start the optimizer and LR schedule afresh from them"
        )
    saved = storage.tensor_metadata(path)
    saved_keys = set(saved)
    request: dict = {"model": model.sharded_state_dict(data_parallel_rank=ctx.dp_rank)}
    masters, set_steps = False, None
    if not c.no_load_optim:
        if not any(k.startswith("optimizer.state.") for k in saved_keys):
            raise CheckpointError(
                f"{path}: holds no optimizer state (saved before the first update): pass "
                "--no-load-optim"
            )
        request["optimizer"], masters, set_steps = optim_state.load_request(
            optimizer, model.param_layouts(), dp_rank=ctx.dp_rank, saved_keys=saved_keys
        )
    if training and not c.no_load_rng and header["layout"] == _layout(spec):
        request["rng"] = _rng_object(ctx, None)
    loaded = storage.load_sharded(request, path, saved=saved)
    if not masters and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # Megatron: fp32 masters from the loaded weights
    if set_steps is not None:
        set_steps(common["optimizer_common"]["step"] or 0)
        scheduler.load_state_dict(
            scheduler_state_to_load(scheduler, common["training"]["scheduler"])
        )
    if "rng" in request:
        _set_rng_state(loaded["rng"])
    if not training:
        logger.info("loaded the weights of %s (iteration %d)", path, header["iteration"])
        return Restored(header["iteration"])
    layout = header["layout"]
    logger.info(
        "loaded checkpoint of iteration %d from %s (saved at TP=%d PP=%d DP=%d, %s)",
        header["iteration"],
        path,
        layout["tensor_parallel"],
        layout["pipeline_parallel"],
        layout["data_parallel"],
        header["schedule"],
    )
    t = common["training"]
    return Restored(
        header["iteration"],
        t["consumed_samples"],
        t["stream"],
        t["calibration"],
        eval_stream=t["eval_stream"],
    )


def save_weights(
    root: str | Path,
    *,
    model: MultimodalSpec,
    chunks: Sequence[torch.nn.Module],
    iteration: int = 0,
    data_parallel_group: dist.ProcessGroup | None = None,
) -> Path:
    """Write the weights of `chunks` (this process's model chunks, any placement and TP; DDP
    wrappers allowed) as the checkpoint `root/iter_N` with the tracker, in the training
    checkpoints' format: `load_weights`, and training with `--load root --no-load-optim`, read
    it under any layout. Collective over the world group; `data_parallel_group`: the replicas
    holding the same chunks (each tensor is written once), None when there is one replica."""
    inner = [unwrap_chunk(c) for c in chunks]
    dp_rank = data_parallel_group.rank() if data_parallel_group is not None else 0
    header = {
        "format": FORMAT, "content": "weights", "iteration": iteration,
        "model": model_signature(model), "layout": {"world_size": dist.get_world_size()},
        "schedule": None, "flags": None, "modules": [module_record(m) for m in model.modules],
    }  # fmt: skip
    state = {
        "model": chunks_sharded_state_dict(inner, data_parallel_rank=dp_rank),
        "megatron_dip": header,
    }
    return CheckpointWriter(group=data_parallel_group, async_save=False).save(
        state, root, iteration
    )


def load_weights(
    root: str | Path,
    *,
    model: MultimodalSpec,
    chunks: Sequence[torch.nn.Module],
    step: int | None = None,
    data_parallel_group: dist.ProcessGroup | None = None,
) -> int:
    """Load the weights of a checkpoint under `root` (the tracker's, or iteration `step`) into
    `chunks` in place, whatever layout saved it (training checkpoints too); returns its
    iteration. Collective over the world group (files are verified first);
    `data_parallel_group` as for `save_weights`."""
    resume = find_resume(root, step)
    if resume is None:
        raise CheckpointError(f"{root}: no checkpoint there")
    checksums.verify(resume.path)
    check_header(storage.load_common(resume.path), resume.path, model)
    inner = [unwrap_chunk(c) for c in chunks]
    dp_rank = data_parallel_group.rank() if data_parallel_group is not None else 0
    request = {"model": chunks_sharded_state_dict(inner, data_parallel_rank=dp_rank)}
    storage.load_sharded(request, resume.path)
    return resume.iteration
