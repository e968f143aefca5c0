"""A rank's start-up: the world, its process groups, device and RNG (Megatron's `parallel_state` is
never initialised).

The groups are created by `megatron_dip.parallel.groups` from the run's `ParallelShape` (rank
order Megatron-LM's default "tp-dp-pp": global rank = tp_rank + TP * (dp_rank + DP * pp_rank),
so tensor-parallel peers are neighbours (one node) and pipeline stages are furthest apart). The
backend is chosen by the machine: NCCL when CUDA is available, gloo otherwise (then the
Megatron-Core CPU fixes are applied, through `cpu_support` only). A process group that already
exists (a launcher that initialised torch.distributed) is reused. Groups are created on every
rank in the same order, and only the ones a rank belongs to are kept.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dip.cpu_support import seed_model_parallel_rng
from megatron_dip.parallel.groups import (
    ChannelGroups,
    RunGroups,
    create_run_groups,
    startup_group,
)
from megatron_dip.runtime.stalls import NoWatch, PhaseWatch

from ..config.run import RunSpec

logger = logging.getLogger(__name__)


@dataclass
class ParallelContext:
    """This rank's coordinates and process groups."""

    rank: int
    world_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    mp: dist.ProcessGroup  # pipeline x tensor ranks of one replica (gradient norm)
    single: dist.ProcessGroup
    device: torch.device
    created: list = field(default_factory=list, repr=False)
    owns_world: bool = False
    # One communicator per (sender, receiver) pair of the pipeline (runtime.ChannelGroups): a
    # slow receiver then holds up only the messages between those two ranks.
    channels: ChannelGroups | None = None
    # The ranks of this pipeline holding copies of a tied LLM embedding (its first and last
    # chunk; Megatron's embedding group); None on the others and without tied copies.
    embedding: dist.ProcessGroup | None = None
    # Named phases, heartbeat and stall post-mortem of this rank (runtime/stalls.py).
    watch: PhaseWatch | NoWatch = field(default_factory=NoWatch)
    # The run's groups as one value (parallel/groups.py): its `collection()` is the run's one
    # Megatron ProcessGroupCollection (DDP, optimizer).
    groups: RunGroups | None = field(default=None, repr=False)

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    def destroy(self) -> None:
        """Stop the heartbeat; destroy the groups this run created (and the world group if
        it created it)."""
        if isinstance(self.watch, PhaseWatch):
            self.watch.stop()
        for g in self.created:
            dist.destroy_process_group(g)
        self.created.clear()
        if self.owns_world and dist.is_initialized():
            dist.destroy_process_group()


_WORLD_CREATED_HERE = [False]  # whether init_distributed made the world group (ours to destroy)


def init_distributed(*, cuda: bool, timeout_s: float = 600.0) -> bool:
    """Initialise torch.distributed from torchrun's environment unless already done; returns
    whether the world group is ours (this module created it, now or at start-up for
    `shared_by_rank0`), so the run's context destroys it."""
    if dist.is_initialized():
        return _WORLD_CREATED_HERE[0]
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    _WORLD_CREATED_HERE[0] = True
    logger.info("initialised torch.distributed (%s, world %d)", backend, dist.get_world_size())
    return True


def shared_by_rank0(compute, *, cuda: bool, timeout_s: float, startup_timeout_s: float):
    """`compute()` run on rank 0 only and its result (or its ConfigError) handed to every rank:
    the start-up sizing and placement search runs once per job, not once per rank. Creates the
    world group (`init_distributed`, `timeout_s`: --dip-comm-timeout-s); the wait for rank 0
    goes through a gloo group of its own, bounded by `startup_timeout_s`
    (--distributed-timeout-minutes), and the group is destroyed after."""
    init_distributed(cuda=cuda, timeout_s=timeout_s)
    group = startup_group(timedelta(seconds=startup_timeout_s))
    try:
        return _rank0_result(compute, group, startup_timeout_s)
    finally:
        dist.destroy_process_group(group)


def _rank0_result(compute, group, timeout_s: float):
    """`compute()`'s outcome on rank 0, broadcast over `group` to every rank."""
    from ..config.arguments import ConfigError

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", compute())]
        except ConfigError as e:
            box = [("config", str(e))]
        except Exception as e:  # the others must not wait for a result that never comes
            dist.broadcast_object_list([("error", f"{type(e).__name__}: {e}")], 0, group=group)
            raise
    try:
        dist.broadcast_object_list(box, 0, group=group)
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {dist.get_rank()}: rank 0's start-up sizing (placement search) did not "
            f"arrive within {timeout_s:g} s (--distributed-timeout-minutes, by default "
            f"--dip-comm-timeout-s): {e}"
        ) from None
    kind, value = box[0]
    if kind == "config":
        raise ConfigError(value)
    if kind == "error":
        raise RuntimeError(f"rank 0 failed in the start-up sizing: {value}")
    return value


