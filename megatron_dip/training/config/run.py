"""`RunSpec`: the resolved run, one frozen value that every rank builds identically
(`validate.resolve`) before any process group exists, and everything after reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dip.data.packing import PackingLimits
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import DeviceSpec
from megatron_dip.planner.dip import PlannerConfig
from megatron_dip.planner.service import PlannerFaults
from megatron_dip.schedule.ir import NO_RECOMPUTE, Placement, RecomputeMode

from ..checkpoint.dirs import ResumePoint
from .arguments import TrainConfig
from .data_source import DataSpec
from .presets import RunPreset


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to build its part of the run (identical on every rank)."""

    config: TrainConfig
    preset: RunPreset
    model: MultimodalSpec
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    cuda: bool
    dtype: str
    data: DataSpec
    limits: PackingLimits
    sub_sizes: dict[str, int]
    device: DeviceSpec
    cost_model: CostModel
    placement: Placement
    stage_units: list | None  # a static placement's [rank][virtual stage] -> units (stock, DIP)
    planner: PlannerConfig
    memory_limit_bytes: list[float] | None
    segments: dict[str, int] = field(default_factory=dict)
    placement_name: str = ""  # the start-up search's name of the placement (layout.Layout)
    # Tests only, set with dataclasses.replace (no flag): misbehaviour of the planner process.
    planner_faults: PlannerFaults | None = None
    # --dip-emulate-compute: the duration scale of the sleeping chunks (None: real compute).
    emulate_scale: float | None = None
    # Megatron's recompute flags as (method, N): the stock schedules' mode of every stage.
    recompute: RecomputeMode = NO_RECOMPUTE
    # --load: the checkpoint to resume from (None: train from scratch).
    resume: ResumePoint | None = None
    # --finetune / --pretrained-checkpoint / --dip-pretrained, when not resuming: weights to
    # start from, as (module, checkpoint) with module "" for the whole model (`finetune.py`).
    pretrained: tuple = ()

    @property
    def schedule(self) -> str:
        return self.config.dip.dip_schedule

    @property
    def is_stock(self) -> bool:
        return self.schedule != "dip"

    @property
    def sequence_parallel(self) -> bool:
        """Activations sharded along the sequence over TP (--sequence-parallel, TP > 1)."""
        return self.config.parallel.sequence_parallel and self.tensor_parallel > 1
