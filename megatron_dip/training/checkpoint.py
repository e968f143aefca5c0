"""Checkpoints keyed by GLOBAL parameter name, of FULL tensors: they load under any layout.

Layout of `--save DIR` (plain per-rank `torch.save` of global-name dictionaries; chosen over
torch.distributed.checkpoint because the mapping between layouts is a rename plus Megatron's
own tensor-parallel cut, not a general resharding):

    DIR/latest_checkpointed_iteration.txt     the newest complete checkpoint (Megatron-LM's name)
    DIR/iter_0000100/metadata.json            rank 0: format, iteration, sizes, model, LR scheduler,
                                              data positions (BatchStream.state_dict of the
                                              training and evaluation streams), cost-model
                                              calibration (scales, version, partial window sums:
                                              a resumed run recalibrates at the same iterations),
                                              consumed samples, flags, and the index
                                              {parameter key: file holding it}
    DIR/iter_0000100/model_rank_00003.pt      TP rank 0 of data-parallel replica 0: {"model":
                                              {key: tensor}, "optimizer": {key: {exp_avg,
                                              exp_avg_sq, step[, master]}}} of its chunks, full
                                              tensors (the distributed optimizer's shards are
                                              gathered over data parallelism, TP shards over
                                              the TP group; both cut again on load)
    DIR/iter_0000100/rng_rank_00003.pt        every rank: python, numpy, torch (and CUDA) RNG

A key is the global parameter name (`models.init.global_param_name`: module, global layer index,
local path). Loading finds each local parameter's key in the index and cuts this rank's
tensor-parallel shard with Megatron's partition metadata (`partition_dim`; a gated MLP's fc1 cuts
its gate and up halves separately: `models.init.shard_for_rank`, the rule the weights were
initialised by), so PP, TP, DP, --dip-schedule and --use-distributed-optimizer may all differ
between save and load. RNG states are restored only under the same world layout.

Atomic: every rank writes into `iter_N.tmp`; after a barrier rank 0 renames it to `iter_N`
(moving an older copy aside first) and only then rewrites the tracker file (write + rename), so a
crash at any point leaves the previous checkpoint and the tracker consistent. Multi-node runs need
a shared file system for DIR.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_dip.models.init import shard_for_rank

from .build import LocalModel
from .optim import gather_named_state, load_named_state
from .setup import ParallelContext
from .validate import RunSpec

logger = logging.getLogger(__name__)

FORMAT = "megatron-dip-checkpoint/2"
# Format 1 keyed tensor-parallel shards "NAME#tpR"; at TP=1 it is format 2.
_READABLE = {FORMAT: None, "megatron-dip-checkpoint/1": 1}
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Restored:
    """What a loaded checkpoint hands back to the loop."""

    iteration: int
    consumed_samples: int
    stream: dict
    calibration: dict
    eval_stream: dict | None = None  # None: no evaluation had run before the save


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _glu_params(model: LocalModel) -> set[int]:
    """ids of gated-MLP fc1 parameters: Megatron keeps [gate; up] per TP rank, so their halves
    are split separately (as `models.init` initialises them)."""
    return {
        id(p)
        for chunk in model.inner
        if chunk.module_spec.layer.gated_mlp
        for local, p in chunk.named_parameters()
        if "linear_fc1." in local
    }


def _tp_sharded(p: torch.Tensor, ctx: ParallelContext) -> bool:
    return ctx.tp.size() > 1 and getattr(p, "tensor_model_parallel", False)


def _gather_tp(t: torch.Tensor, p: torch.Tensor, ctx: ParallelContext, glu: bool) -> torch.Tensor:
    """The full tensor of which `t` is this TP rank's shard (inverse of `shard_for_rank`);
    collective over the TP group. Tensors of unsharded parameters come back as they are."""
    if not _tp_sharded(p, ctx) or t.shape != p.shape:
        return t
    # NCCL gathers device tensors; the result is kept on the CPU.
    parts = [torch.empty_like(t, device=p.device) for _ in range(ctx.tp.size())]
    dist.all_gather(parts, t.to(p.device).contiguous(), group=ctx.tp)
    dim = p.partition_dim
    if glu:
        halves = [torch.chunk(x, 2, dim=dim) for x in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves]
    return torch.cat(parts, dim=dim).cpu()


def _full_payload(model: LocalModel, optimizer_state: dict, ctx: ParallelContext) -> dict:
    """{"model": {name: full tensor}, "optimizer": {name: {key: full tensor}}} of this rank's
    parameters, tensor-parallel shards gathered (collective over the TP group)."""
    glu = _glu_params(model)
    params, states = {}, {}
    for name, p in model.named_parameters():
        cut = id(p) in glu
        params[name] = _gather_tp(p.detach().cpu().clone(), p, ctx, cut)
        if name in optimizer_state:
            states[name] = {k: _gather_tp(v, p, ctx, cut) for k, v in optimizer_state[name].items()}
    return {"model": params, "optimizer": states}


def _shard(t: torch.Tensor, p: torch.Tensor, ctx: ParallelContext, glu: bool) -> torch.Tensor:
    """This TP rank's shard of the full tensor `t` of parameter `p` (scalars pass)."""
    if not _tp_sharded(p, ctx) or t.dim() == 0:
        return t
    return shard_for_rank(t, p, tp_rank=ctx.tp_rank, tp_size=ctx.tp.size(), glu=glu)


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


