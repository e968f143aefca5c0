"""The activation memory a chunk really keeps for backward, next to what the cost model predicts.

`saved_bytes` counts what autograd saves while a forward runs (`torch.autograd.graph.
saved_tensors_hooks`): every saved tensor's storage, each storage once (views of one buffer,
e.g. Q, K and V split from one projection, share it), leaving out parameters and the
sub-microbatch's own input data, which live for the whole step whatever the chunk does. The
messages a chunk received are added (each storage once too): the runtime keeps them until the
chunk's backward (it sends their gradients), and under full recomputation they are all the
chunk keeps (the non-reentrant checkpoint holds them, not autograd's saved tensors).

`MeasuringPipeline` runs a whole model in one process (the reference pipeline, every chunk under
the plan's recompute mode through the runtime's own `run_chunk`) and records, for every (chunk,
sub-microbatch), the measured bytes and the cost model's `chunk_activation_bytes`. The memory
test (`tests/test_memory_model.py`) compares them per module and recompute mode; the GPU check
(`scripts/gpu_check.sh`) puts the same prediction next to `torch.cuda.max_memory_allocated`.

`HeldActivations` measures the same kind of bytes on the runtime itself: what one rank's
`Executor` holds between instructions (autograd's saved tensors, its buffers, the transport's
messages), and the peak; the runtime tests compare it with sent outputs freed and kept.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from megatron_dip.reference import LocalPipeline
from megatron_dip.runtime.recompute import run_policy
from megatron_dip.schedule.ir import (
    NO_RECOMPUTE,
    MemoryPolicy,
    Recompute,
    SubMicrobatch,
)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr()


@dataclass
class SavedBytes:
    """Storages saved for backward while a `saved_bytes` block ran (module docstring)."""

    excluded: set = field(default_factory=set)
    storages: dict = field(default_factory=dict)  # key -> (nbytes, a tensor keeping it alive)

    def add(self, t: torch.Tensor) -> None:
        """Count `t`'s storage (once) unless it is excluded."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = _storage_key(t)
        if key not in self.excluded and key not in self.storages:
            self.storages[key] = (t.untyped_storage().nbytes(), t)

    @property
    def nbytes(self) -> int:
        return sum(n for n, _ in self.storages.values())


@contextlib.contextmanager
def saved_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedBytes]:
    """Inside: every tensor autograd saves is counted by storage (module docstring); the
    storages of `exclude` (parameters, input data) are not."""
    record = SavedBytes(excluded={_storage_key(t) for t in exclude})

    def pack(t: torch.Tensor) -> torch.Tensor:
        record.add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield record


def _tensors(value) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists/tuples/dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _bytes(tensors: Iterable[torch.Tensor], leave_out: set = frozenset()) -> int:
    """Bytes of the storages of `tensors`, each storage once, but those in `leave_out` (storage
    keys)."""
    seen: dict = {}
    for t in tensors:
        key = _storage_key(t)
        if key not in leave_out and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class ChunkMemory:
    """One chunk forward: measured saved bytes and the cost model's prediction; on CUDA also the
    allocator's growth over the forward and its peak above the start (0 elsewhere)."""

    module: str
    chunk: int
    first: bool
    last: bool
    sub: SubMicrobatch
    recompute: MemoryPolicy
    measured: int
    predicted: int
    allocated: int = 0
    peak: int = 0


@contextlib.contextmanager
def cuda_memory(device: torch.device) -> Iterator[dict]:
    """Inside: on CUDA, {"allocated", "peak"} filled at the exit with the allocator's growth
    over the block and its peak above the start (`torch.cuda.max_memory_allocated`)."""
    stats = {"allocated": 0, "peak": 0}
    if device.type != "cuda":
        yield stats
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    yield stats
    torch.cuda.synchronize(device)
    stats["allocated"] = torch.cuda.memory_allocated(device) - start
    stats["peak"] = torch.cuda.max_memory_allocated(device) - start


class MeasuringPipeline(LocalPipeline):
    """`LocalPipeline` that measures every chunk forward under `recompute` and asks
    `cost_model` for its prediction (module docstring)."""

    recompute: MemoryPolicy = NO_RECOMPUTE
    cost_model = None
    records: list

    def run_chunk(self, chunk, inputs: list, batch, sub: SubMicrobatch) -> dict:
        batch = batch.to(chunk.device)  # the data on the device before the forward, not in it
        params = [p for p in chunk.parameters()]
        data = [batch.segments, batch.positions, *batch.tensors.values()]
        policy = self.recompute.fitted(chunk.chunk.num_layers)
        with cuda_memory(chunk.device) as cuda, saved_bytes(exclude=[*params, *data]) as record:
            outputs, _ = run_policy(chunk, policy, chunk, inputs, batch)
        for t in _tensors(inputs):  # the runtime keeps received messages for the backward
            record.add(t)
        predicted = self.cost_model.chunk_activation_bytes(chunk.chunk, sub, policy)
        self.records.append(
            ChunkMemory(
                chunk.chunk.module,
                chunk.chunk.index,
                chunk.is_first,
                chunk.is_last,
                sub,
                self.recompute,
                record.nbytes,
                predicted,
                cuda["allocated"],
                cuda["peak"],
            )
        )
        return outputs


