"""The simulator: a plan's iteration time, bubbles and activation memory under a cost model.

Timing is `schedule.engine.execute_programs`, the same machine that defines the plan semantics;
this module only supplies durations and reads the result:

* a `Forward` lasts `stage_cost(chunk, sub, recompute).forward`, a `Backward` `.backward` with the
  recompute strategy of its stage's forward; a split backward's `BackwardInput` lasts
  `.backward_input`, its `BackwardWeight` `.weight`; a `ReduceGrads` runs beside the compute for
  the cost model's `grad_reduce_time` over the plan's data-parallel size (0 without one);
* a message lasts `transfer_time(bytes of its tensors) + message_latency`. The extra per-message
  latency models the per-operation hand-over overhead of emulated clusters (docs/design.md, "Emulated clusters") (it grows with
  the number of messages, so schedules that send more messages must pay for it);
* activation offload: a forward's copy out and a backward's first reload run on the rank's
  copy channels (`execute_programs`' `host_copy`, `StageCost.copy_out` / `reload`); the copy
  out delays nothing, the backward waits for its reload (instead of `StageCost.reload_stall`,
  the cost model's chunk-local estimate);
* host overheads (`overheads.HostOverheads` of the cost model, zero for stand-ins): every compute
  instruction also takes `instruction` seconds, every posted batch of sends/receives `batch`
  seconds of its rank, and `message_latency` / `post_overhead` default to the cost model's
  `message` / `batch` terms, so a plan of many tiny instructions pays for them.

Activation memory per rank is a step function over time: a stage adds its `activation_bytes` at
the end of its forward and releases them at the end of its backward (of a split backward: its
`BackwardInput` trades them for what the pending W holds, `StageCost.pending_weight_bytes`, which
its `BackwardWeight` releases). A forward-only stage (frozen
module with nothing trainable upstream) runs without autograd and holds nothing afterwards; what
its consumers keep of its output is part of their own activation bytes. An offloading stage's
`activation_bytes` hold what the cost model expects its copy out not to have moved when the
forward ends; where the copy channel queued it so that more is left, the rest is held too until
the copy ends. The pipeline's message buffers are part of it too: a received tensor from its
receive's post to the end of the compute consuming it, a sent one until the wait that releases
it (`_message_changes`; with receives posted ahead they exist one compute earlier). Transient
working memory inside an operator, parameters, gradients and optimizer state are not part of
this timeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..schedule.engine import (
    ChannelFn,
    ExecutionResult,
    channel_of,
    execute_programs,
)
from ..schedule.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    ChunkSpec,
    Forward,
    Instruction,
    MemoryPolicy,
    Plan,
    Program,
    Recompute,
    Recv,
    ReduceGrads,
    Send,
    StageId,
    SubMicrobatch,
    Wait,
)
from ..schedule.passes import consumer_of
from .cost_model import StageCost
from .overheads import host_overheads
from .trace import Span, chrome_trace_events, plan_timeline

__all__ = [
    "PlanTiming",
    "activation_peaks",
    "message_peaks",
    "SimResult",
    "StageCostModel",
    "UniformCost",
    "simulate",
    "stage_costs",
]


class StageCostModel(Protocol):
    """What the simulator needs of a cost model (`CostModel` or any stand-in)."""

    def stage_cost(
        self,
        chunk: ChunkSpec,
        sub: SubMicrobatch,
        recompute: Recompute = Recompute.NONE,
        layers: int = 0,
        offload: int = 0,
    ) -> StageCost:
        """Seconds of forward and backward and activation bytes of `chunk` on `sub` under
        the memory policy (`layers`: N of Megatron's block / uniform methods; `offload`: K layers
        offloaded, see `MemoryPolicy`)."""
        ...

    def transfer_time(self, nbytes: int) -> float:
        """Seconds of one message of `nbytes` between pipeline ranks."""
        ...


@dataclass(frozen=True)
class UniformCost:
    """Every stage costs the same: the cost model of the textbook bubble formulas and of timeline
    drawings. `per_layer` multiplies the times and bytes by the chunk's layer count."""

    forward: float = 1.0
    backward: float = 2.0
    activation_bytes: int = 1
    transfer: float = 0.0
    per_layer: bool = False

    def stage_cost(
        self,
        chunk: ChunkSpec,
        sub: SubMicrobatch,
        recompute: Recompute = Recompute.NONE,
        layers: int = 0,
        offload: int = 0,
    ) -> StageCost:
        """The same forward/backward/bytes for every stage (times the layers if `per_layer`)."""
        n = chunk.num_layers if self.per_layer else 1
        return StageCost(n * self.forward, n * self.backward, n * self.activation_bytes)

    def transfer_time(self, nbytes: int) -> float:
        """`transfer` seconds for any message."""
        return self.transfer

    def needs_backward(self, module: str) -> bool:
        """Every module trains (as `CostModel.needs_backward` of an unfrozen one)."""
        return True


