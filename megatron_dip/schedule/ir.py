"""The plan format: small immutable instruction types, per-rank programs and the `Plan`.

A `Plan` is everything one data-parallel replica's pipeline ranks need for one iteration:
the static `Placement` (which chunk of which module lives on which rank), the sub-microbatch
table, the cross-module dependencies, the global-batch loss denominators and one `Program`
(an ordered tuple of instructions) per pipeline rank.

Execution semantics (what `engine.py` models and the runtime implements):

* `Forward`/`Backward` run one chunk on one sub-microbatch. Their inputs must already be on the
  rank: produced locally by an earlier instruction or received by a `Recv` that an earlier
  `Wait` completed.
* A backward may be split (Zero-Bubble style): `BackwardInput` (a `Backward`: it computes the
  input gradients and produces the gradient messages, keeping the chunk's activations) and a
  later `BackwardWeight` of the same stage on the same rank (the weight gradients; frees the
  activations). Only trainable modules have a `BackwardWeight`.
* `ReduceGrads` starts the data-parallel gradient reduction of one chunk of this rank, after the
  chunk's last weight gradient; it runs beside the compute and is waited for at the end of the
  program. A plan either has one per trainable chunk of a rank or none on that rank (then the
  runtime starts each reduction after the chunk's last backward).
* `Send`/`Recv` are *posted* without blocking. A maximal run of consecutive `Send`/`Recv`
  instructions forms one batch (one `batch_isend_irecv`), split by *channel*: the ordered
  streams messages travel on, as the plan's `channels` declares. `Channels.SINGLE`: every
  message of a rank on one stream (one NCCL communicator per pipeline group, Megatron-Core's).
  `Channels.PER_PEER`: one stream per ordered (sender, receiver) pair (a 2-rank communicator
  per direction, the runtime's `ChannelGroups`). Batches of a channel start in program order,
  each only after the previous one completed. An operation completes once its batch and the
  batch holding the matching operation on the peer have both started; a batch completes when
  all its operations have. A plan that is executable on one stream is executable on per-peer
  streams too, not the other way round.
* `Wait` blocks the rank until the named operations completed; the runtime waits for the
  whole batches holding them (NCCL completes one `batch_isend_irecv` together), and so does the
  deadlock check (`execute_programs(whole_batches=True)`), while the simulator times each
  operation. Why not whole batches there too: the stock baselines are Megatron's orders with
  this module's posting (`passes.add_communication`), not Megatron's own p2p calls, and timed
  by whole batches they wait for sends in batches Megatron does not form (T2V-S: interleaved
  6.22 -> 7.84 s), while per operation the simulated 1F1B matches Megatron-Core's measured one
  within 1% (docs/benchmarks.md, the emulated runs); DIP's own plans differ by 1-8 ms (T2V-S).
  Everything still outstanding at the end of a program is waited for implicitly.

Messages are named by `MessageKey` (kind, producer stage, consumer stage), so a message can never
be confused with another one, even when the previous and the next pipeline rank are the same
process (PP=2).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

FORMAT_VERSION = 2  # 2: `Plan.channels`


class Channels(str, enum.Enum):
    """Which messages share an ordered stream (module docstring): a plan's posting may rely on
    per-peer streams (`PER_PEER`: receives posted ahead, `schedule.passes`) or not (`SINGLE`)."""

    SINGLE = "single"
    PER_PEER = "per-peer"


class MessageKind(str, enum.Enum):
    """What a message carries: forward activations or backward gradients."""

    ACTIVATION = "act"
    GRADIENT = "grad"


class Recompute(str, enum.Enum):
    """Activation recomputation of one chunk on one sub-microbatch.

    BLOCK and UNIFORM are Megatron's `--recompute-method block|uniform` with
    `--recompute-num-layers N` (`MemoryPolicy.layers`): BLOCK recomputes the chunk's
    first N transformer layers (each keeps only its input) and keeps every activation of the
    others; UNIFORM cuts the chunk's layers into groups of N consecutive layers, each keeping only
    its input, and recomputes every layer. FULL keeps only the chunk's input and recomputes the
    whole chunk, its input and output layers included (UNIFORM with one group, plus those).
    """

    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core only (Megatron's "selective")
    FULL = "full"  # keep the chunk input only, recompute the whole chunk in backward
    BLOCK = "block"  # recompute the first N layers (Megatron's block method)
    UNIFORM = "uniform"  # recompute all layers in groups of N (Megatron's uniform method)

    @property
    def takes_layers(self) -> bool:
        """Whether the method needs a layer count N (`MemoryPolicy.layers`)."""
        return self in (Recompute.BLOCK, Recompute.UNIFORM)


# Cheap partial recomputation (`MemoryPolicy.modules`): "layernorm" is Megatron-Core's
# `recompute_modules` entry (the norms before the attention and the MLP keep only their input;
# their outputs, the inputs of linear_qkv / linear_fc1, are recomputed in backward), "mlp_act"
# the MLP's activation function (its output, fc2's input, recomputed from fc1's output: Megatron
# calls this "moe_act" for experts and has no switch for a dense MLP).
RECOMPUTE_MODULES = ("layernorm", "mlp_act")
_MODULE_LABELS = {"layernorm": "ln", "mlp_act": "act"}


@dataclass(frozen=True, order=True, slots=True)
class MemoryPolicy:
    """What one chunk keeps of one sub-microbatch's activations, and where: recompute `method`
    with its `layers` N (block / uniform; 0 otherwise), and `offload` K, the number of the
    chunk's layers whose saved tensors go to pinned host memory after their forward and come
    back before the chunk's backward (PipeOffload; Megatron-Core's activation offloading).

    The offloaded layers are the first K of those that keep their activations: layers
    [N, N + K) of the chunk under BLOCK N, [0, K) under NONE (the earliest layers: their copies
    have the most forward to hide behind, and their reloads are needed last). Only NONE and
    BLOCK combine with offload.

    `modules`: cheap partial recomputation (`RECOMPUTE_MODULES`, sorted) in the layers that
    keep their activations (all under NONE and SELECTIVE, the last n - N under BLOCK N): each
    named module keeps only its input and recomputes its output in backward. It combines with
    NONE, SELECTIVE and BLOCK, not with offload (the runtime's offload hooks would move the
    recomputed outputs' inputs too, an exactness risk it does not take).

    The plan's one memory value: a `Forward` carries it, the cost model prices it
    (`CostModel.stage_cost`), the memory pass chooses it and the runtime's dispatcher
    (`runtime.recompute.run_policy`) carries it out. Not a tuple, so that it never compares
    equal to, or unpacks like, anything but itself.
    """

    method: Recompute = Recompute.NONE
    layers: int = 0
    offload: int = 0
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Recompute(self.method))
        object.__setattr__(self, "modules", tuple(self.modules))

    def check(self, num_layers: int | None = None) -> MemoryPolicy:
        """The policy itself; ValueError when its numbers do not fit its method (or a chunk of
        `num_layers` layers, when given)."""
        method, n, k = self.method, self.layers, self.offload
        if method.takes_layers != (n > 0) or n < 0 or k < 0:
            raise ValueError(
                f"memory policy {self.label}: {method.value} takes "
                f"{'N >= 1' if method.takes_layers else 'no'} layers, offload K >= 0"
            )
        if k and method not in (Recompute.NONE, Recompute.BLOCK):
            # FULL and UNIFORM keep checkpoint inputs only; SELECTIVE's checkpointed attention
            # cores hold their inputs outside autograd's saved tensors, where no hook moves them.
            raise ValueError(
                f"memory policy {self.label}: only none and block recompute combine with offload"
            )
        if num_layers is not None and k and self.offload_start + k > num_layers:
            raise ValueError(
                f"memory policy {self.label}: offloads past the chunk's {num_layers} layers"
            )
        self._check_modules()
        return self

    def _check_modules(self) -> None:
        """ValueError unless `modules` are known, sorted, unique and on a method they fit."""
        mods = tuple(self.modules)
        if any(m not in RECOMPUTE_MODULES for m in mods) or mods != tuple(sorted(set(mods))):
            raise ValueError(
                f"memory policy {self.label}: recompute modules must be sorted, distinct names "
                f"of {RECOMPUTE_MODULES}, got {mods}"
            )
        if mods and self.method in (Recompute.FULL, Recompute.UNIFORM):
            raise ValueError(
                f"memory policy {self.label}: {self.method.value} recomputes every "
                "layer; module recomputation applies to the layers that keep activations"
            )
        if mods and self.offload:
            raise ValueError(
                f"memory policy {self.label}: module recomputation does not combine with offload"
            )

    @property
    def recompute_only(self) -> MemoryPolicy:
        """The recomputation half: this policy without its offload."""
        return MemoryPolicy(self.method, self.layers, 0, self.modules)

    def with_offload(self, offload: int) -> MemoryPolicy:
        """This policy's recomputation with `offload` K layers offloaded."""
        return MemoryPolicy(self.method, self.layers, offload, self.modules)

    def fitted(self, num_layers: int) -> MemoryPolicy:
        """This policy for a chunk of `num_layers` layers: its offload clamped to the layers
        the chunk has from `offload_start` on (a uniform setting applied to every chunk)."""
        room = max(0, num_layers - self.offload_start)
        return self if self.offload <= room else self.with_offload(room)

    @property
    def offload_start(self) -> int:
        """Chunk-local index of the first offloaded layer."""
        return self.layers if self.method is Recompute.BLOCK else 0

    @property
    def label(self) -> str:
        """`none`, `block2`, `off3`, `block1+off2`, ... (printouts, traces, reports)."""
        base = self.method.value + (str(self.layers) if self.layers else "")
        base += "".join(f"+{_MODULE_LABELS.get(m, m)}" for m in self.modules)
        if not self.offload:
            return base
        off = f"off{self.offload}"
        return off if self.method is Recompute.NONE else f"{base}+{off}"

    def __str__(self) -> str:
        return self.label


NO_RECOMPUTE = MemoryPolicy()  # keep every activation on the device

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}


