"""The process groups of a run: the one module of the package that creates any.

`create_run_groups(shape)` creates, on every rank and in the same order (torch.distributed wants
group creation collective), one group per rank, the tensor-, data-, pipeline- and model-parallel
groups, the tied-embedding group and the pipeline's per-pair channels, keeping the ones this rank
belongs to; the rank lists come from `grid` (Megatron-LM's tp-cp-dp-pp order). `RunGroups` then
hands out the run's one Megatron `ProcessGroupCollection` (DDP, optimizer). The two narrowed
collections are built here too: what the layers read (`layer_collection`, from the models'
`ModelGroups`) and what the stock schedules read (`schedule_collection`, the stock adapter's).
`importer_groups` makes the Hugging Face importer's groups (a world of TP x PP processes, no
data parallelism), `startup_group` the start-up's own. `ChannelGroups` is also built by tests
over groups of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_dip import megatron_compat

from . import grid
from .shape import ParallelShape


def _new_group(
    ranks: Sequence[int], timeout: timedelta | None, backend: str | None = None
) -> dist.ProcessGroup:
    """The one call of the package that creates a process group (collective over the world)."""
    return dist.new_group(list(ranks), timeout=timeout, backend=backend)


def _new_groups(
    rank_lists: Sequence[Sequence[int]], me: int, created: list, timeout: timedelta | None
) -> dist.ProcessGroup | None:
    """Create one group per rank list (on every rank alike); this rank's group, or None."""
    mine = None
    for ranks in rank_lists:
        group = _new_group(ranks, timeout)
        if me in ranks:
            mine = group
            created.append(group)
    return mine