@dataclass(frozen=True)
class SimResult:
    """Simulated timing and memory of one plan.

    `busy[r]`: compute seconds of rank r; `idle[r]` = iteration_time - busy[r].
    `bubble_fraction` = 1 - sum(busy) / (ranks * iteration_time).
    `lower_bound`: the busiest rank's compute, what no schedule of these stages can beat;
    `bound_efficiency` = lower_bound / iteration_time.
    `peak_activation_bytes[r]` and `memory_timeline[r]` (time, bytes held after it) per rank.
    """

    iteration_time: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float
    lower_bound: float
    bound_efficiency: float
    peak_activation_bytes: tuple[int, ...]
    memory_timeline: tuple[tuple[tuple[float, int], ...], ...]
    num_messages: int
    timeline: tuple[tuple[Span, ...], ...]
    execution: ExecutionResult = field(compare=False, repr=False)
    memory_limit_bytes: int | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.busy)

    @property
    def ranks_over_memory(self) -> tuple[int, ...]:
        """Ranks whose activation peak exceeds `memory_limit_bytes` (none without a limit)."""
        if self.memory_limit_bytes is None:
            return ()
        return tuple(
            r for r, p in enumerate(self.peak_activation_bytes) if p > self.memory_limit_bytes
        )

    def trace_events(self) -> list[dict]:
        """Chrome/Perfetto trace events of the simulated timeline (see `planner.trace`)."""
        return chrome_trace_events(self.timeline)

    def summary(self) -> str:
        """One line: iteration time, bubble fraction, bound efficiency, largest memory peak."""
        peak = max(self.peak_activation_bytes, default=0)
        return (
            f"iteration {self.iteration_time * 1e3:.3f} ms, bubbles {self.bubble_fraction:.1%}, "
            f"bound efficiency {self.bound_efficiency:.1%}, peak activations {peak / 2**30:.2f} GiB"
        )


def stage_costs(plan: Plan, cost_model: StageCostModel) -> tuple[dict, set[StageId]]:
    """(stage -> StageCost with its forward's recompute, stages that run a backward)."""
    recompute: dict[StageId, MemoryPolicy] = {}
    has_backward: set[StageId] = set()
    for program in plan.programs:
        for ins in program.instructions:
            if isinstance(ins, Forward):
                recompute[ins.stage] = ins.memory
            elif isinstance(ins, Backward):
                has_backward.add(ins.stage)
    costs = {}
    for stage, mode in recompute.items():
        chunk = plan.placement.module(stage.module).chunks[stage.chunk]
        costs[stage] = cost_model.stage_cost(chunk, plan.submicrobatch(stage.work), mode)
    missing = has_backward - recompute.keys()
    if missing:
        raise ValueError(f"plan has backwards without a forward: {sorted(map(str, missing))[:5]}")
    return costs, has_backward