@dataclass(frozen=True, order=True)
class WorkId:
    """One sub-microbatch of one module: the unit of data a chunk computes on."""

    module: str
    microbatch: int
    sub: int = 0

    def __str__(self) -> str:
        return f"{self.module}[mb{self.microbatch}.{self.sub}]"


@dataclass(frozen=True, order=True)
class StageId:
    """One chunk of one module applied to one sub-microbatch."""

    module: str
    chunk: int
    microbatch: int
    sub: int = 0

    @property
    def work(self) -> WorkId:
        return WorkId(self.module, self.microbatch, self.sub)

    def __str__(self) -> str:
        return f"{self.module}{self.chunk}[mb{self.microbatch}.{self.sub}]"


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor of a message, fixed by the plan."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"TensorSpec {self.name!r}: unsupported dtype {self.dtype!r}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ValueError(f"TensorSpec {self.name!r}: bad shape {self.shape!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, order=True)
class MessageKey:
    """Names a message: activations of `producer` for `consumer`, or the gradient back.

    An activation message goes from the rank of `producer` to the rank of `consumer`;
    a gradient message goes the other way.
    """

    kind: MessageKind
    producer: StageId
    consumer: StageId

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.producer}->{self.consumer}"


# ---------------------------------------------------------------------------------------------
# Instructions


