"""A drop-in for Megatron-Core's pipeline schedule functions, and the switch that installs it.

`dip_forward_backward` takes the keyword arguments of Megatron-Core's
`forward_backward_pipelining_*` functions plus `schedule=` (a `DipSchedule`: the run's fixed
parts) and `plan=` (or the schedule's plan provider), and returns what they return: on the rank
holding the loss, one loss report per microbatch; elsewhere an empty list.

Differences from Megatron's functions, by design:

* `forward_step_func` is accepted for signature compatibility and not called: the chunks
  compute their own loss (`models.chunk` contract) and the plan says what runs when.
* `data_iterator` yields, for each microbatch of the plan in order, the list of samples of that
  microbatch (checked against the plan's sample ids); `num_microbatches` must equal the plan's.
* Gradients are finalised here (each chunk's DDP reduction started at its last Backward and
  waited for at the end; tied embeddings summed over the schedule's embedding group). A
  `config.finalize_model_grads_func` set by the training loop is NOT called: Megatron's
  `finalize_model_grads` would reduce the DDP buffers a second time and reads
  `parallel_state` / `model[0]`, `model[-1]`, which do not describe a DIP placement.

The iteration runs on the schedule's `RankRuntime` (rank.py; one per chunk list and sequence
length, built on first use): the plan verdict agreed over the pipeline group and, when the
schedule names them, the tensor-parallel and replica groups; messages on per-pair channels when
given; the schedule's timing hook per instruction. The training loop's step
(`training.iteration.step.DipStep`) is one user of this function, called exactly as Megatron-LM's
`train_step` calls `forward_backward_func`; its batch sources, message shapes, transport and
stall watch are the schedule's factories and fields, and what Megatron's signature cannot return
(timings, the channel model, the objective) is the schedule's `last_result`.

`install(schedule)` replaces `get_forward_backward_func` in `megatron.core.pipeline_parallel`,
its `schedules` module and every already imported module holding a reference to it (e.g.
`megatron.training.training`), so that the unmodified Megatron training loop runs DIP;
`uninstall()` restores every replaced reference. `installed(schedule)` is the context manager.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dip.parallel import ONE_PROCESS, ParallelShape
from megatron_dip.schedule.ir import Placement, Plan

from .checks import TensorFn
from .data import SampleBatchSource
from .executor import ExecutorConfig, IterationResult
from .p2p import ChannelGroups, PipelineP2P
from .rank import BatchSourceFactory, RankRuntime
from .stalls import NoWatch, PhaseWatch
from .timing import InstructionHook
from .transport import TransportFactory

logger = logging.getLogger(__name__)

PlanProvider = Callable[[], Plan]
TensorFnFactory = Callable[[Plan], TensorFn | None]


@dataclass
class DipSchedule:
    """The fixed parts of a DIP run on one rank (everything but the per-iteration plan).

    `model`: the `MultimodalSpec` the chunks were built from; `placement`: their placement;
    `pp_group`: the pipeline group; `plan_provider`: returns the next iteration's plan (used
    when no `plan=` is passed); `tensor_fn`: the model's message shapes for a plan (default:
    `batching.message_tensors` for the run's parallel `shape`: dtype, sequence parallelism);
    `embedding_group`: group for tied LLM embeddings (None: untied). `tp_group` /
    `replica_group`: this rank's tensor-parallel and data-parallel groups, over which the plan
    verdict is agreed too (None: the pipeline group only); `channels`: one communicator per
    (sender, receiver) pair (None: the pipeline group carries every message); `on_instruction`:
    the per-instruction timing hook (`timing.SpanRecorder`); `transport`: builds each
    iteration's transport (`transport.TransportFactory`). `batches`: builds each iteration's
    batch source (None: `SampleBatchSource` of `model`, the call's `seq_length` and `seed`);
    `watch`: the training loop's named phases (`stalls.PhaseWatch`; None outside training).
    `last_result`: the `IterationResult` of the last iteration run (module docstring).
    """

    model: Any
    placement: Placement
    pp_group: torch.distributed.ProcessGroup
    seed: int
    plan_provider: PlanProvider | None = None
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    shape: ParallelShape = ONE_PROCESS
    tensor_fn: TensorFnFactory | None = None
    embedding_group: torch.distributed.ProcessGroup | None = None
    tp_group: torch.distributed.ProcessGroup | None = None
    replica_group: torch.distributed.ProcessGroup | None = None
    channels: ChannelGroups | None = None
    on_instruction: InstructionHook | None = None
    transport: TransportFactory = PipelineP2P
    batches: BatchSourceFactory | None = None
    watch: PhaseWatch | NoWatch | None = None
    last_result: IterationResult | None = field(default=None, init=False, compare=False)
    _runtimes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def runtime(self, *, chunks: Sequence[torch.nn.Module], seq_length: int) -> RankRuntime:
        """The `RankRuntime` of `chunks` (Megatron passes the same model list every iteration)
        with samples cut to `seq_length`, built on first use from this schedule's fields."""
        key = (tuple(map(id, chunks)), seq_length)
        if key not in self._runtimes:
            self._runtimes[key] = RankRuntime(
                placement=self.placement,
                pp_group=self.pp_group,
                chunks=chunks,
                batches=self.batches
                or functools.partial(
                    SampleBatchSource, model=self.model, seq_length=seq_length, seed=self.seed
                ),
                tensor_fn_for=self.tensors_for,
                transport=self.transport,
                config=self.executor,
                channels=self.channels,
                tp_group=self.tp_group,
                replica_group=self.replica_group,
                embedding_group=self.embedding_group,
                on_instruction=self.on_instruction,
                watch=self.watch,
            )
        return self._runtimes[key]

    def tensors_for(self, plan: Plan) -> TensorFn:
        """The model's message shapes, for the sub-microbatches of `plan`."""
        if self.tensor_fn is not None:
            return self.tensor_fn(plan)
        from megatron_dip.batching import message_tensors

        return functools.partial(
            message_tensors, self.model, sub_lookup=plan.submicrobatch, shape=self.shape
        )


def _as_list(model: Any) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _pull_samples(data_iterator: Any, plan: Plan) -> dict[int, list]:
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 1:
            raise ValueError("DIP reads all microbatches from one data iterator")
        data_iterator = data_iterator[0]
    out = {}
    for info in plan.microbatches:
        try:
            out[info.index] = list(next(data_iterator))
        except StopIteration:
            raise ValueError(
                f"data iterator ran out at microbatch {info.index} of plan {plan.name!r}"
            ) from None
    return out


def dip_forward_backward(
    *,
    forward_step_func: Callable | None,
    data_iterator: Iterator | Sequence[Iterator],
    model: torch.nn.Module | Sequence[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    schedule: DipSchedule,
    plan: Plan | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run one iteration of a DIP plan with Megatron-Core's schedule signature.

    See the module docstring for how the arguments are used. `micro_batch_size` must be 1
    (samples are packed); `decoder_seq_length`, `first_val_step`, `p2p_communicator` and
    `pg_collection` are ignored (the plan and `schedule` carry that information).
    """
    del forward_step_func, decoder_seq_length, first_val_step, p2p_communicator, pg_collection
    del force_all_reduce
    if collect_non_loss_data or adjust_tensor_shapes_fn is not None:
        raise NotImplementedError("DIP plans do not support collect_non_loss_data or shape hooks")
    if micro_batch_size != 1:
        raise ValueError(f"DIP packs samples: micro_batch_size must be 1, got {micro_batch_size}")
    plan = _resolve_plan(schedule, plan, num_microbatches, forward_only)
    chunks = _as_list(model)
    return run_iteration(
        schedule=schedule,
        plan=plan,
        chunks=chunks,
        samples=_pull_samples(data_iterator, plan),
        seq_length=seq_length,
    ).reports


def _resolve_plan(
    schedule: DipSchedule, plan: Plan | None, num_microbatches: int, forward_only: bool
) -> Plan:
    if plan is None:
        if schedule.plan_provider is None:
            raise ValueError("pass plan= or give the DipSchedule a plan_provider")
        plan = schedule.plan_provider()
    if num_microbatches != len(plan.microbatches):
        raise ValueError(
            f"num_microbatches={num_microbatches}, plan {plan.name!r} (iteration "
            f"{plan.iteration}) has {len(plan.microbatches)}"
        )
    if forward_only != plan.forward_only:
        raise ValueError(f"forward_only={forward_only}, the plan says {plan.forward_only}")
    return plan


def run_iteration(
    *,
    schedule: DipSchedule,
    plan: Plan,
    chunks: Sequence[torch.nn.Module],
    samples: dict[int, list],
    seq_length: int,
) -> IterationResult:
    """Execute `plan` on this rank's `chunks` with the samples of each microbatch, then finish
    the gradients (tied embeddings summed over the schedule's embedding group), on the
    schedule's `RankRuntime` of these chunks."""
    runtime = schedule.runtime(chunks=chunks, seq_length=seq_length)
    schedule.last_result = None
    schedule.last_result = runtime.run(plan, samples)
    return schedule.last_result


# ---------------------------------------------------------------------------------------------
# Installing into Megatron-Core

_PATCHED: list[tuple[Any, str, Any]] = []


def _selector(schedule: DipSchedule) -> Callable[..., Callable]:
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable:
        """DIP's replacement: every (pp_size, vp_size, ...) selects the DIP executor."""
        del args, kwargs
        return functools.partial(dip_forward_backward, schedule=schedule)

    get_forward_backward_func.__dip__ = True  # type: ignore[attr-defined]
    return get_forward_backward_func


def install(schedule: DipSchedule) -> None:
    """Make Megatron-Core's `get_forward_backward_func` return the DIP drop-in (reversible)."""
    from megatron.core.pipeline_parallel import schedules

    if _PATCHED:
        raise RuntimeError("DIP is already installed: call uninstall() first")
    original = schedules.get_forward_backward_func
    replacement = _selector(schedule)
    for module in list(sys.modules.values()):
        if module is None or getattr(module, "__dict__", None) is None:
            continue
        if module.__dict__.get("get_forward_backward_func") is original:
            _PATCHED.append((module, "get_forward_backward_func", original))
            module.get_forward_backward_func = replacement
    logger.info("DIP schedule installed in %d module(s)", len(_PATCHED))


def uninstall() -> None:
    """Restore every reference `install` replaced."""
    while _PATCHED:
        module, name, original = _PATCHED.pop()
        setattr(module, name, original)


@contextlib.contextmanager
def installed(schedule: DipSchedule) -> Iterator[None]:
    """`install(schedule)` for the duration of a block."""
    install(schedule)
    try:
        yield
    finally:
        uninstall()
