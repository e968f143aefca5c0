"""`RunSpec`: the resolved run, one frozen value that every rank builds identically
(`validate.resolve`) before any process group exists. Everything after resolve reads this value
and never the flags: each setting a later stage needs is resolved here once (a preset's default
filled in, a derived value derived, `--lr-decay-iters` defaulted to `--train-iters`, ...), in
one of the sections below. The flags themselves travel along only as a record (`flags`, written
into each checkpoint's header)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_dip.data.packing import PackingLimits
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.config import PlannerConfig
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import DeviceSpec
from megatron_dip.planner.service import PlannerFaults
from megatron_dip.schedule.ir import NO_RECOMPUTE, MemoryPolicy, Placement

from ..checkpoint.dirs import ResumePoint
from .data_source import DataSpec
from .presets import RunPreset


@dataclass(frozen=True)
class Training:
    """The optimisation: iterations, batch, seed, initialisation, loss and optimizer."""

    iterations: int  # --train-iters
    global_batch_size: int  # packed microbatches per iteration
    seq_length: int
    seed: int
    init_std: float  # --init-method-std
    per_token_loss: bool  # --calculate-per-token-loss
    attention: str  # --dip-attention: the chunks' attention kernel
    lr: float
    min_lr: float
    weight_decay: float
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    # The LR and weight-decay schedule as Megatron-Core's `OptimizerParamScheduler` takes it
    # (`resume_checks.schedule_of`), and whether the flags or a checkpoint's schedule win.
    schedule: Mapping[str, object]
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False


@dataclass(frozen=True)
class Checkpointing:
    """Where the run saves and what a load restores (the start point: `RunSpec.resume`)."""

    save: str | None = None
    save_interval: int | None = None
    async_save: bool = False
    load: str | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False


@dataclass(frozen=True)
class Reporting:
    """What the logging rank writes, and when."""

    log_interval: int = 1
    eval_interval: int | None = None
    eval_iters: int = 1
    tensorboard_dir: str | None = None
    trace_dir: str | None = None  # --dip-trace-dir: planned-vs-measured Chrome traces
    trace_interval: int = 1
    metrics_json: str | None = None  # --dip-metrics-json
    log_blend: bool = False  # --dip-log-blend


@dataclass(frozen=True)
class RuntimeLimits:
    """How the runtime waits, calibrates and gives up."""

    comm_timeout_s: float  # every blocking pipeline wait (--dip-comm-timeout-s)
    planner_timeout_s: float  # how long the planner process may stay silent
    lookahead: int  # batches handed to the planner process ahead of their iteration
    calibration_window: int
    calibration_frozen: bool
    max_nonfinite_iters: int  # 0: never stop


def delays_weight_gradients(schedule: str, *, split_backward: bool) -> bool:
    """`RunSpec.delays_weight_gradients` from --dip-schedule and --dip-split-backward (also
    asked before the spec exists, to price the chunks' kernels)."""
    return schedule == "dip" and split_backward


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to build its part of the run (identical on every rank)."""

    preset: RunPreset
    model: MultimodalSpec
    schedule: str  # --dip-schedule: dip, 1f1b or interleaved
    cuda: bool
    dtype: str
    # The processes' parallel shape: sizes (TP 1 and no sequence parallelism under
    # --dip-emulate-compute, whose cost model prices the real TP), virtual stages of a stock
    # interleaved run, dtype and sequence length. The planner's own (`planner.shape`) is the
    # real run's under --dip-emulate-compute.
    shape: ParallelShape
    distributed_optimizer: bool  # --use-distributed-optimizer
    overlap_grad_reduce: bool  # Megatron's stock schedules overlap the DP reduction
    # The data, the batch layout and the planner.
    data: DataSpec
    limits: PackingLimits
    sub_sizes: dict[str, int]
    device: DeviceSpec
    cost_model: CostModel
    placement: Placement
    stage_units: list | None  # a static placement's [rank][virtual stage] -> units (stock, DIP)
    planner: PlannerConfig
    memory_limit_bytes: list[float] | None
    # The settings of the later stages, resolved.
    training: Training
    checkpointing: Checkpointing
    reporting: Reporting
    runtime: RuntimeLimits
    stock_placement: str = "llava"  # --dip-stock-placement (the benchmark's static baseline)
    segments: dict[str, int] = field(default_factory=dict)
    placement_name: str = ""  # the start-up search's name of the placement (layout.Layout)
    # Tests only, set with dataclasses.replace (no flag): misbehaviour of the planner process.
    planner_faults: PlannerFaults | None = None
    # --dip-emulate-compute: the duration scale of the sleeping chunks (None: real compute).
    emulate_scale: float | None = None
    # Megatron's recompute flags as a memory policy: the stock schedules' mode of every stage.
    recompute: MemoryPolicy = NO_RECOMPUTE
    # --load: the checkpoint to resume from (None: train from scratch).
    resume: ResumePoint | None = None
    # --finetune / --pretrained-checkpoint / --dip-pretrained, when not resuming: weights to
    # start from, as (module, checkpoint) with module "" for the whole model (`finetune.py`).
    pretrained: tuple = ()
    # Every flag as resolved (preset defaults filled in): a record for checkpoint headers, read
    # back only to decide whether a resumed run may keep this run's layout (`resumed_layout`).
    flags: Mapping[str, object] = field(default_factory=dict)

    @property
    def is_stock(self) -> bool:
        return self.schedule != "dip"

    @property
    def layout_flags(self) -> dict | None:
        """The --dip-segments and --dip-sub-microbatch-size values that rebuild this DIP run's
        layout without the start-up search (`resumed_layout.recorded_layout`); None for the
        stock schedules."""
        from .layout import placement_flag
        from .resumed_layout import recorded_layout

        if self.is_stock:
            return None
        return recorded_layout(placement_flag(self.placement_name, self.segments), self.sub_sizes)

    @property
    def delays_weight_gradients(self) -> bool:
        """Whether layers that can queue their weight GEMMs for a split backward's W do
        (Transformer Engine's `delay_wgrad_compute`; the model and its DDP wrappers are built
        so): under DIP's schedule with --dip-split-backward. Megatron's stock schedules never
        call `backward_dw`."""
        return delays_weight_gradients(self.schedule, split_backward=self.planner.split_backward)
