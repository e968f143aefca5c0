"""The chunk interface the runtime calls, and the factory that builds a chunk.

A `ModelChunk` is layers [layer_start, layer_end) of one modality module, plus the module's
input layers on chunk 0 and its output layers on the last chunk. It is a Megatron
`MegatronModule` (so Megatron's DDP wrapper and optimizers accept it) whose `config` is the
module's `TransformerConfig`. What the layers are and what the chunk computes comes from the
module's modality (`parts`: a `megatron_dip.modalities.Modality`, found by
`modalities.build_chunk`); this class only drives it. Forward contract, for one sub-microbatch:

    outputs = chunk(inputs=[...], batch=sub_batch)

* `inputs`: chunk 0 — one dict per producer sub-microbatch message, in producer order
  (a scatter producer's "<module>.embeddings" for the LLM, text "cond"/"cond_index" for the
  DiT; [] when the module has no producer or the microbatch has none of its instances);
  chunk > 0 — exactly one dict, the previous chunk's message.
* `batch`: the `SubBatch` of this sub-microbatch (`Modality.build_sub_batch`).
* returns: a non-last chunk its message for the next chunk (names and shapes of
  `batching.message_tensors`); the last chunk of the loss module {"loss": summed loss over the
  sub-microbatch's loss tokens (not averaged), "num_tokens": int64 count}; the last chunk of a
  producer module the tensors handed to its consumer.

Sequence parallelism (where the run's `ParallelShape` has it in effect: --sequence-parallel
with TP > 1; `build_chunk(shape=...)`): the hidden states inside
and between the chunks of a module are this rank's contiguous shard of the sequence,
[padded_tokens / TP, 1, hidden] (`batching.message_tensors`); chunk 0 scatters its embeddings
(Megatron's `scatter_to_sequence_parallel_region`), the last chunk gathers the sequence after
its final norm for the loss or the hand-over, and Megatron's layers all-gather / reduce-scatter
around attention and MLP. Packed-sequence parameters and rotary tables stay full-length
(attention runs on the gathered sequence, `attention.py`). Everything else — hand-overs, DiT
"temb" / "cond" / "cond_index" — is replicated across the tensor-parallel ranks with complete,
identical gradients. Parameters that see only a shard (norms, row-parallel biases) carry
`sequence_parallel = True`; their gradients are summed over the TP group once per iteration by
the runtime (`runtime.ddp.reduce_sequence_parallel_grads`). Sequence lengths must divide by TP
(the planner pads sub-microbatches to a multiple of it; the LLM's seq_length must be one).

Backward is plain autograd: the runtime calls `torch.autograd.backward` on the returned
floating-point tensors with the gradient message (same names), and reads `.grad` of the
received input tensors it marked `requires_grad`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from megatron_dip import megatron_compat
from megatron_dip.cpu_support import apply_cpu_fixes
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.parallel import ParallelShape
from megatron_dip.schedule.ir import ChunkSpec

from . import attention
from .batch import SubBatch
from .common import (
    ModelGroups,
    gather_sequence,
    mark_tensor_parallel_weights,
    scatter_sequence,
    sequence_parallel_backend,
    torch_dtype,
    transformer_config,
)
from .config import ModelConfig
from .init import init_chunk_parameters
from .sharded import chunk_sharded_state_dict

logger = logging.getLogger(__name__)

__all__ = ["ModelChunk", "ModelGroups", "build_chunk", "build_module_chunks"]


class ModelChunk(MegatronModule):
    """Layers [chunk.layer_start, chunk.layer_end) of one module (see the module docstring).

    Attributes: `chunk` (ChunkSpec), `module_spec` (ModuleSpec), `model_spec`, `num_chunks`,
    `model_config` (ModelConfig), `shape` (the run's ParallelShape: TP size and whether sequence
    parallelism is in effect), `groups` (ModelGroups), `parts` (the modality that builds and
    runs it), `pre` / `layers` / `post` (input layers, transformer layers, output layers; `pre`
    and `post` are None where absent).
    """

    def __init__(
        self,
        *,
        model: MultimodalSpec,
        chunk: ChunkSpec,
        num_chunks: int,
        config: ModelConfig,
        shape: ParallelShape,
        groups: ModelGroups,
        parts,
    ) -> None:
        module_spec = model.module(chunk.module)
        style = parts.layer_style(module_spec)
        super().__init__(config=transformer_config(module_spec, config, shape=shape, style=style))
        # Megatron's stock schedules and DDP read model_type from every model chunk.
        self.model_type = ModelType.encoder_or_decoder
        self.model_spec = model
        self.module_spec = module_spec
        self.chunk = chunk
        self.num_chunks = num_chunks
        self.model_config = config
        self.shape = shape
        self.groups = groups
        self.parts = parts
        self.message_names = parts.message_names
        backend = megatron_compat.layer_backend(megatron_compat.resolve_use_te(config.use_te))
        self.backend = sequence_parallel_backend(
            attention.packed_backend(backend, kernel=config.attention), self.config
        )
        self.global_aliases: dict[str, str] = {}
        self.layers = parts.build_layers(self)
        self.pre = parts.build_pre(self) if self.is_first else None
        self.post = parts.build_post(self) if self.is_last else None

    # -- structure -------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.chunk.index == 0

    @property
    def is_last(self) -> bool:
        return self.chunk.index == self.num_chunks - 1

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.model_config.dtype)

    @property
    def device(self) -> torch.device:
        return torch.device(torch.cuda.current_device())

    def zero_init_prefixes(self) -> tuple[str, ...]:
        """Local parameter-name prefixes initialised to zero (DiT adaLN-Zero)."""
        return self.parts.zero_init_prefixes(self)

    @property
    def sequence_parallel(self) -> bool:
        """Whether activations are sharded along the sequence over the tensor-parallel group."""
        return self.shape.sequence_parallel

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Chunk 0: this rank's sequence shard of the embeddings (identity without SP)."""
        return scatter_sequence(x, self.config, self.groups)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Last chunk: the full sequence for the loss / hand-over (identity without SP)."""
        return gather_sequence(x, self.config, self.groups)

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self, *, inputs: Sequence[Mapping[str, torch.Tensor]], batch: SubBatch
    ) -> dict[str, torch.Tensor]:
        """Run this chunk on one sub-microbatch (contract in the module docstring)."""
        if batch.sub.module != self.chunk.module:
            raise ValueError(f"{self.chunk.module} chunk got a batch of {batch.sub.work}")
        batch = batch.to(self.device)
        if self.is_first:
            state = self.parts.embed(self, inputs, batch)
        else:
            if len(inputs) != 1:
                raise ValueError(
                    f"{self.chunk.module} chunk {self.chunk.index} takes one message, "
                    f"got {len(inputs)}"
                )
            state = dict(inputs[0])
        state["hidden"] = self.parts.run_layers(self, state, batch)
        if self.is_last:
            return self.parts.finish(self, state, batch)
        return {name: state[name] for name in self.message_names}

    def tied_embedding_weight(self) -> torch.nn.Parameter | None:
        """This chunk's copy of a tied LLM embedding that needs reducing (None otherwise)."""
        return self.parts.tied_embedding_weight(self)

    # -- checkpoints -----------------------------------------------------------------------
    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The parameters as Megatron-Core `dist_checkpointing` ShardedTensors keyed by global
        parameter name, with global shapes and offsets (`models.sharded`), so a checkpoint does
        not depend on the placement or TP. `metadata["dp_cp_group"]` (Megatron's key): the
        data-parallel group, whose rank is the weights' replica id (0 without it). Views of
        the parameters: `dist_checkpointing.load` fills them in place."""
        if sharded_offsets:
            raise ValueError(
                "ModelChunk.sharded_state_dict: chunks are keyed by global layer index "
                f"(no sharded_offsets), got {sharded_offsets}"
            )
        group = (metadata or {}).get("dp_cp_group")
        dp_rank = group.rank() if group is not None else 0
        return chunk_sharded_state_dict(self, prefix=prefix, data_parallel_rank=dp_rank)


def build_chunk(
    model: MultimodalSpec,
    chunk: ChunkSpec,
    *,
    num_chunks: int,
    config: ModelConfig,
    groups: ModelGroups,
    parts,
    shape: ParallelShape | None = None,
    skip_init=None,
) -> ModelChunk:
    """Build one chunk (call only on the rank that owns it) with deterministic weights;
    `skip_init(global name)` true: left uninitialised (an importer fills those).

    `shape`: the run's parallel shape, whose TP size must be the size of `groups.tp` (None: that
    size, without sequence parallelism).

    `parts` is the module's modality (`modalities.build_chunk` passes it). `num_chunks` is the
    module's chunk count (the last chunk holds the output layers). Applies
    the CPU fixes when CUDA is absent and creates Megatron's attention scratch buffer if
    `initialize_model_parallel` has not. A frozen module's parameters get requires_grad False.
    """
    module_spec = model.module(chunk.module)
    if not 0 <= chunk.index < num_chunks:
        raise ValueError(f"chunk index {chunk.index} outside 0..{num_chunks - 1}")
    if not 0 <= chunk.layer_start <= chunk.layer_end <= module_spec.num_layers:
        raise ValueError(
            f"chunk {chunk.module}{chunk.index} layers [{chunk.layer_start}, {chunk.layer_end}) "
            f"outside the module's {module_spec.num_layers} layers"
        )
    apply_cpu_fixes()
    megatron_compat.ensure_global_memory_buffer()
    built = ModelChunk(
        model=model,
        chunk=chunk,
        num_chunks=num_chunks,
        config=config,
        shape=_checked_shape(shape, groups),
        groups=groups,
        parts=parts,
    )
    built.to(device=built.device, dtype=built.dtype)
    mark_tensor_parallel_weights(built)
    init_chunk_parameters(built, skip=skip_init)
    if not module_spec.trainable:
        built.requires_grad_(False)
    logger.debug(
        "built %s chunk %d layers [%d, %d)",
        chunk.module,
        chunk.index,
        chunk.layer_start,
        chunk.layer_end,
    )
    return built


def _checked_shape(shape: ParallelShape | None, groups: ModelGroups) -> ParallelShape:
    """`shape`, or the shape of `groups` without sequence parallelism; ValueError when the
    shape's TP size is not the tensor-parallel group's."""
    if shape is None:
        return ParallelShape(tp=groups.tp_size)
    if shape.tp != groups.tp_size:
        raise ValueError(
            f"the parallel shape has TP={shape.tp}, the chunk's tensor-parallel group "
            f"{groups.tp_size} ranks"
        )
    return shape


def build_module_chunks(
    model: MultimodalSpec,
    module: str,
    ranges: Sequence[tuple[int, int]],
    *,
    config: ModelConfig,
    groups: ModelGroups,
    parts,
    shape: ParallelShape | None = None,
) -> list[ModelChunk]:
    """All chunks of one module in this process, cut at `ranges` ((start, end) per chunk)."""
    return [
        build_chunk(
            model,
            ChunkSpec(module, i, 0, start, end),
            num_chunks=len(ranges),
            config=config,
            groups=groups,
            parts=parts,
            shape=shape,
        )
        for i, (start, end) in enumerate(ranges)
    ]


def reduce_tied_embedding_grads(
    chunks: Sequence[ModelChunk], *, group: torch.distributed.ProcessGroup
) -> None:
    """Sum the gradients of tied LLM embedding copies: locally, then over `group`.

    Call on every rank of `group` (the ranks holding the LLM's first and last chunks) after the
    backward of the iteration, before the optimizer step. Uses `main_grad` when a Megatron DDP
    wrapper added it.
    """
    copies = [w for c in chunks if (w := c.tied_embedding_weight()) is not None]
    if not copies:
        return

    def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
        return getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad

    total = torch.zeros_like(copies[0], dtype=torch.promote_types(copies[0].dtype, torch.float32))
    for p in copies:
        g = grad_of(p)
        if g is not None:
            total += g.to(total.dtype)
    torch.distributed.all_reduce(total, group=group)
    for p in copies:
        g = grad_of(p)
        if g is None:
            p.grad = total.to(p.dtype)
        else:
            g.copy_(total.to(g.dtype))