def _stage_changes(
    program: Program, costs: dict, has_backward: set[StageId]
) -> Iterator[tuple[int, int]]:
    """`(index, bytes added)` at each compute instruction of `program` that changes the
    activations the rank stores (the module docstring)."""
    weighted = {i.stage for i in program.instructions if isinstance(i, BackwardWeight)}
    for index, ins in enumerate(program.instructions):
        if isinstance(ins, Forward) and ins.stage in has_backward:
            yield index, int(costs[ins.stage].activation_bytes)
        elif isinstance(ins, BackwardInput) and ins.stage in weighted:  # now what W needs
            cost = costs[ins.stage]
            yield index, int(cost.pending_weight_bytes) - int(cost.activation_bytes)
        elif isinstance(ins, BackwardWeight):
            yield index, -int(costs[ins.stage].pending_weight_bytes)
        elif isinstance(ins, Backward) and ins.stage not in weighted:
            yield index, -int(costs[ins.stage].activation_bytes)


def _message_changes(program: Program) -> Iterator[tuple[int, int]]:
    """`(index, bytes added)` at each instruction of `program` that changes the pipeline message
    buffers the rank holds: a received tensor from its post (the runtime allocates it then) to
    the end of the compute that consumes it (then it is part of that compute's stored
    activations, or gone); a sent one from its post, right after the compute that made it, to
    the wait that releases it (the runtime frees a sent output then, as Megatron's
    `deallocate_output_tensor`) or the program's end."""
    received: dict[tuple[bool, StageId], int] = {}
    sent: dict = {}
    for index, ins in enumerate(program.instructions):
        if isinstance(ins, Send | Recv):
            nbytes = sum(t.nbytes for t in ins.tensors)
            if not nbytes:
                continue
            if isinstance(ins, Send):
                sent[ins.key] = nbytes
            else:
                consumer = consumer_of(ins.key)
                received[consumer] = received.get(consumer, 0) + nbytes
            yield index, nbytes
        elif isinstance(ins, Wait):
            freed = sum(sent.pop(key, 0) for key in ins.keys)
            if freed:
                yield index, -freed
        elif isinstance(ins, Forward | Backward):
            freed = received.pop((isinstance(ins, Forward), ins.stage), 0)
            if freed:
                yield index, -freed


def _changes(program: Program, costs: dict, has_backward: set[StageId]) -> list[tuple[int, int]]:
    """`(index, bytes added)` per instruction of `program` that changes what the rank holds,
    stored activations and message buffers together, in program order."""
    added: dict[int, int] = {}
    for index, delta in (
        *_stage_changes(program, costs, has_backward),
        *_message_changes(program),
    ):
        added[index] = added.get(index, 0) + delta
    return sorted(added.items())


def _times(program: Program, end_of: dict[int, float]) -> list[float]:
    """When each instruction of `program` takes effect, from `end_of` (index: end) of its
    computes and waits: a compute at its end, a wait when it returns, a post when the rank gets
    to it (program order is time order)."""
    times, now = [], 0.0
    for index in range(len(program.instructions)):
        now = end_of.get(index, now)
        times.append(now)
    return times


def _memory(
    plan: Plan, execution: ExecutionResult, costs: dict, has_backward: set[StageId]
) -> tuple[tuple[int, ...], tuple[tuple[tuple[float, int], ...], ...]]:
    peaks, timelines = [], []
    for program, spans, waits, copies in zip(
        plan.programs,
        execution.spans,
        execution.waits,
        execution.copies or [()] * len(plan.programs),
    ):
        end_of = {index: end for index, _, end in spans}
        times = _times(program, {**end_of, **{index: end for index, _, end in waits}})
        deltas = [(times[i], delta) for i, delta in _changes(program, costs, has_backward)]
        deltas += _copying(program, end_of, copies, costs)
        deltas.sort(key=lambda d: d[0])  # stable: program order at equal times
        steps, held = [], 0
        for at, delta in deltas:
            held += delta
            steps.append((at, held))
        peaks.append(max([0, *(h for _, h in steps)]))
        timelines.append(tuple(steps))
    return tuple(peaks), tuple(timelines)