# Every recompute method; the partial ones with N = 2 (the middle chunk's layers are cut into
# checkpointed and kept ones, or into groups).
MEASURED_MODES: tuple[MemoryPolicy, ...] = (
    NO_RECOMPUTE,
    MemoryPolicy(Recompute.SELECTIVE, 0),
    MemoryPolicy(Recompute.FULL, 0),
    MemoryPolicy(Recompute.BLOCK, 2),
    MemoryPolicy(Recompute.UNIFORM, 2),
    # Offload of one layer (its saved tensors leave the device), alone and after block
    # recomputation of the first layer (as many layers as the chunk has: `MemoryPolicy.fitted`).
    MemoryPolicy(Recompute.NONE, 0, 1),
    MemoryPolicy(Recompute.BLOCK, 1, 1),
    # Cheap module recomputation (the norms' and the MLP activation's outputs), alone and in
    # the layers block recomputation of the first one leaves.
    MemoryPolicy(Recompute.NONE, 0, 0, ("layernorm", "mlp_act")),
    MemoryPolicy(Recompute.BLOCK, 1, 0, ("layernorm", "mlp_act")),
)


def mode_name(mode: MemoryPolicy) -> str:
    """ "none", "selective", "full", "block2", "uniform2", "off1", "block1+off1"."""
    return mode.label


def measure_model(
    model,
    microbatches,
    *,
    cost_model,
    recompute: MemoryPolicy,
    config,
    groups,
    seq_length: int,
    ranges=None,
    sizes=None,
) -> list[ChunkMemory]:
    """Forward (and backward, freeing the graph) of `microbatches` with every chunk under
    `recompute` (a memory policy, as `Forward.memory`); one `ChunkMemory` per chunk forward."""
    pipe = MeasuringPipeline.build(
        model, config=config, groups=groups, seq_length=seq_length, seed=0, ranges=ranges
    )
    pipe.recompute, pipe.cost_model, pipe.records = recompute, cost_model, []
    pipe.forward_backward(microbatches, sizes=sizes)
    return pipe.records


class PendingWeightPipeline(LocalPipeline):
    """`LocalPipeline` whose trainable chunks run split backwards as the runtime does
    (`runtime.backward_split`: the forward under a `SavedStore`, B, then W) and record, for
    every non-loss (chunk, sub-microbatch), the bytes its pending W holds between them (the
    kept saved tensors, the recorded gradients and the received messages, each storage once,
    parameters and the sub-microbatch's data left out) next to `CostModel.weight_bytes`
    (`PendingWeightBytes`). The loss stages run their backward fused."""

    cost_model = None
    records: list

    def run_chunk(self, chunk, inputs: list, batch, sub: SubMicrobatch) -> dict:
        from megatron_dip.runtime.backward_split import SavedStore

        store = SavedStore()
        with store.hooks():
            outputs, _ = run_policy(chunk, MemoryPolicy(), chunk, inputs, batch)
        data = [batch.segments, batch.positions, *batch.tensors.values()]
        self._split[id(outputs)] = (chunk, sub, store, data)
        return outputs

    def _backward(self, stages, loss: torch.Tensor) -> None:
        from megatron_dip.runtime.backward_split import backward_input, trainable_parameters

        if loss.requires_grad:
            loss.backward()
        for record in reversed(stages):
            outs, grads = record.output_grads()
            chunk, sub, store, data = self._split.pop(id(record.outputs))
            if not outs:
                continue
            params = trainable_parameters(chunk)
            leaves = [t for m in record.received for t in m.values() if t.requires_grad]
            pending = backward_input(outs, grads, leaves, params, keep_graph=True, store=store)
            excluded = {_storage_key(t) for t in [*chunk.parameters(), *data]}
            measured = _nbytes([*pending.tensors(), *_tensors(record.received)], excluded)
            received = _nbytes(_tensors(record.received), excluded)
            released = _released_by_weight_half(pending, params, outs[0].device)
            predicted = self.cost_model.weight_bytes(chunk.chunk, sub)
            self.records.append(
                PendingWeightBytes(
                    chunk.chunk.module,
                    chunk.is_first,
                    chunk.is_last,
                    sub,
                    measured,
                    predicted,
                    allocated=released + received if outs[0].device.type == "cuda" else 0,
                )
            )