def _model_signature(spec: RunSpec) -> list:
    return [
        [
            m.name,
            m.kind,
            m.num_layers,
            m.layer.hidden,
            m.layer.ffn,
            m.layer.heads,
            m.vocab_size,
        ]
        for m in spec.model.modules
    ]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


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
) -> Path:
    """Write the checkpoint of `iteration` (call on every rank; see the module docstring)."""
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    keys: list[str] = []
    # Collective under --use-distributed-optimizer: every rank holds shards of the state.
    optimizer_state = gather_named_state(optimizer, model.named_parameters(), dp_group=ctx.dp)
    if ctx.dp_rank == 0:
        payload = _full_payload(model, optimizer_state, ctx)  # collective over TP
        if ctx.tp_rank == 0:
            torch.save(payload, tmp / f"model_rank_{ctx.rank:05d}.pt")
            keys = list(payload["model"])
    torch.save(_rng_state(), tmp / f"rng_rank_{ctx.rank:05d}.pt")
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, keys)
    if ctx.rank == 0:
        index: dict[str, str] = {}
        for rank, rank_keys in enumerate(gathered):
            for k in rank_keys:
                index.setdefault(k, f"model_rank_{rank:05d}.pt")
        meta = {
            "format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
            "world_size": ctx.world_size, "tensor_parallel": spec.tensor_parallel,
            "pipeline_parallel": spec.pipeline_parallel, "data_parallel": spec.data_parallel,
            "schedule": spec.schedule, "model": _model_signature(spec),
            "scheduler": scheduler.state_dict(), "stream": stream_state,
            "eval_stream": eval_stream_state,
            "calibration": calibration, "index": index, "flags": spec.config.flat(),
        }  # fmt: skip
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=1, default=str))
    dist.barrier()
    if ctx.rank == 0:
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _atomic_write(Path(root) / TRACKER, str(iteration))
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    logger.info("saved checkpoint of iteration %d to %s", iteration, final)
    return final


def has_checkpoint(root: str | Path) -> bool:
    """Whether `root` has a tracker file (a completed save)."""
    return (Path(root) / TRACKER).exists()


def find(root: str | Path, step: int | None = None) -> Path:
    """The checkpoint directory to load: iteration `step`, or the tracker's latest."""
    root = Path(root)
    if step is None:
        tracker = root / TRACKER
        if not tracker.exists():
            raise FileNotFoundError(f"--load {root}: no {TRACKER} (nothing saved there yet)")
        step = int(tracker.read_text().strip())
    path = iteration_dir(root, step)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"--load {root}: no complete checkpoint of iteration {step}")
    return path


def _check_compatible(meta: Mapping, spec: RunSpec, path: Path) -> None:
    fmt = meta.get("format")
    if fmt not in _READABLE:
        raise ValueError(f"{path}: format {fmt!r}, expected {FORMAT!r}")
    if _READABLE[fmt] is not None and meta["tensor_parallel"] != _READABLE[fmt]:
        raise ValueError(
            f"{path}: format {fmt!r} saved at TP={meta['tensor_parallel']} keeps per-rank "
            "tensor-parallel shards this version does not read; re-save it at TP=1"
        )
    if meta["model"] != _model_signature(spec):
        raise ValueError(
            f"{path}: saved from model {meta['model']}, this run builds {_model_signature(spec)}"
        )


def _load_tensors(path: Path, meta: Mapping, wanted: list[str]) -> tuple[dict, dict]:
    files: dict[str, list[str]] = {}
    for key in wanted:
        if key not in meta["index"]:
            raise KeyError(f"{path}: no parameter {key!r} in the checkpoint")
        files.setdefault(meta["index"][key], []).append(key)
    params, states = {}, {}
    for name, keys in files.items():
        payload = torch.load(path / name, map_location="cpu", weights_only=True, mmap=True)
        for k in keys:
            params[k] = payload["model"][k]
            if k in payload["optimizer"]:
                states[k] = payload["optimizer"][k]
    return params, states


def load(
    path: Path,
    *,
    spec: RunSpec,
    ctx: ParallelContext,
    model: LocalModel,
    optimizer,
    scheduler,
) -> Restored:
    """Load `path` into this rank's chunks, optimizer and scheduler (module docstring)."""
    meta = json.loads((path / "metadata.json").read_text())
    _check_compatible(meta, spec, path)
    named = model.named_parameters()
    names = {id(p): n for n, p in named}
    params, states = _load_tensors(path, meta, list(names.values()))
    glu = _glu_params(model)
    with torch.no_grad():
        for name, p in named:
            saved = _shard(params[name], p, ctx, id(p) in glu)
            if saved.shape != p.shape:
                raise ValueError(
                    f"{path}: {name} has shape {tuple(saved.shape)} here (TP rank {ctx.tp_rank} "
                    f"of {ctx.tp.size()}), the model {tuple(p.shape)}"
                )
            p.copy_(saved)
            if name in states:
                states[name] = {k: _shard(v, p, ctx, id(p) in glu) for k, v in states[name].items()}
    if hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # Megatron: fp32 master copies from the loaded weights
    c = spec.config.checkpoint
    if not c.no_load_optim:
        load_named_state(optimizer, names, states)
        scheduler.load_state_dict(meta["scheduler"])
    same_layout = (
        meta["world_size"] == ctx.world_size and meta["pipeline_parallel"] == spec.pipeline_parallel
    )
    rng = path / f"rng_rank_{ctx.rank:05d}.pt"
    if not c.no_load_rng and same_layout and rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    logger.info(
        "loaded checkpoint of iteration %d from %s (saved at PP=%d DP=%d, %s)",
        meta["iteration"], path, meta["pipeline_parallel"], meta["data_parallel"], meta["schedule"],
    )  # fmt: skip
    return Restored(
        meta["iteration"], meta["consumed_samples"], meta["stream"], meta["calibration"],
        eval_stream=meta.get("eval_stream"),
    )  # fmt: skip
