"""The entry points' body: parse -> validate (before any process group) -> initialise -> train.

`main(argv, default_model=...)` is what `pretrain_vlm_dip.py` and `pretrain_diffusion_dip.py` call.
A bad flag ends the process with exit status 2 and one line naming the flag, before
torch.distributed is initialised (a --save directory another job holds: 2 as well, right after) (so a job launched with bad flags fails fast on every rank
instead of hanging in a collective). A checkpoint that cannot be loaded (corrupt, of another
model), a run whose loss stays non-finite and a rank that stalled or died (`StallError`, naming
the phase, the group and the stalled rank) end it with exit status 1 and one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from .config.arguments import ConfigError, TrainConfig, parse_config
from .config.run import RunSpec
from .config.settings import startup_timeout_s
from .config.validate import resolve

logger = logging.getLogger("megatron_dip.training")


def setup_logging(rank: int) -> None:
    """INFO on rank 0 (the log lines), warnings only elsewhere; Megatron-Core's own INFO
    messages (bucket listings) and its CPU fallback warnings are left out. Warnings every rank
    would repeat word for word are rank 0's alone: the configuration's (every rank resolves the
    same flags) and the planner service's (the log line counts inline plans)."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    if rank != 0:
        for said_by_rank_0 in ("megatron_dip.planner.service", "megatron_dip.training.config"):
            logging.getLogger(said_by_rank_0).setLevel(logging.ERROR)
    for text in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "`load_state_dict` is deprecated",  # inside dist_checkpointing's torch_dist loader
    ):
        warnings.filterwarnings("ignore", message=f".*{text}.*")
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[%(asctime)s rank " + str(rank) + "] %(message)s",
        datefmt="%H:%M:%S",
    )


def world_size_from_env() -> int:
    """The launcher's world size (torchrun/SLURM), or the live process group's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def validated(config: TrainConfig, *, world_size: int) -> RunSpec:
    """`resolve` with the machine's CUDA availability; under torchrun with several processes,
    the sizing step (start-up placement search) runs on rank 0 and is shared with the others."""
    import functools

    import torch

    cuda = torch.cuda.is_available()
    shared = None
    if world_size > 1 and "RANK" in os.environ:
        from .assembly.setup import shared_by_rank0

        shared = functools.partial(
            shared_by_rank0,
            cuda=cuda,
            timeout_s=config.dip.dip_comm_timeout_s,
            startup_timeout_s=startup_timeout_s(config),
        )
    return resolve(config, world_size=world_size, cuda=cuda, shared=shared)


def main(argv: Sequence[str] | None = None, *, default_model: str) -> int:
    """Run a training job; returns the process exit status."""
    setup_logging(int(os.environ.get("RANK", "0")))
    config = parse_config(argv, default_model=default_model)
    try:
        spec = validated(config, world_size=world_size_from_env())
    except ConfigError as e:
        logger.error("error: %s", e)
        return 2
    from megatron_dip.runtime.errors import StallError

    from .checkpoint.dirs import CheckpointError
    from .iteration.nonfinite import NonFiniteError

    try:
        train(spec)
    except ConfigError as e:  # refused at start-up (another job holds --save)
        logger.error("error: %s", e)
        return 2
    except StallError as e:
        logger.error("error: %s", e)
        exit_now(1)
    except (CheckpointError, NonFiniteError) as e:
        logger.error("error: %s", e)
        return 1
    return 0


def exit_now(status: int) -> NoReturn:
    """End this process at once, after flushing the log: a rank that stopped over a stall
    would otherwise wait in the process groups' destructors for the operations it had posted
    to its stalled peers to time out (seconds, up to --dip-comm-timeout-s), and outlive the
    job. The training state is already released (`loop.pretrain`'s cleanup ran)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def train(spec: RunSpec):
    """Train a validated run on this process (process groups are created here)."""
    from .iteration.loop import pretrain

    if int(os.environ.get("RANK", "0")) == 0:
        logger.info(
            "run %s: %s | TP %d PP %d DP %d | schedule %s | placement %s",
            spec.preset.name,
            spec.model.name,
            spec.shape.tp,
            spec.shape.pp,
            spec.shape.dp,
            spec.schedule,
            _placement_text(spec),
        )
    result = pretrain(spec)
    if result.losses and int(os.environ.get("RANK", "0")) == 0:
        first, last = min(result.losses), max(result.losses)
        logger.info(
            "done: lm loss %.4f (iteration %d) -> %.4f (iteration %d)",
            result.losses[first],
            first,
            result.losses[last],
            last,
        )
    return result


def _placement_text(spec: RunSpec) -> str:
    parts = []
    for m in spec.placement.modules:
        layers = ",".join(str(c.num_layers) for c in m.chunks)
        parts.append(f"{m.name}: {m.num_chunks} chunks [{layers}] layers")
    return "; ".join(parts)