def _nbytes(tensors: Iterable[torch.Tensor], excluded: set) -> int:
    """Bytes of the storages of `tensors`, each once, those in `excluded` left out."""
    held = SavedBytes(excluded=excluded)
    for t in tensors:
        held.add(t)
    return held.nbytes


def _released_by_weight_half(pending, params, device: torch.device) -> int:
    """Run W (`backward_weight`); on CUDA the bytes it released (the allocator's drop, with the
    weight gradients it allocated added back): what the pending W held on the device,
    whatever held it (autograd's boxes, Transformer Engine's weight-GEMM queue). 0 elsewhere."""
    from megatron_dip.runtime.backward_split import backward_weight

    if device.type != "cuda":
        backward_weight(pending)
        return 0
    without = [p for p in params if p.grad is None]
    store = pending.store
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    backward_weight(pending)
    # The graph is not run again, but this probe still holds the chunk's outputs and so its
    # nodes: empty W's boxes as dropping the outputs does in the runtime.
    for box in store.boxes if store is not None else ():
        box.tensor = None
    torch.cuda.synchronize(device)
    grads = sum(p.grad.untyped_storage().nbytes() for p in without if p.grad is not None)
    return before - torch.cuda.memory_allocated(device) + grads


@dataclass(frozen=True)
class PendingWeightBytes:
    """One split backward: the bytes its pending W held (measured) and `weight_bytes`."""

    module: str
    first: bool
    last: bool
    sub: SubMicrobatch
    measured: int
    predicted: int
    allocated: int = 0  # on CUDA: the bytes W released, the received messages added


def measure_pending_weights(
    model, microbatches, *, cost_model, config, groups, seq_length: int, ranges=None, sizes=None
) -> list[PendingWeightBytes]:
    """Forward and split backward of `microbatches` (`PendingWeightPipeline`)."""
    pipe = PendingWeightPipeline.build(
        model, config=config, groups=groups, seq_length=seq_length, seed=0, ranges=ranges
    )
    pipe.cost_model, pipe.records, pipe._split = cost_model, [], {}
    pipe.forward_backward(microbatches, sizes=sizes)
    return pipe.records


class HeldActivations:
    """The activation bytes one rank's `Executor` holds between instructions, and their peak.

    Counted after every instruction, each storage once: what autograd saved for the pending
    backwards (weak references taken by a `saved_tensors_hooks` pack hook while the program
    runs, so a freed graph stops counting), what the executor keeps for them (the inputs and
    outputs of its pending forwards), its local messages and the transport's messages in flight
    or received. Parameters are left out. Used as a context manager around `executor.run()`
    (it wraps the executor's per-instruction step); `peak` is the largest count, `samples` all.
    `message_samples` count the transport's messages alone (in flight or received and not yet
    taken by their consumer), `message_peak` their largest: the pipeline's message buffers,
    as `planner.simulator.message_peaks` models them.
    """

    def __init__(self, executor) -> None:
        self.executor = executor
        self.samples: list[int] = []
        self.message_samples: list[int] = []
        self._saved: list = []
        self._params = {_storage_key(p) for c in executor.chunks.values() for p in c.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    @property
    def message_peak(self) -> int:
        return max(self.message_samples, default=0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            self._saved.append(weakref.ref(t))
        return t

    def __enter__(self) -> HeldActivations:
        step = self.executor._after

        def after(index, ins) -> None:
            step(index, ins)
            self.samples.append(self.count())
            self.message_samples.append(_bytes(self._messages()))

        self.executor._after = after
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        del self.executor._after

    def _held(self) -> Iterator[torch.Tensor]:
        ex = self.executor
        for ref in self._saved:
            t = ref()
            if t is not None:
                yield t
        for saved in ex._saved.values():
            yield from _tensors([m for _, m in saved.inputs])
            yield from _tensors(saved.outputs)
            if saved.store is not None:  # a split stage's saved tensors, boxed (no pack here)
                yield from saved.store.tensors()
        for pending in ex._pending.values():
            if pending is not None:
                yield from pending.tensors()
        yield from _tensors(ex._messages)
        yield from self._messages()

    def _messages(self) -> Iterator[torch.Tensor]:
        """The transport's messages: sent and not yet released, received and not yet taken."""
        for name in ("_sending", "_received"):
            yield from _tensors(getattr(self.executor.transport, name, {}))

    def count(self) -> int:
        """Bytes held now (class docstring)."""
        held = _bytes(self._held(), leave_out=self._params)
        self._saved = [r for r in self._saved if r() is not None]
        return held
