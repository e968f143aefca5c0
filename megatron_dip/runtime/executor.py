"""The executor: runs one pipeline rank's `Program` of a `Plan` on the model chunks it holds.

Semantics are those of `schedule/ir.py`. One handler per instruction type, registered in
`_HANDLERS` (checked against `schedule.ir.INSTRUCTION_TYPES` at import and at construction).

Buffers. An activation or gradient *message* (`MessageKey`) is held from the compute producing it
until the compute consuming it (a local hand-over when both chunks are on this rank) or until its
Send completed. A Forward that will be differentiated keeps its inputs (as fresh autograd leaves)
and outputs by `StageId` until its Backward, which frees them; an output sent to another rank
keeps only its autograd node once its sends completed (its data is freed, as Megatron's
`deallocate_output_tensor` does: `sent_outputs.py`). `leftovers()` lists whatever is still held;
after a complete iteration it is empty (tested).

Forward calls the chunk with `inputs=` (one dict per producer message, in producer order) and
`batch=` (the sub-microbatch's inputs from the `BatchSource`). Backward runs
`torch.autograd.backward` on the chunk's outputs with the received output gradients (summed over
consumers), or on the weighted loss for the loss module's last chunk, and turns the inputs'
`.grad` into the gradient messages for the producers. A split backward (`BackwardInput`, then
`BackwardWeight`) does the same in two halves (`backward_split.py`): B the input gradients and
the gradients of the weight nodes, W the weight gradients from those, holding in between only
what W needs (the stage's forward boxes its saved tensors for that); `ReduceGrads` starts a
chunk's data-parallel reduction where the plan says (without them `gradsync.py` infers the
points). Loss weights: `loss.py`. Recompute:
`recompute.py`. Data-parallel reduction points: `gradsync.py`. After the program (and the
data-parallel reductions) the gradients of `sequence_parallel` parameters are summed over each
chunk's tensor-parallel group (`ddp.reduce_sequence_parallel_grads`; no-op without sequence
parallelism).

Reliability. Before any message, this rank's checks (`checks.check_before_run`) are *agreed* with
the pipeline group (and the tensor-parallel and replica groups when given): if any rank rejected
its plan, or the ranks hold different plans, every rank raises and none communicates
(`checks.agree_on_plan`). Every blocking wait has a timeout (`P2PConfig.timeout_s`; see p2p.py for
NCCL) and fails with an error naming the rank, the instruction, the peer, the message and the
tensor. `on_instruction` is the public per-instruction timing hook (`timing.py`).

Messages travel over the injected `transport` (transport.py), one per iteration; `RankRuntime`
(rank.py) assembles executor, transport and batch source for each iteration of a run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dip.cpu_support import cuda_to_cpu_suspended
from megatron_dip.schedule.engine import ChannelFn, PlanError
from megatron_dip.schedule.ir import (
    INSTRUCTION_TYPES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    MessageKey,
    MessageKind,
    Placement,
    Plan,
    Recv,
    ReduceGrads,
    Send,
    StageId,
    Wait,
    WorkId,
)

from .backward_split import (
    PendingWeight,
    SavedStore,
    backward_input,
    backward_weight,
    input_leaves,
    trainable_parameters,
)
from .checks import (
    TensorFn,
    VerdictGroup,
    agree_on_plan,
    check_before_run,
    chunks_device,
    index_chunks,
    plan_identity,
    unwrap_chunk,
)
from .data import BatchSource
from .ddp import reduce_sequence_parallel_grads
from .delayed_wgrad import check_accumulated, compute_delayed, delayed_modules
from .errors import MessageError
from .gradsync import grad_sync_points
from .iteration import IterationResult
from .loss import LossConfig, LossTracker, reduction_averages
from .offload import ActivationOffload
from .p2p import P2PConfig, check_message
from .recompute import run_policy
from .sent_outputs import SentOutputs, handover, release
from .sent_outputs import backward as engine_backward
from .stalls import NoWatch, PhaseWatch
from .timing import InstructionClock, InstructionHook
from .transport import Transport

logger = logging.getLogger(__name__)

# Instruction type -> method name. A handler takes (index, instruction) and returns how many
# instructions it consumed (a Send/Recv handler posts the whole batch that starts there).
_HANDLERS: dict[type, str] = {
    Forward: "_forward",
    Backward: "_backward",
    BackwardInput: "_backward_input",
    BackwardWeight: "_backward_weight",
    ReduceGrads: "_reduce",
    Send: "_comm",
    Recv: "_comm",
    Wait: "_wait",
}


def check_handlers(handlers: Mapping[type, str] = _HANDLERS) -> None:
    """Raise `TypeError` if an instruction type of the plan format has no handler."""
    missing = [t.__name__ for t in INSTRUCTION_TYPES if t not in handlers]
    if missing:
        raise TypeError(f"the executor has no handler for instruction type(s) {missing}")


check_handlers()


@dataclass(frozen=True)
class ExecutorConfig:
    """Options of the executor.

    `p2p`: options of the point-to-point transport `RankRuntime` builds (its `timeout_s` also
    bounds the agreement on the plan). `loss`: the loss normalisation (`loss.py`). `debug`:
    synchronous mode, every batch of messages is waited for right after posting and every
    produced message is checked against the plan's shapes as it is produced; each instruction
    is logged with its duration. `validate`: run `validate_plan` (deadlock check included)
    before communicating. `nvtx`: NVTX range per instruction when CUDA is available.
    `deallocate_sent_outputs`: free a chunk output's data once all its sends completed, keeping
    its autograd graph (`sent_outputs.py`; Megatron's `deallocate_pipeline_outputs`).
    """

    p2p: P2PConfig = field(default_factory=P2PConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    debug: bool = False
    validate: bool = True
    nvtx: bool = True
    deallocate_sent_outputs: bool = True


@dataclass
class _Saved:
    """What a Forward keeps for its Backward."""

    inputs: list[tuple[MessageKey, dict[str, torch.Tensor]]]
    outputs: dict[str, torch.Tensor]
    root: torch.Tensor | None = None  # the weighted loss of a loss stage
    shapes: dict[str, torch.Size] = field(default_factory=dict)  # of outputs, before freeing
    freed: bool = False  # outputs freed after their sends (`sent_outputs.release`)
    offload: ActivationOffload | None = None  # its offloaded saved tensors (MemoryPolicy)
    store: SavedStore | None = None  # its saved tensors, where a split backward frees B's own


class Executor:
    """Runs one rank's program of `plan` (see the module docstring).

    `chunks`: this rank's model chunks (possibly DDP-wrapped), exactly those `placement` puts on
    pipeline rank `pp_group.rank()`. `placement`: the placement the chunks were built from.
    `transport`: this iteration's `Transport` (a fresh one per Executor). `tensor_fn`: what the
    built model sends for a message (`batching.message_tensors` bound to the model); when
    given, a plan with other shapes is refused before communicating. `tp_group` /
    `replica_group`: this rank's tensor-parallel group (same plan) and data-parallel group (each
    replica its own plan); when given, the plan verdict is agreed over them too, so every rank
    of the job must then construct its Executor for the step. `on_instruction`: the timing hook
    `(index, instruction, start, end)` (`timing.py`), called at the end of `run()`.
    `watch`: the training loop's named phases (`stalls.PhaseWatch`): the data-parallel
    gradient reduction runs as phase "grad sync".
    """

    def __init__(
        self,
        *,
        plan: Plan,
        chunks: Sequence[torch.nn.Module],
        placement: Placement,
        pp_group: torch.distributed.ProcessGroup,
        batches: BatchSource,
        transport: Transport,
        tensor_fn: TensorFn | None = None,
        config: ExecutorConfig = ExecutorConfig(),
        tp_group: torch.distributed.ProcessGroup | None = None,
        replica_group: torch.distributed.ProcessGroup | None = None,
        on_instruction: InstructionHook | None = None,
        watch: PhaseWatch | NoWatch | None = None,
    ) -> None:
        check_handlers()
        self.watch = watch if watch is not None else NoWatch()
        self.replica_group = replica_group
        self.plan = plan
        self.config = config
        self.rank = pp_group.rank()
        self.on_instruction = on_instruction
        self.device = chunks_device(chunks)
        self.chunks, self.df = self._checked_and_agreed(
            chunks,
            placement=placement,
            num_ranks=pp_group.size(),
            tensor_fn=tensor_fn,
            channel=transport.channel,
            groups=[
                ("pipeline", pp_group, True),
                ("tensor-parallel", tp_group, True),
                ("data-parallel", replica_group, False),
            ],
        )
        self.program = plan.program(self.rank)
        self.batches = batches
        self.tensor_fn = tensor_fn
        self.transport = transport
        self._ddp = {k: c for k, c in self.chunks.items() if _is_ddp(c)}
        self.losses = LossTracker(
            plan=plan,
            batches=batches,
            config=config.loss,
            reduction_averages=reduction_averages(config.loss, self._ddp.values(), plan.totals),
        )
        self._sync_at = (
            {} if plan.forward_only else grad_sync_points(self.program, placement, set(self._ddp))
        )
        self._last_use = _last_use(self.program)
        # Resolved once: the per-instruction loop should do no avoidable Python work.
        self._handlers = {t: getattr(self, name) for t, name in _HANDLERS.items()}
        self._nvtx = config.nvtx and torch.cuda.is_available()
        self._messages: dict[MessageKey, dict[str, torch.Tensor]] = {}
        self._saved: dict[StageId, _Saved] = {}
        self._pending: dict[StageId, PendingWeight | None] = {}  # B done, W to come
        self._weighted = {
            i.stage for i in self.program.instructions if isinstance(i, BackwardWeight)
        }
        # Layers computing their weight gradients in `backward_dw` (Transformer Engine's
        # delayed wgrad), per chunk: found once, called after every backward of the chunk.
        self._delayed = {key: delayed_modules(unwrap_chunk(c)) for key, c in self.chunks.items()}
        for key, modules in self._delayed.items():
            check_accumulated(self.chunks[key], modules)
        self._sync_log: list[tuple[int, tuple[str, int]]] = []
        self._sent = SentOutputs()
        self.freed_bytes = 0  # sent outputs' data freed before their backward (this run)

    def _checked_and_agreed(
        self,
        chunks: Sequence[torch.nn.Module],
        *,
        placement: Placement,
        num_ranks: int,
        tensor_fn: TensorFn | None,
        channel: ChannelFn,
        groups: Sequence[VerdictGroup],
    ):
        """This rank's checks, then the verdict agreed over `groups` (raises on every rank if
        any rank rejected its plan). Returns (chunks by key, data flow)."""
        error, identity = None, ""
        try:
            indexed = index_chunks(chunks)
            df = check_before_run(
                plan=self.plan,
                placement=placement,
                rank=self.rank,
                num_ranks=num_ranks,
                chunks=indexed,
                tensor_fn=tensor_fn,
                validate=self.config.validate,
                channel=channel,
            )
            identity = plan_identity(self.plan)
        except Exception as e:  # agreed first, then re-raised (by agree_on_plan)
            error = e
        agree_on_plan(
            error=error,
            identity=identity,
            rank=self.rank,
            groups=groups,
            device=self.device,
            timeout_s=self.config.p2p.timeout_s,
        )
        return indexed, df

    # -- running ---------------------------------------------------------------------------

    def run(self) -> IterationResult:
        """Execute the program; returns the loss reports. Call once per Executor."""
        started, wall = time.perf_counter(), time.time()
        clock = None
        if self.on_instruction is not None:
            clock = InstructionClock(self.on_instruction, device=self.device)
        # On CPU, Megatron's CUDA-to-CPU torch-function mode would tax every torch call of
        # every instruction; nothing here names a CUDA device (cpu_support).
        with cuda_to_cpu_suspended():
            self._start_syncs(-1)
            self._run_instructions(clock)
            self.transport.finish()
            # A forward-only plan (evaluation) reduces nothing, as Megatron's schedules do with
            # forward_only: finishing a DDP wrapper's gradient sync there would leave its
            # buckets in a finished state the next training iteration does not expect
            # (megatron-core 0.19 then gives wrong gradients).
            if not self.plan.forward_only:
                with self.watch.phase(
                    "grad sync", group=self.replica_group, group_name="data-parallel group"
                ):
                    for chunk in self._ddp.values():
                        chunk.finish_grad_sync()
                # Sequence-parallel parameters (norms) saw one sequence shard per TP rank.
                reduce_sequence_parallel_grads([self.chunks[k] for k in sorted(self.chunks)])
        left = self.leftovers()
        if any(left.values()):
            raise MessageError(f"rank {self.rank}: buffers left at the end of the program: {left}")
        if clock is not None:
            clock.flush()
        return IterationResult(
            reports=self.losses.reports(),
            objective=self.losses.objective,
            seconds=time.perf_counter() - started,
            messages=self.transport.messages_posted,
            grad_sync_started=list(self._sync_log),
            started=wall,
            ended=time.time(),
            leftovers=left,
            channel=self.transport.channel,
            freed_bytes=self.freed_bytes,
        )

    def _run_instructions(self, clock: InstructionClock | None) -> None:
        """The program's instructions in order, each by its handler (traced only in debug or
        NVTX mode, timed only with a clock)."""
        instrs, traced = self.program.instructions, self._nvtx or self.config.debug
        i = 0
        while i < len(instrs):
            ins, mark = instrs[i], clock.mark() if clock is not None else None
            if traced:
                with self._traced(i, ins):
                    consumed = self._handlers[type(ins)](i, ins)
            else:
                consumed = self._handlers[type(ins)](i, ins)
            if clock is not None:
                clock.span(mark, instrs[i : i + consumed], first=i)
            for k in range(i, i + consumed):
                self._after(k, instrs[k])
            i += consumed

    def leftovers(self) -> dict[str, list[str]]:
        """Messages, saved activations and sub-batches still held (empty after a full run)."""
        held = self.transport.pending()
        held["messages"] = [str(k) for k in self._messages]
        held["saved"] = [str(s) for s in self._saved]
        held["weight_grads"] = [str(s) for s in self._pending]
        cached = getattr(self.batches, "cached", None)
        held["sub_batches"] = [str(w) for w in cached()] if callable(cached) else []
        return held

    @contextlib.contextmanager
    def _traced(self, index: int, ins: Instruction):
        use_nvtx = self._nvtx
        if use_nvtx:
            torch.cuda.nvtx.range_push(f"{type(ins).__name__} {getattr(ins, 'stage', '')}")
        t0 = time.perf_counter() if self.config.debug else 0.0
        try:
            yield
        finally:
            if use_nvtx:
                torch.cuda.nvtx.range_pop()
            if self.config.debug:
                logger.debug(
                    "rank %d instruction %d %s: %.3f ms",
                    self.rank,
                    index,
                    ins,
                    1e3 * (time.perf_counter() - t0),
                )

    def _after(self, index: int, ins: Instruction) -> None:
        work = self._last_use.get(index)
        if work is not None:
            self.batches.release(work)
        if index in self._sync_at:
            self._start_syncs(index)

    def _start_syncs(self, index: int) -> None:
        for key in self._sync_at.get(index, ()):
            self._ddp[key].start_grad_sync()
            self._sync_log.append((index, key))

    # -- communication ---------------------------------------------------------------------

    def _comm(self, first: int, ins: Send | Recv) -> int:
        """Post the batch starting at `first` (a maximal run of Send/Recv); returns its length."""
        instrs = self.program.instructions
        end = first
        while end < len(instrs) and isinstance(instrs[end], (Send, Recv)):
            end += 1
        indexed = list(enumerate(instrs[first:end], start=first))
        outgoing = {
            op.key: self._messages.pop(op.key)
            for _, op in indexed
            if isinstance(op, Send) and op.key in self._messages
        }
        self.transport.post(indexed, outgoing)
        if self.config.debug:
            keys = [op.key for _, op in indexed]
            self.transport.wait(keys, where=f"instruction {first} (debug wait)", index=first)
            self._sends_completed(keys)
        return end - first

    def _wait(self, index: int, ins: Wait) -> int:
        where = f"instruction {index} (Wait for {len(ins.keys)} message(s))"
        self.transport.wait(ins.keys, where=where, index=index)
        self._sends_completed(ins.keys)
        return 1

    def _sends_completed(self, keys: Iterable[MessageKey]) -> None:
        """Free the outputs of the stages whose every remote message has now been sent."""
        for stage in self._sent.completed(keys):
            saved = self._saved.get(stage)
            if saved is not None:
                self.freed_bytes += release(saved.outputs)
                saved.freed = True

    def _take(self, key: MessageKey, index: int) -> dict[str, torch.Tensor]:
        found = self._messages.pop(key, None)  # a local hand-over (remote ones never are here)
        if found is not None:
            return found
        if self.df.receiver_of(key) == self.df.sender_of(key):
            raise MessageError(
                f"rank {self.rank}: instruction {index} needs local message {key}, "
                "which has not been produced"
            )
        return self.transport.take(key)

    def _produce(self, index: int, key: MessageKey, tensors: dict[str, torch.Tensor]) -> None:
        if key in self._messages:
            raise MessageError(f"rank {self.rank}: instruction {index} produces {key} twice")
        if self.config.debug and self.tensor_fn is not None:
            check_message(
                tensors,
                tuple(self.tensor_fn(key)),
                where=f"rank {self.rank}: instruction {index}",
                key=key,
            )
        self._messages[key] = tensors

    # -- compute ---------------------------------------------------------------------------

    def _chunk(self, stage: StageId) -> torch.nn.Module:
        return self.chunks[(stage.module, stage.chunk)]

    def _trains(self, stage: StageId) -> bool:
        return not self.plan.forward_only and self.df.needs_backward(stage.module)

    def _forward(self, index: int, ins: Forward) -> int:
        stage, train = ins.stage, self._trains(ins.stage)
        wants_grad = {k.producer for k in self.df.backward_outputs(stage)} if train else set()
        inputs: list[tuple[MessageKey, dict[str, torch.Tensor]]] = []
        for key in self.df.forward_inputs(stage):
            msg = self._take(key, index)
            leafs = key.producer in wants_grad
            inputs.append((key, {n: _leaf(t, leafs) for n, t in msg.items()}))
        chunk = self._chunk(stage)
        # A split stage boxes its saved tensors, so that its B can free those W does not need.
        store = SavedStore() if train and stage in self._weighted else None
        boxed = store.hooks() if store is not None else contextlib.nullcontext()
        with torch.set_grad_enabled(train), boxed:
            outputs, offload = run_policy(
                unwrap_chunk(chunk),
                ins.memory,
                chunk,
                [m for _, m in inputs],
                self.batches.sub_batch(stage.work),
            )
        saved = _Saved(inputs, outputs, offload=offload, store=store)
        if "loss" in outputs:
            if self.df.consumers(stage):
                raise PlanError(f"rank {self.rank}: instruction {index}: {stage} returned a loss")
            root = self.losses.weighted(
                stage, outputs, where=f"rank {self.rank}: instruction {index}"
            )
            scale = getattr(unwrap_chunk(chunk).config, "grad_scale_func", None)
            saved.root = scale(root) if scale is not None else root
        else:
            keys = self.df.forward_outputs(stage)
            if not keys:
                raise PlanError(f"rank {self.rank}: {stage} returns no loss and feeds nothing")
            if train:
                saved.outputs = self._handed_over(stage, keys, outputs)
            for key in keys:
                self._produce(
                    index, key, {n: t.detach().contiguous() for n, t in saved.outputs.items()}
                )
        if train:
            saved.shapes = {n: t.shape for n, t in saved.outputs.items()}
            self._saved[stage] = saved
        return 1

    def _handed_over(
        self, stage: StageId, keys: Sequence[MessageKey], outputs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """`outputs` to keep for the backward: when some go to other ranks, hand-overs that are
        freed once those sends complete (`sent_outputs.py`); else the outputs themselves."""
        remote = [k for k in keys if self.df.receiver_of(k) != self.rank]
        if not remote or not self.config.deallocate_sent_outputs:
            return outputs
        self._sent.expect(stage, remote)
        return handover(outputs)

    def _backward(self, index: int, ins: Backward) -> int:
        stage = ins.stage
        saved = self._forward_state(index, stage)
        roots, grads = self._roots(index, stage, saved)
        with self._no_sync(stage):
            if roots and saved.freed:
                engine_backward(roots, grads)
            elif roots:
                torch.autograd.backward(roots, grads)
            if roots:
                compute_delayed(self._delayed[(stage.module, stage.chunk)])
        self._produce_input_grads(index, stage, saved)
        return 1

    def _backward_input(self, index: int, ins: BackwardInput) -> int:
        stage = ins.stage
        saved = self._forward_state(index, stage)
        roots, grads = self._roots(index, stage, saved)
        keep = self.plan.placement.module(stage.module).trainable  # a W follows
        params = trainable_parameters(unwrap_chunk(self._chunk(stage))) if keep else []
        with self._no_sync(stage):
            pending = backward_input(
                roots,
                grads,
                input_leaves(m for _, m in saved.inputs),
                params,
                keep_graph=keep,
                store=saved.store,
                delayed=self._delayed[(stage.module, stage.chunk)],
            )
        if keep:
            self._pending[stage] = pending
        self._produce_input_grads(index, stage, saved)
        return 1

    def _backward_weight(self, index: int, ins: BackwardWeight) -> int:
        stage = ins.stage
        if stage not in self._pending:
            raise PlanError(f"rank {self.rank}: instruction {index}: {stage} has no input half")
        with self._no_sync(stage):
            backward_weight(self._pending.pop(stage))
        return 1

    def _reduce(self, index: int, ins: ReduceGrads) -> int:
        # The reduction itself starts in `_after` (grad_sync_points names this instruction).
        return 1

    def _forward_state(self, index: int, stage: StageId) -> _Saved:
        saved = self._saved.pop(stage, None)
        if saved is None:
            raise PlanError(f"rank {self.rank}: instruction {index}: {stage} has no forward state")
        self._sent.forget(stage)
        if saved.offload is not None:
            saved.offload.prefetch()  # the last offloaded layer; the others as backward goes
        return saved

    def _no_sync(self, stage: StageId):
        chunk = self._chunk(stage)
        return chunk.no_sync() if _is_ddp(chunk) else contextlib.nullcontext()

    def _produce_input_grads(self, index: int, stage: StageId, saved: _Saved) -> None:
        """The gradient messages of `stage`'s inputs, for the producers that train."""
        for key, leaves in saved.inputs:
            grad_key = MessageKey(MessageKind.GRADIENT, key.producer, stage)
            if not self.df.needs_backward(key.producer.module):
                continue
            msg = {n: _grad_of(t) for n, t in leaves.items() if t.is_floating_point()}
            self._produce(index, grad_key, msg)

    def _roots(self, index: int, stage: StageId, saved: _Saved):
        if saved.root is not None:
            return [saved.root], [None]
        total: dict[str, torch.Tensor] = {}
        for key in self.df.backward_inputs(stage):
            for name, g in self._take(key, index).items():
                if name not in saved.outputs:
                    raise MessageError(
                        f"rank {self.rank}: instruction {index}: gradient {name!r} of {key} "
                        f"for an output {stage} does not have"
                    )
                if self.config.debug and g.shape != saved.shapes[name]:
                    raise MessageError(
                        f"rank {self.rank}: instruction {index}: gradient {name!r} of {key} is "
                        f"{tuple(g.shape)}, the output is {tuple(saved.shapes[name])}"
                    )
                total[name] = g if name not in total else total[name] + g
        pairs = [(saved.outputs[n], g) for n, g in total.items() if saved.outputs[n].requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    leaf = t.detach()
    if requires_grad and leaf.is_floating_point():
        leaf.requires_grad_(True)
    return leaf


def _grad_of(t: torch.Tensor) -> torch.Tensor:
    # An input the chunk did not use gets a zero gradient: the message must still be complete.
    return t.grad.contiguous() if t.grad is not None else torch.zeros_like(t)


def _is_ddp(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("no_sync", "start_grad_sync", "finish_grad_sync"))


def _last_use(program) -> dict[int, WorkId]:
    """Instruction index -> the sub-microbatch whose last compute it is (released after it)."""
    last: dict[WorkId, int] = {}
    for i, ins in enumerate(program.instructions):
        if isinstance(ins, (Forward, Backward, BackwardWeight)):
            last[ins.stage.work] = i
    return {i: work for work, i in last.items()}


def run_program(**kwargs: Any) -> IterationResult:
    """`Executor(**kwargs).run()`."""
    return Executor(**kwargs).run()


__all__: Iterable[str] = [
    "Executor",
    "ExecutorConfig",
    "IterationResult",  # defined in iteration.py
    "check_handlers",
    "run_program",
]