class ChannelGroups:
    """One 2-rank process group per ordered (sender, receiver) pair of a pipeline group.

    Created once per training run. Group creation is collective over the whole world, so every
    rank must construct this with the same `pipelines`: the global ranks of every pipeline group
    of the job, in the same order (default: the pipeline group is the whole world). Each rank
    keeps the groups of its own pipeline; with P pipeline ranks it belongs to 2 (P - 1) of them.
    `timeout`: the groups' timeout (new groups do not inherit the world group's; None: torch's
    default).
    """

    def __init__(
        self,
        pp_group: dist.ProcessGroup,
        *,
        pipelines: Sequence[Sequence[int]] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        self.pp_group = pp_group
        mine = [dist.get_global_rank(pp_group, r) for r in range(pp_group.size())]
        pipelines = [list(p) for p in (pipelines or [mine])]
        if mine not in pipelines:
            raise ValueError(f"pipeline {mine} of this rank is not among {pipelines}")
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        me = pp_group.rank()
        for index, a, b, ranks in grid.channel_pairs(pipelines):
            group = _new_group(ranks, timeout)
            if pipelines[index] == mine and me in (a, b):
                self._groups[(a, b)] = group

    def group(self, sender: int, receiver: int) -> dist.ProcessGroup:
        """The group carrying messages from pipeline rank `sender` to `receiver`."""
        return self._groups[(sender, receiver)]

    def pairs(self) -> list[tuple[int, int]]:
        """The (sender, receiver) pipeline-rank pairs this rank belongs to, sorted."""
        return sorted(self._groups)


def run_collection(*, tp, dp, pp, mp, single, cp=None) -> Any:
    """Megatron's `ProcessGroupCollection` of a run without expert parallelism: what
    Megatron-Core's DDP wrapper and optimizer read. `single` (this rank alone) stands in for the
    expert groups, and for `cp` when not given; dp_cp is dp while CP = 1."""
    return megatron_compat.process_group_collection(
        dp=dp,
        dp_cp=dp,
        tp=tp,
        pp=pp,
        mp=mp,
        cp=cp or single,
        ep=single,
        expt_dp=single,
        tp_ep_pp=mp,
        # One distributed-optimizer instance spans every rank of the run: its gradient norm sums
        # the squares of every DP shard of every pipeline and tensor rank (Megatron's
        # parallel_state gives the same group); the DP group alone would clip each pipeline
        # stage by its own norm.
        intra_dist_opt=dist.group.WORLD,
    )


def layer_collection(*, tp, cp) -> Any:
    """The `ProcessGroupCollection` Megatron's layers read. `pp` is None on purpose: with a
    pipeline size of 1 in the layers' config, the layer offset is 0 whatever the pipeline rank."""
    return megatron_compat.process_group_collection(tp=tp, cp=cp, pp=None)


def schedule_collection(*, pp, single) -> Any:
    """The `ProcessGroupCollection` the stock adapter (runtime/stock.py) gives Megatron's stock
    schedules: the pipeline group, this rank alone for TP, CP and DP x CP, and no embedding
    groups (the adapter's DDP hooks and the run's own gradient sync do the reductions)."""
    return megatron_compat.process_group_collection(
        tp=single, cp=single, dp_cp=single, embd=None, pos_embd=None, pp=pp
    )


@dataclass(frozen=True)
class RunGroups:
    """This rank's process groups of a run of `shape` (created once, `create_run_groups`).

    `single`: this rank alone. `mp`: the pipeline x tensor ranks of one replica (gradient norm).
    `cp`: the context-parallel group (this rank alone: CP = 1, `ParallelShape` refuses more).
    `embedding`: the ranks of this pipeline holding copies of a tied LLM embedding (Megatron's
    embedding group), None without tied copies. `channels`: one communicator per (sender,
    receiver) pair of the pipeline (None without pipeline parallelism). `created`: every group
    this rank belongs to, for `destroy`.
    """

    shape: ParallelShape
    rank: int
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    mp: dist.ProcessGroup
    single: dist.ProcessGroup
    cp: dist.ProcessGroup
    embedding: dist.ProcessGroup | None = None
    channels: ChannelGroups | None = None
    created: list = field(default_factory=list, repr=False)

    @property
    def coordinates(self) -> grid.Coordinates:
        return grid.coordinates(self.rank, self.shape)

    def collection(self) -> Any:
        """The run's `ProcessGroupCollection` (DDP and optimizer), built on first use, once."""
        return self._collection

    @functools.cached_property
    def _collection(self) -> Any:
        return run_collection(
            tp=self.tp, dp=self.dp, pp=self.pp, mp=self.mp, single=self.single, cp=self.cp
        )

    def destroy(self) -> None:
        """Destroy the groups this rank belongs to."""
        for g in self.created:
            dist.destroy_process_group(g)
        self.created.clear()


def create_run_groups(
    shape: ParallelShape, *, tied_stages: Sequence[int] = (), timeout: timedelta | None = None
) -> RunGroups:
    """Every group of a run of `shape` (call on every rank, once). `tied_stages`: the pipeline
    ranks holding copies of a tied embedding (() for none). `timeout`: every group's timeout
    (new groups do not inherit the world group's)."""
    world, me = dist.get_world_size(), dist.get_rank()
    if world != shape.world_size:
        raise RuntimeError(f"the run was validated for {shape.world_size} processes, found {world}")
    created: list = []
    single = _new_groups(grid.single_ranks(shape), me, created, timeout)
    groups = {
        name: _new_groups(grid.group_ranks(shape, dims), me, created, timeout)
        for name, dims in (("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("mp", "tp-pp"))
    }
    embedding = None
    if tied_stages:
        embedding = _new_groups(grid.stage_ranks(shape, tied_stages), me, created, timeout)
    channels = None
    if shape.pp > 1:
        pipelines = grid.group_ranks(shape, "pp")
        channels = ChannelGroups(groups["pp"], pipelines=pipelines, timeout=timeout)
    return RunGroups(
        # CP = 1 (ParallelShape refuses more): the context-parallel group is this rank alone.
        shape=shape,
        rank=me,
        single=single,
        cp=single,
        embedding=embedding,
        channels=channels,
        created=created,
        **groups,
    )


def startup_group(timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of the whole world with a timeout of its own: the start-up's object
    broadcast (rank 0's sizing, bounded by --distributed-timeout-minutes) waits on it, whatever
    the world group's timeout; destroy it once used."""
    return _new_group(range(dist.get_world_size()), timeout, backend="gloo")


def importer_groups(*, tp: int, pp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(tensor-parallel group, this rank alone) of the Hugging Face importer's world of TP x PP
    processes (every rank creates every group, as torch.distributed needs)."""
    shape = ParallelShape(tp=tp, pp=pp)
    me, created = dist.get_rank(), []
    tp_group = _new_groups(grid.group_ranks(shape, "tp"), me, created, None)
    single = _new_groups(grid.single_ranks(shape), me, created, None)
    return tp_group, single