def _copying(
    program: Program, end_of: dict, copies: Iterable[tuple[int, float, float]], costs: dict
) -> list[tuple[float, int]]:
    """(time, bytes) steps of the offloaded bytes the engine's copy channel has not copied out
    yet when their forward ends, beyond what the cost model keeps for that (`activation_bytes`
    holds its chunk-local estimate): held from the forward's end to the copy's (a copy queued
    behind others leaves more)."""
    out = []
    for pc, begin, end in copies:
        ins = program.instructions[pc]
        if not isinstance(ins, Forward) or end <= end_of[pc]:
            continue
        cost = costs[ins.stage]
        left = cost.copy_bytes * min(1.0, (end - end_of[pc]) / max(end - begin, 1e-30))
        extra = int(left - cost.copy_residual)
        if extra > 0:
            out += [(end_of[pc], extra), (end, -extra)]
    return out


def activation_peaks(plan: Plan, cost_model: StageCostModel) -> tuple[int, ...]:
    """Each rank's activation peak, as `simulate` reports it, without timing the plan: what a
    rank holds changes only at its instructions, in program order."""
    costs, has_backward = stage_costs(plan, cost_model)
    return tuple(_peak(_changes(program, costs, has_backward)) for program in plan.programs)


def _peak(changes: Iterable[tuple[int, int]]) -> int:
    """The most bytes held at once under `(index, bytes added)` changes from nothing."""
    held, peak = 0, 0
    for _, delta in changes:
        held += delta
        peak = max(peak, held)
    return peak


def message_peaks(plan: Plan) -> tuple[int, ...]:
    """Each rank's most bytes of pipeline message buffers at once (`_message_changes`), in
    program order."""
    return tuple(_peak(_message_changes(program)) for program in plan.programs)


# Instruction type -> index into `_durations`' tuple.
_SLOTS: dict[type, int] = {BackwardInput: 2, BackwardWeight: 3, Forward: 0, Backward: 1}


def _durations(c: StageCost, host: float) -> tuple[float, float, float, float]:
    """(forward, fused backward, input-gradient half, weight-gradient half) of a stage, each
    with the host time of its instruction; the backward without the cost model's estimate of
    its wait for the first reload, which the engine's copy channel times (`_host_copy`)."""
    stall = c.reload_stall
    return (
        c.forward + host,
        c.backward - stall + host,
        c.backward_input - stall + host,
        c.weight + host,
    )


def _host_copy(c: StageCost, ins: Instruction) -> tuple[float, float]:
    """The engine's `host_copy` of a stage's instruction: a forward's copy out, a backward's
    (or input half's) first reload."""
    if isinstance(ins, Forward):
        return c.copy_lead, c.copy_out
    return c.reload_window, c.reload


def reduction_time(cost_model: StageCostModel, chunk: ChunkSpec, data_parallel: int) -> float:
    """Seconds of `chunk`'s data-parallel gradient reduction: the cost model's
    `grad_reduce_time`; 0 without data parallelism or for cost models that price none
    (stand-ins)."""
    price = getattr(cost_model, "grad_reduce_time", None)
    return 0.0 if price is None or data_parallel <= 1 else price(chunk, data_parallel)


def _reduction_times(plan: Plan, cost_model: StageCostModel) -> dict[tuple[str, int], float]:
    """Seconds of each chunk's data-parallel gradient reduction (`reduction_time`)."""
    dp = plan.totals.data_parallel_size
    if dp <= 1:
        return {}
    return {
        (m.name, c.index): reduction_time(cost_model, c, dp)
        for m in plan.placement.modules
        for c in m.chunks
    }


