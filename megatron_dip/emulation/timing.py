"""What an emulated chunk sleeps: compute and transfer times of the cost model, per stage.

An emulated iteration runs the real plan (real program order, real point-to-point messages of the
true dependency structure, real autograd) with chunks that *sleep* instead of computing
(`chunk.EmulatedChunk`). Every duration comes from the cost model for the stage's actual
sub-microbatch at the preset's scale, times `EmulationConfig.scale`:

* compute: `cost_model.stage_cost(chunk, sub, recompute)` forward / backward. Full recompute is
  not added to the backward here: the runtime really re-runs the forward (which sleeps again).
* transfers: a message between two pipeline ranks is a tiny tensor, but its consumer may not use
  it before `produced + cost_model.transfer_time(bytes)`, with `bytes` those of the message in the
  plan as planned (the real model's shapes), so DIP's extra hops cost what the simulator says.
  The producing side writes a time stamp into the message (`encode_stamp`); gradients carry one
  stamp slot per consumer, because the executor sums the gradient messages of a producer's
  consumers before its backward and a sum of stamps would mean nothing.

`EmulatedBatchSource` is the runtime's `BatchSource` for emulated chunks: for each sub-microbatch
it hands the chunks a `SubWork` that answers `timing(module, chunk)`. `stand_in` gives a Send or
Recv the tiny emulated tensor (`message_spec`) instead of the plan's: the emulated transport
(`transport.py`) posts every message so, while the executor runs the plan as planned (whose
bytes the transfers take the time of); `emulated_plan` rewrites a whole plan that way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_dip.modalities import modality_of
from megatron_dip.planner.overheads import host_overheads
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import (
    NO_RECOMPUTE,
    MemoryPolicy,
    MessageKey,
    MessageKind,
    Plan,
    Program,
    Recompute,
    Recv,
    Send,
    StageId,
    TensorSpec,
    WorkId,
)

MESSAGE_NAME = "emulated"
STAMP_SLOTS = 16  # slot 0: the forward stamp; slots 1..15: one per consumer in gradients
STAMP_WIDTH = 3  # a wall-clock time as three float32-exact parts (`encode_stamp`)


def message_spec() -> TensorSpec:
    """The one tensor of every emulated message: [payload, a 3-float stamp per slot]."""
    return TensorSpec(MESSAGE_NAME, (1 + STAMP_WIDTH * STAMP_SLOTS,), "float32")


def emulated_tensor_fn(key: MessageKey) -> tuple[TensorSpec, ...]:
    """`tensor_fn` of emulated chunks: every message is `message_spec()`."""
    del key
    return (message_spec(),)


@dataclass(frozen=True)
class EmulationConfig:
    """`scale` multiplies every emulated duration."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.scale >= 0 and math.isfinite(self.scale)):
            raise ValueError(f"emulation scale must be a finite number >= 0, got {self.scale}")

    @staticmethod
    def now() -> float:
        """Wall-clock seconds (comparable across the processes of one machine)."""
        return time.time()


def encode_stamp(seconds: float) -> tuple[float, float, float]:
    """`seconds` (a Unix time) as three parts that float32 holds exactly enough: a multiple of
    4096 s (< 2**24 * 4096), a multiple of 1/64 s below 4096 and the remainder (< 1/64 s, kept
    to ~1e-9 s), so that stamps survive float32 messages without a shared epoch."""
    high = math.floor(seconds / 4096.0) * 4096.0
    middle = math.floor((seconds - high) * 64.0) / 64.0
    return high, middle, seconds - high - middle


def decode_stamp(parts: Sequence[float]) -> float:
    return float(parts[0]) + float(parts[1]) + float(parts[2])


def sleep_until(deadline: float, config: EmulationConfig) -> None:
    """Sleep until `config.now()` reaches `deadline` (no-op when it already has)."""
    remaining = deadline - config.now()
    if remaining > 0:
        time.sleep(remaining)


@dataclass(frozen=True)
class Link:
    """A message between this stage and another: whether it crosses pipeline ranks, the
    emulated transfer time if so, and the stamp slot this stage's gradient uses."""

    remote: bool
    transfer_s: float
    slot: int = 0


@dataclass(frozen=True)
class StageTiming:
    """Emulated durations of one stage (seconds, already scaled) and its messages."""

    forward_s: float
    backward_s: Callable[[MemoryPolicy], float]  # the backward's seconds under a memory policy
    weight_s: float = 0.0  # of the backward: the weight gradients (a split backward's W)
    inputs: tuple[Link, ...] = ()  # in the order of the chunk's `inputs=` (producer order)
    outputs: tuple[Link, ...] = ()  # one per consumer, in `Dataflow.consumers` order

    def backward_for(self, memory: MemoryPolicy) -> float:
        """Seconds of the backward of a forward that ran under `memory`."""
        return self.backward_s(memory)


def message_bytes(plan: Plan) -> dict[MessageKey, int]:
    """Bytes of every message of `plan` as planned (its Send instructions' tensors)."""
    out: dict[MessageKey, int] = {}
    for program in plan.programs:
        for ins in program.instructions:
            if isinstance(ins, Send):
                out[ins.key] = sum(t.nbytes for t in ins.tensors)
    return out