def tied_stages(spec: RunSpec) -> tuple[int, ...]:
    """Pipeline ranks holding the copies of a tied input/output embedding (the first and the
    last chunk of the module that ties them); () when no module has two copies."""
    for m in spec.model.modules:
        layout = spec.placement.module(m.name)
        if m.arch.tie_embeddings and layout.num_chunks > 1:
            return tuple(sorted({layout.chunks[0].rank, layout.chunks[-1].rank}))
    return ()


def initialize(spec: RunSpec) -> ParallelContext:
    """Process groups, device and seeded RNG for `spec` (call once per run on every rank)."""
    # Every blocking wait, collectives included, is bounded by --dip-comm-timeout-s: new groups
    # do not inherit the world group's timeout, so each one is given it (NCCL's watchdog enforces
    # it on CUDA, where the runtime's own waits do not block; see runtime/p2p.py).
    timeout_s = spec.runtime.comm_timeout_s
    timeout = timedelta(seconds=timeout_s)
    owns = init_distributed(cuda=spec.cuda, timeout_s=timeout_s)
    groups = create_run_groups(spec.shape, tied_stages=tied_stages(spec), timeout=timeout)
    me, (tp_rank, _, dp_rank, pp_rank) = groups.rank, groups.coordinates
    device = torch.device("cuda", torch.cuda.current_device()) if spec.cuda else torch.device("cpu")
    # Seeds torch and Megatron's RNG tracker; on CPU applies the Megatron-Core CPU fixes.
    seed_model_parallel_rng(spec.training.seed, tp_rank=tp_rank)
    ctx = ParallelContext(
        rank=me,
        world_size=spec.shape.world_size,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        tp=groups.tp,
        dp=groups.dp,
        pp=groups.pp,
        mp=groups.mp,
        single=groups.single,
        device=device,
        created=groups.created,
        owns_world=owns,
        channels=groups.channels,
        embedding=groups.embedding,
        groups=groups,
    )
    try:
        ctx.watch = PhaseWatch.for_world(timeout_s=timeout_s, early=spec.cuda)
    except (AttributeError, RuntimeError, ValueError) as e:  # a world without a default store
        logger.warning("no store to watch the ranks through (%s): stalls are not named", e)
    else:
        ctx.watch.start()
    logger.debug("rank %d: tp %d dp %d pp %d", me, tp_rank, dp_rank, pp_rank)
    return ctx


def warm_up_pipeline(ctx: ParallelContext, peers: set[int]) -> None:
    """Exchange one small tensor with every pipeline peer in a single batched send/receive on
    every rank of the pipeline group (NCCL creates its communicators on the first batched call
    and wants every rank of the group in it), then touch the data- and tensor-parallel groups."""
    ops = []
    for peer in sorted(peers):
        dst = dist.get_global_rank(ctx.pp, peer)
        ops.append(dist.P2POp(dist.isend, torch.ones(1, device=ctx.device), dst, group=ctx.pp))
        ops.append(dist.P2POp(dist.irecv, torch.empty(1, device=ctx.device), dst, group=ctx.pp))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    works = []
    for sender, receiver in ctx.channels.pairs() if ctx.channels is not None else ():
        group = ctx.channels.group(sender, receiver)
        if ctx.pp_rank == sender:
            op = dist.P2POp(
                dist.isend,
                torch.ones(1, device=ctx.device),
                dist.get_global_rank(ctx.pp, receiver),
                group=group,
            )
        else:
            op = dist.P2POp(
                dist.irecv,
                torch.empty(1, device=ctx.device),
                dist.get_global_rank(ctx.pp, sender),
                group=group,
            )
        works += dist.batch_isend_irecv([op])
    for work in works:
        work.wait()
    for group in (ctx.dp, ctx.tp, ctx.mp):
        if group.size() > 1:
            dist.all_reduce(torch.zeros(1, device=ctx.device), group=group)
    dist.barrier()


def pipeline_peers(placement, rank: int) -> set[int]:
    """Pipeline ranks `rank` exchanges messages with under `placement`: neighbouring chunks of a
    module, and each producer module's last chunk with its consumer's first chunk."""
    peers: set[int] = set()
    modules = {m.name: m for m in placement.modules}
    pairs = [(a.rank, b.rank) for m in placement.modules for a, b in zip(m.chunks, m.chunks[1:])]
    for m in placement.modules:
        for other in modules.values():
            if other is not m:
                pairs.append((m.chunks[-1].rank, other.chunks[0].rank))
    for a, b in pairs:
        if a != b and rank in (a, b):
            peers.add(b if a == rank else a)
    return peers
