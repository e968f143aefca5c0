"""The one place a run's `PlannerConfig` is derived from its flags.

Training (`validate.resolve`), the start-up placement search's scoring planners
(`layout._Sizing.score`), the benchmark and `tools/planner_speed.py` (both through `resolve`)
build their planners from this, so a speed measurement plans what training asks for: the
sub-microbatch sizes and memory limit the sizing step chose, the host overheads priced into the
cost model, Megatron's recompute flags as the starting mode and the search budget of the flags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_dip.data.packing import PackingLimits
from megatron_dip.planner.dip import PlannerConfig
from megatron_dip.planner.search import SearchConfig
from megatron_dip.schedule.ir import RecomputeMode

from .arguments import TrainConfig


def planner_config(
    config: TrainConfig,
    *,
    data_parallel: int,
    tensor_parallel: int,
    sub_sizes: Mapping[str, int],
    memory_limit: Sequence[float] | None,
    dtype: str,
    packing: PackingLimits,
    uniform_recompute: RecomputeMode | None,
) -> PlannerConfig:
    """The planner configuration of a run with `config` on the sizes given (the sizing step's
    choices). The search stops after its rollout budget or --dip-search-time-ms, whichever
    comes first: only the planner process searches, and its plan is the one every rank runs."""
    d = config.dip
    search = SearchConfig(
        time_budget_s=d.dip_search_time_ms / 1e3,
        workers=d.dip_planner_workers,
        seed=config.train.seed,
    )
    return PlannerConfig(
        seq_length=config.train.seq_length,
        data_parallel=data_parallel,
        sub_sizes=dict(sub_sizes),
        search=search,
        memory_limit_bytes=memory_limit,
        tensor_parallel=tensor_parallel,
        sequence_parallel=config.parallel.sequence_parallel and tensor_parallel > 1,
        dtype=dtype,
        use_search=d.dip_search_time_ms > 0,
        uniform_recompute=uniform_recompute,
        packing=packing,
        split_backward=d.dip_split_backward,
    )


def scoring_config(base: PlannerConfig) -> PlannerConfig:
    """The run's configuration as the start-up placement search plans with it: greedy (no
    search, so the score depends on the data alone) and scoring plans over the limit rather
    than raising."""
    from dataclasses import replace

    return replace(base, use_search=False, strict_memory=False)