class PlanTiming:
    """The durations `simulate` gives the engine for `plan`'s stages, reusable for programs
    that reorder the same instructions (`weight_fill` times many orders of one plan)."""

    def __init__(
        self,
        plan: Plan,
        cost_model: StageCostModel,
        costs: dict | None = None,
        message_latency: float | None = None,
        post_overhead: float | None = None,
    ) -> None:
        costs = costs if costs is not None else stage_costs(plan, cost_model)[0]
        host = host_overheads(cost_model)
        self.cost_model = cost_model
        self.message_latency = host.message if message_latency is None else message_latency
        self.post_overhead = host.batch if post_overhead is None else post_overhead
        self.durations = {s: _durations(c, host.instruction) for s, c in costs.items()}
        self.costs = costs
        self.copies = any(c.copy_out or c.reload for c in costs.values())
        self.reductions = _reduction_times(plan, cost_model)

    def compute_time(self, rank: int, ins: Instruction) -> float:
        """Seconds of a compute instruction or of a reduction (beside the compute)."""
        slot = _SLOTS.get(type(ins))
        if slot is None:
            if isinstance(ins, ReduceGrads):
                return self.reductions.get((ins.module, ins.chunk), 0.0)
            slot = next(v for t, v in _SLOTS.items() if isinstance(ins, t))
        return self.durations[ins.stage][slot]

    def host_copy(self, rank: int, ins: Instruction) -> tuple[float, float]:
        """(lead or window, seconds) of a compute instruction's host copy (offload)."""
        return _host_copy(self.costs[ins.stage], ins)

    def transfer_time(self, send: Send) -> float:
        """Seconds of a message, its per-message latency included."""
        nbytes = sum(t.nbytes for t in send.tensors)
        return self.cost_model.transfer_time(nbytes) + self.message_latency

    def run(self, programs: Sequence[Program], channel: ChannelFn) -> ExecutionResult:
        """`execute_programs` of `programs` with these durations."""
        return execute_programs(
            programs,
            compute_time=self.compute_time,
            transfer_time=self.transfer_time,
            post_overhead=self.post_overhead,
            channel=channel,
            host_copy=self.host_copy if self.copies else None,
        )


def simulate(
    plan: Plan,
    cost_model: StageCostModel,
    *,
    message_latency: float | None = None,
    post_overhead: float | None = None,
    memory_limit_bytes: int | None = None,
    channel: ChannelFn | None = None,
) -> SimResult:
    """Simulate one iteration of `plan` with durations from `cost_model`.

    `message_latency` is added to every message's transfer time, `post_overhead` to every posted
    batch of sends/receives (both seconds; None: the cost model's host overheads, see the module
    docstring); `channel`: the streams the messages travel on (None: those the plan declares,
    `Plan.channels`). Raises `schedule.DeadlockError` / `PlanError` for a plan that cannot run.
    """
    costs, has_backward = stage_costs(plan, cost_model)
    execution = PlanTiming(plan, cost_model, costs, message_latency, post_overhead).run(
        plan.programs, channel_of(plan.channels) if channel is None else channel
    )
    iteration = execution.makespan
    busy = tuple(sum(end - start for _, start, end in spans) for spans in execution.spans)
    bound = max(busy, default=0.0)
    ranks = len(busy)
    peaks, mem_timeline = _memory(plan, execution, costs, has_backward)
    sends = sum(isinstance(i, Send) for p in plan.programs for i in p.instructions)
    return SimResult(
        iteration_time=iteration,
        busy=busy,
        idle=tuple(iteration - b for b in busy),
        bubble_fraction=1.0 - sum(busy) / (ranks * iteration) if iteration > 0 else 0.0,
        lower_bound=bound,
        bound_efficiency=bound / iteration if iteration > 0 else 1.0,
        peak_activation_bytes=peaks,
        memory_timeline=mem_timeline,
        num_messages=sends,
        timeline=plan_timeline(plan, execution),
        execution=execution,
        memory_limit_bytes=memory_limit_bytes,
    )