@dataclass(frozen=True)
class Forward:
    """Forward of `stage.chunk` of `stage.module` on sub-microbatch `stage.work`, keeping its
    activations as `memory` says (recomputation and offload: `MemoryPolicy`)."""

    stage: StageId
    memory: MemoryPolicy = NO_RECOMPUTE

    def __post_init__(self) -> None:
        if not isinstance(self.memory, MemoryPolicy):
            raise TypeError(
                f"Forward {self.stage}: memory must be a MemoryPolicy, got {self.memory!r}"
            )
        try:
            self.memory.check()
        except ValueError as err:
            raise ValueError(f"Forward {self.stage}: {err}") from None


@dataclass(frozen=True)
class Backward:
    """Backward of the chunk on the sub-microbatch (input and weight gradients)."""

    stage: StageId


@dataclass(frozen=True)
class BackwardInput(Backward):
    """The input-gradient half of a split backward: gradients of the chunk's inputs (sent to the
    producers like a `Backward`'s), keeping the activations its `BackwardWeight` needs."""


@dataclass(frozen=True)
class BackwardWeight:
    """The weight-gradient half of a split backward of `stage` (after its `BackwardInput`)."""

    stage: StageId


def compute_tag(ins: Forward | Backward | BackwardWeight) -> str:
    """The short name of a compute instruction's kind, the same in plan printouts, simulated
    and measured traces and errors: F, B (a fused backward), BI and BW (a split backward's
    input and weight halves)."""
    if isinstance(ins, Forward):
        return "F"
    if isinstance(ins, BackwardWeight):
        return "BW"
    return "BI" if isinstance(ins, BackwardInput) else "B"