class EmulatedBatchSource:
    """The `BatchSource` of emulated chunks for one plan on one pipeline rank.

    `plan`: the plan as planned (real message shapes: they give the transfer bytes). `loss_tokens`:
    loss tokens of each microbatch's instances, in instance order (from the samples' metadata).
    """

    def __init__(
        self,
        *,
        plan: Plan,
        cost_model: Any,
        config: EmulationConfig,
        loss_tokens: Mapping[int, Sequence[int]],
    ) -> None:
        self.plan, self.cost_model, self.config = plan, cost_model, config
        self.df = Dataflow(plan.placement, plan.submicrobatches, plan.dependencies)
        self._bytes = message_bytes(plan)
        self._loss_tokens = loss_tokens
        self._timings: dict[StageId, StageTiming] = {}

    def sub_batch(self, work: WorkId) -> SubWork:
        return SubWork(work=work, source=self)

    def loss_tokens(self, work: WorkId) -> int:
        sub = self.plan.submicrobatch(work)
        per_sample = self._loss_tokens[work.microbatch]
        if modality_of(self.cost_model.model.loss_module).whole_microbatch:
            return int(sum(per_sample))  # e.g. an LLM sub-microbatch is the whole microbatch
        return int(sum(per_sample[sub.instance_start : sub.instance_end]))  # one per sample

    def release(self, work: WorkId) -> None:
        del work

    def timing(self, stage: StageId) -> StageTiming:
        """Durations and links of `stage` (cached)."""
        found = self._timings.get(stage)
        if found is None:
            found = self._timing(stage)
            self._timings[stage] = found
        return found

    def _timing(self, stage: StageId) -> StageTiming:
        chunk = self.plan.placement.module(stage.module).chunks[stage.chunk]
        sub = self.plan.submicrobatch(stage.work)
        scale = self.config.scale
        backward = functools.partial(self._backward_s, chunk, sub)

        inputs = tuple(self._link(key) for key in self.df.forward_inputs(stage))
        outputs = tuple(
            self._link(MessageKey(MessageKind.GRADIENT, stage, consumer))
            for consumer in self.df.consumers(stage)
        )
        base = self.cost_model.stage_cost(chunk, sub)
        return StageTiming(base.forward * scale, backward, base.weight * scale, inputs, outputs)

    def _backward_s(self, chunk, sub, memory: MemoryPolicy) -> float:
        # FULL: the runtime re-runs the (sleeping) forward itself before this backward.
        if memory.method is Recompute.FULL:
            memory = NO_RECOMPUTE
        cost = self.cost_model.stage_cost(chunk, sub, memory)
        # Offload's transfers run on their own channels and the copy out delays nothing; the
        # backward sleeps the cost model's estimate of its wait for the reload.
        return cost.backward * self.config.scale

    def _link(self, key: MessageKey) -> Link:
        remote = self.df.sender_of(key) != self.df.receiver_of(key)
        nbytes = self._bytes.get(key, 0)
        transfer = self.cost_model.transfer_time(nbytes) * self.config.scale if remote else 0.0
        # A gradient from consumer `c` to producer `p` is stamped in slot 1 + (c's position
        # among p's consumers); a forward message in slot 0.
        if key.kind is MessageKind.ACTIVATION:
            consumers = self.df.consumers(key.producer)
            slot = 1 + consumers.index(key.consumer)
            if slot >= STAMP_SLOTS:
                raise ValueError(
                    f"{key.producer} feeds {len(consumers)} stages; emulation stamps at most "
                    f"{STAMP_SLOTS - 1}"
                )
        else:
            slot = 0
        return Link(remote=remote, transfer_s=transfer, slot=slot)


@dataclass(frozen=True)
class SubWork:
    """The `batch=` of an emulated chunk: which sub-microbatch, and where to look up timings."""

    work: WorkId
    source: EmulatedBatchSource

    def timing(self, module: str, chunk: int) -> StageTiming:
        return self.source.timing(StageId(module, chunk, self.work.microbatch, self.work.sub))

    @property
    def loss_tokens(self) -> int:
        return self.source.loss_tokens(self.work)

    @property
    def config(self) -> EmulationConfig:
        return self.source.config


def stand_in(op: Send | Recv) -> Send | Recv:
    """`op` carrying the emulated `message_spec()` instead of the plan's tensors."""
    return dataclasses.replace(op, tensors=(message_spec(),))


def emulated_plan(plan: Plan) -> Plan:
    """`plan` with every message's tensors replaced by the emulated `message_spec()`."""
    programs = []
    for program in plan.programs:
        instructions = tuple(
            stand_in(ins) if isinstance(ins, (Send, Recv)) else ins for ins in program.instructions
        )
        programs.append(Program(program.rank, instructions))
    return dataclasses.replace(plan, programs=tuple(programs))


class ScaledCostModel:
    """`cost_model` with every stage and transfer time multiplied by `scale`: what an emulated
    run with that `EmulationConfig.scale` should take (the simulator's prediction of it).

    Its host overheads are the base's times `scale` too: an emulated run's cost model holds the
    measured host seconds divided by the scale (planning is in the preset's time units), while
    the emulated run pays the host seconds themselves. The chunks sleep `stage_cost` only
    (`EmulatedBatchSource`), never the overheads: those are the real host time of the run."""

    def __init__(self, cost_model: Any, scale: float) -> None:
        self.base, self.scale = cost_model, scale
        self.overheads = host_overheads(cost_model).scaled(scale)

    def stage_cost(
        self,
        chunk: Any,
        sub: Any,
        memory: MemoryPolicy = NO_RECOMPUTE,
    ) -> Any:
        return self.base.stage_cost(chunk, sub, memory).scaled(self.scale, self.scale)

    def transfer_time(self, nbytes: int) -> float:
        return self.base.transfer_time(nbytes) * self.scale

    def __getattr__(self, name: str) -> Any:  # memory, parameters, ...: unscaled
        return getattr(self.base, name)