def compute_label(ins: Forward | Backward | BackwardWeight) -> str:
    """A trace span's label of a compute instruction: `F vit3 mb2.1` (kind, module and chunk,
    microbatch.sub-microbatch), simulated and measured alike."""
    s = ins.stage
    return f"{compute_tag(ins)} {s.module}{s.chunk} mb{s.microbatch}.{s.sub}"


@dataclass(frozen=True)
class ReduceGrads:
    """Start the data-parallel gradient reduction of chunk `chunk` of `module` on this rank."""

    module: str
    chunk: int


@dataclass(frozen=True)
class Send:
    """Post the send of message `key` to pipeline rank `peer`."""

    key: MessageKey
    peer: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class Recv:
    """Post the receive of message `key` from pipeline rank `peer`."""

    key: MessageKey
    peer: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class Wait:
    """Block until the posted operations of these messages have completed."""

    keys: tuple[MessageKey, ...]


Instruction = Forward | Backward | BackwardWeight | ReduceGrads | Send | Recv | Wait
ComputeInstruction = Forward | Backward
CommInstruction = Send | Recv
INSTRUCTION_TYPES: tuple[type, ...] = (
    Forward,
    Backward,
    BackwardInput,
    BackwardWeight,
    ReduceGrads,
    Send,
    Recv,
    Wait,
)


@dataclass(frozen=True)
class Program:
    """The ordered instructions of one pipeline rank."""

    rank: int
    instructions: tuple[Instruction, ...]

    def __len__(self) -> int:
        return len(self.instructions)

    def compute(self) -> list[ComputeInstruction]:
        """The compute instructions in program order."""
        return [i for i in self.instructions if isinstance(i, (Forward, Backward))]


# ---------------------------------------------------------------------------------------------
# Placement


@dataclass(frozen=True)
class ChunkSpec:
    """Layers [layer_start, layer_end) of a module, living on pipeline rank `rank`.

    Chunk 0 also holds the module's input layers (patch/token embedding, timestep embedding),
    the module's last chunk its output layers (projector, final norm, output head, loss).
    """

    module: str
    index: int
    rank: int
    layer_start: int
    layer_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class ModuleLayout:
    """How one modality module is cut into chunks and where the chunks live."""

    name: str
    num_layers: int
    trainable: bool
    chunks: tuple[ChunkSpec, ...]

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError(f"module {self.name!r} has no chunks")
        start = 0
        for i, c in enumerate(self.chunks):
            if c.module != self.name or c.index != i:
                raise ValueError(f"module {self.name!r}: chunk {i} is named {c.module}{c.index}")
            if c.layer_start != start or c.layer_end < c.layer_start:
                raise ValueError(
                    f"module {self.name!r}: chunk {i} covers layers [{c.layer_start}, "
                    f"{c.layer_end}), expected to start at {start}"
                )
            start = c.layer_end
        if start != self.num_layers:
            raise ValueError(
                f"module {self.name!r}: chunks cover {start} layers, module has {self.num_layers}"
            )

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class Placement:
    """Static placement of every module's chunks on the pipeline ranks."""

    num_ranks: int
    modules: tuple[ModuleLayout, ...]

    def __post_init__(self) -> None:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate module names in placement: {names}")
        for m in self.modules:
            for c in m.chunks:
                if not 0 <= c.rank < self.num_ranks:
                    raise ValueError(
                        f"chunk {m.name}{c.index} on rank {c.rank}, outside 0..{self.num_ranks - 1}"
                    )

    def module(self, name: str) -> ModuleLayout:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module {name!r} in placement (have {[m.name for m in self.modules]})")

    def rank_of(self, module: str, chunk: int) -> int:
        return self.module(module).chunks[chunk].rank

    def chunks_on_rank(self, rank: int) -> list[ChunkSpec]:
        return [c for m in self.modules for c in m.chunks if c.rank == rank]


# ---------------------------------------------------------------------------------------------
# Data description


@dataclass(frozen=True)
class MicrobatchInfo:
    """One microbatch of this replica: which samples it packs and its sequence length."""

    index: int
    sample_ids: tuple[int, ...]
    seq_tokens: int


@dataclass(frozen=True)
class SubMicrobatch:
    """Instances [instance_start, instance_end) of `module` in microbatch `microbatch`.

    Instances are images/clips for vision and diffusion modules, sequences/captions for text
    modules, counted in the order the data side lists them in the microbatch. `tokens` is the
    real token (or patch) count, `padded_tokens` what the runtime computes on (e.g. rounded up to
    a multiple of the tensor-parallel size under sequence parallelism). `attention_pairs` is the
    sum of squared lengths of the attention segments (documents of a packed sequence, single
    images in a ViT), 0 meaning instances of equal length; it drives attention's quadratic cost.

    Optional (0: none, or not known, e.g. plans written before they existed): `input_tokens`,
    the rows of the producers' hand-overs its first chunk receives (an LLM's image/audio
    embeddings, a DiT's caption encodings); `context_tokens`, the tokens its instances
    cross-attend to (a DiT sub-microbatch: its own clips' captions); `context_pairs`, the sum
    over its instances of instance tokens x context tokens (the cross-attention's work).
    """

    module: str
    microbatch: int
    index: int
    instance_start: int
    instance_end: int
    tokens: int
    padded_tokens: int
    attention_pairs: int = 0
    input_tokens: int = 0
    context_tokens: int = 0
    context_pairs: int = 0

    @property
    def work(self) -> WorkId:
        return WorkId(self.module, self.microbatch, self.index)

    @property
    def num_instances(self) -> int:
        return self.instance_end - self.instance_start


@dataclass(frozen=True, order=True)
class Dependency:
    """`producer`'s output (after its module's last chunk) is an input of `consumer`'s first
    chunk: vision embeddings scattered into an LLM microbatch, a text encoding conditioning a DiT
    sub-microbatch. The gradient flows back the same way when the producer is trainable."""

    producer: WorkId
    consumer: WorkId


@dataclass(frozen=True)
class BatchTotals:
    """Denominators of the whole global batch (all data-parallel replicas), so that unequal
    sub-microbatches and replicas still produce exactly the gradient of the global mean loss."""

    num_microbatches: int  # microbatches of the whole global batch
    num_samples: int
    num_loss_tokens: int  # tokens that carry a loss (LLM labels; DiT latent tokens)
    data_parallel_size: int = 1


@dataclass(frozen=True)
class Plan:
    """Programs of all pipeline ranks of one data-parallel replica for one iteration."""

    iteration: int
    placement: Placement
    microbatches: tuple[MicrobatchInfo, ...]
    submicrobatches: tuple[SubMicrobatch, ...]
    dependencies: tuple[Dependency, ...]
    totals: BatchTotals
    programs: tuple[Program, ...]
    replica: int = 0
    forward_only: bool = False
    name: str = "custom"
    # The streams its programs were posted for (module docstring); `PER_PEER` plans may
    # deadlock on one stream, so the runtime refuses them on a transport without ChannelGroups.
    channels: Channels = Channels.SINGLE
    version: int = FORMAT_VERSION
    _sub_index: dict = field(default=None, compare=False, repr=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if len(self.programs) != self.placement.num_ranks:
            raise ValueError(
                f"plan has {len(self.programs)} programs for {self.placement.num_ranks} ranks"
            )
        for r, p in enumerate(self.programs):
            if p.rank != r:
                raise ValueError(f"program {r} is labelled rank {p.rank}")
        index = {s.work: s for s in self.submicrobatches}
        if len(index) != len(self.submicrobatches):
            raise ValueError("duplicate sub-microbatch in plan")
        object.__setattr__(self, "_sub_index", index)

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def submicrobatch(self, work: WorkId) -> SubMicrobatch:
        try:
            return self._sub_index[work]
        except KeyError:
            raise KeyError(f"plan has no sub-microbatch {work}") from None

    def program(self, rank: int) -> Program:
        return self.programs[rank]
