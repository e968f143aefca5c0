"""The `Modality` protocol: everything that depends on the kind of a module, behind one class.

A modality kind ("vit", "llm", "text_encoder", "dit", "audio", ...) is one file of this package
holding one subclass of `Modality`, registered by kind (`registry.py`). The rest of the package
asks the registry (`modality_of(spec)`) and calls these methods instead of branching on kinds:

* metadata (torch-free, what the planner sees): what an instance is, the instances of a
  microbatch (`microbatch_instances`), their padding and attention pairs, checks of a
  microbatch, which producer sub-microbatches a consumer needs (`consumes`);
* arrays (torch-free, the data side): the `InstanceCounts` of a sample's arrays and the checks
  of its conventions;
* messages (torch-free): the tensors between two chunks of the module (`chunk_message`) and the
  hand-over to its consumer (`hand_over`);
* loss (loss modules): packing caps, loss tokens of a sample and of a sub-microbatch;
* costs (torch-free): the operators of one layer and of the input/output layers, stored
  activations, parameter counts, the profile grid;
* torch parts, imported lazily inside the methods: the chunk's layers and its forward
  (`build_pre/build_layers/build_post`, `embed`, `run_layers`, `finish`, driven by the generic
  `models.chunk.ModelChunk`), and the sub-batch builder (`build_sub_batch`).

Conventions shared by every modality (micro batch size 1, packed; Megatron's [seq, batch,
hidden]): instances of a module in a microbatch are listed sample by sample, in data order. A
module whose instances are not text ("media": images, clips, audio segments) reads them from
`SampleMeta.instances_of(module)`; the text modules read `SampleMeta.text_tokens`. A producer
that scatters into its consumer's sequence ("scatter producer": ViT, audio encoder) owns a
placeholder token id (`ModuleSpec.placeholder_id`): each of its instances occupies a run of
placeholders as long as its `placeholders` count, and its hand-over is one tensor named
`scatter_name(spec)` with one row per placeholder (`scatter.ScatterProducer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch, TensorSpec, WorkId

from .costs import CostContext, Op, Work, activation_op, mlp_ops, norm_op, self_attention_ops
from .stored import Stored, norm_stored, recompute_saved, transformer_layer_stored

INDEX_DTYPE = "int64"


@dataclass(frozen=True)
class InstanceCounts:
    """What the planner may see of one module's instances in one sample, in order.

    `tokens[i]`: tokens of instance i inside its module (ViT patches, DiT latent tokens, audio
    encoder tokens). `placeholders[i]`: tokens it occupies in its consumer's sequence (a scatter
    producer's placeholder run; empty otherwise). `frames[i]`: its duration units (latent frames
    of a clip, which text-to-video packing budgets; empty otherwise).
    """

    tokens: tuple[int, ...] = ()
    placeholders: tuple[int, ...] = ()
    frames: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tokens", "placeholders", "frames"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        for name in ("placeholders", "frames"):
            values = getattr(self, name)
            if values and len(values) != len(self.tokens):
                raise ValueError(f"{len(values)} {name} for {len(self.tokens)} instances")

    def __len__(self) -> int:
        return len(self.tokens)


class SampleInfo(Protocol):
    """What modalities read of a sample's metadata (`data.sample.SampleMeta`)."""

    sample_id: int
    text_tokens: int

    def instances_of(self, module: str) -> InstanceCounts: ...


class SampleArrays(Protocol):
    """What modalities read of a sample with arrays (`data.sample.Sample`)."""

    sample_id: int
    text: np.ndarray
    media: Mapping[str, Sequence[np.ndarray]]
    labels_mask: np.ndarray | None


@dataclass(frozen=True)
class Instance:
    """One instance of a module inside a microbatch: owning sample and token count."""

    sample_index: int  # position of the sample inside the microbatch (-1: all of them)
    tokens: int


SubLookup = Callable[[WorkId], SubMicrobatch]


def instances_overlap(a: SubMicrobatch, b: SubMicrobatch) -> bool:
    """Whether two sub-microbatches of one microbatch share an instance index."""
    return a.instance_start < b.instance_end and b.instance_start < a.instance_end


class Modality:
    """The behaviour of one module kind (module docstring). Subclasses set the class attributes
    and override what differs from these defaults, which describe a bidirectional encoder over
    media instances (LayerNorm, biases, GELU) that hands its output to a consumer."""

    kind: ClassVar[str] = ""
    instance: ClassVar[str] = "instance"  # what one instance is, for messages
    reads_text: ClassVar[bool] = False  # instances come from the text (LLM, text encoder)
    whole_microbatch: ClassVar[bool] = False  # one sub-microbatch per microbatch (LLM)
    causal: ClassVar[bool] = False
    rotary: ClassVar[bool] = True  # rotary position embeddings in the attention
    cross_attends: ClassVar[bool] = False  # to a context (`SubMicrobatch.context_tokens`)
    rotary_axes: ClassVar[int] = 1
    normalization: ClassVar[str] = "LayerNorm"
    linear_bias: ClassVar[bool] = True
    tp_blocks: ClassVar[int] = 2  # parallel blocks per layer (one TP all-reduce each)
    message_names: ClassVar[tuple[str, ...]] = ("hidden",)

    # -- the spec -------------------------------------------------------------------------

    def check_spec(self, spec: ModuleSpec, model: MultimodalSpec) -> None:
        """Raise ValueError naming the module when `spec` lacks what this kind needs."""
        del spec, model

    def norm_of(self, spec: ModuleSpec) -> str:
        """The norm of the module's layers: the spec's (`Architecture.normalization`), else
        this kind's default."""
        return spec.arch.normalization or self.normalization

    def activation(self, spec: ModuleSpec) -> str:
        """The MLP activation: the spec's (`Architecture.activation`), else "silu" (SwiGLU) for
        gated MLPs and "gelu" for the others."""
        if spec.arch.activation is not None:
            return spec.arch.activation
        return "silu" if spec.layer.gated_mlp else "gelu"

    # -- metadata -------------------------------------------------------------------------

    def sample_instances(self, spec: ModuleSpec, meta: SampleInfo) -> InstanceCounts:
        """The module's instances in one sample's metadata."""
        return meta.instances_of(spec.name)

    def microbatch_instances(
        self, spec: ModuleSpec, samples: Sequence[SampleInfo], *, seq_length: int
    ) -> list[Instance]:
        """The instances the module computes on for one microbatch, in data order."""
        del seq_length
        return [
            Instance(i, t)
            for i, s in enumerate(samples)
            for t in self.sample_instances(spec, s).tokens
        ]

    def module_tokens(self, spec: ModuleSpec, meta: SampleInfo) -> tuple[int, int]:
        """(tokens, instances) of one sample in this module (per-sample cost, throughput)."""
        counts = self.sample_instances(spec, meta)
        return sum(counts.tokens), len(counts)

    def padded_tokens(self, spec: ModuleSpec, tokens: int, *, seq_length: int) -> int:
        """Tokens the runtime computes on for a sub-microbatch of `tokens` real tokens, before
        rounding to the sequence-parallel multiple."""
        del spec, seq_length
        return tokens

    def attention_pairs(
        self,
        spec: ModuleSpec,
        samples: Sequence[SampleInfo],
        items: Sequence[Instance],
        *,
        seq_length: int,
    ) -> int:
        """Sum of squared attention segment lengths of a sub-microbatch holding `items`."""
        del spec, samples, seq_length
        return sum(i.tokens * i.tokens for i in items)

    def context(
        self, spec: ModuleSpec, samples: Sequence[SampleInfo], items: Sequence[Instance]
    ) -> tuple[int, int]:
        """(context tokens, context pairs) of a sub-microbatch holding `items`: the tokens its
        instances cross-attend to and the sum of instance tokens x context tokens (none here;
        `SubMicrobatch.context_tokens`)."""
        del spec, samples, items
        return 0, 0

    def check_microbatch(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleInfo],
        *,
        index: int,
        seq_length: int,
        pad: int,
    ) -> None:
        """Raise ValueError for a microbatch this module cannot represent."""
        del spec, model, samples, index, seq_length, pad

    def consumes(self, producer: SubMicrobatch, consumer: SubMicrobatch) -> bool:
        """Whether consumer sub-microbatch `consumer` (of this module) needs the output of
        producer sub-microbatch `producer` (same microbatch). Default: all of them."""
        del producer, consumer
        return True

    # -- arrays (the data side) ---------------------------------------------------------------

    def instance_counts(
        self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays
    ) -> InstanceCounts | None:
        """The `InstanceCounts` of `sample`'s arrays for a media module (None: text module).
        Raises ValueError when the arrays break this modality's conventions."""
        del spec, model, sample
        return None

    def check_sample(self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays) -> None:
        """Raise ValueError when the sample's text breaks this modality's conventions."""
        del spec, model, sample

    # -- messages -----------------------------------------------------------------------------

    def chunk_message(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        sub: SubMicrobatch,
        sub_lookup: SubLookup,
        *,
        dtype: str,
        seq: Callable[[int], int],
    ) -> list[TensorSpec]:
        """The tensors between two consecutive chunks of the module for `sub` (`seq` divides a
        token count by the tensor-parallel size under sequence parallelism)."""
        del model, sub_lookup
        return [TensorSpec("hidden", (seq(sub.padded_tokens), 1, spec.layer.hidden), dtype)]

    def hand_over(self, spec: ModuleSpec, sub: SubMicrobatch, *, dtype: str) -> list[TensorSpec]:
        """The tensors the module's last chunk hands to its consumer's first chunk."""
        del sub, dtype
        raise ValueError(f"module {spec.name!r} ({spec.kind}) hands nothing over")

    def hand_over_rows(self, spec: ModuleSpec, sub: SubMicrobatch) -> int:
        """Rows (tokens) of the hand-over's main tensor, its first (`SubMicrobatch.input_tokens`
        of the consumer)."""
        return self.hand_over(spec, sub, dtype="float32")[0].shape[0]

    # -- loss (the module that feeds nobody) ----------------------------------------------------

    def packing_caps(self, spec: ModuleSpec, *, seq_length: int) -> dict[str, int | None]:
        """`data.packing.PackingLimits` fields of a microbatch when this module computes the
        loss."""
        del spec
        return {"seq_length": seq_length}

    def sample_loss_tokens(
        self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays
    ) -> int:
        """Tokens of `sample` that carry a loss, as the loss chunk counts them."""
        raise ValueError(f"module {spec.name!r} ({spec.kind}) computes no loss")

    def microbatch_loss_tokens(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleArrays],
        sub: SubMicrobatch,
    ) -> int:
        """Loss tokens of sub-microbatch `sub` of a microbatch made of `samples`."""
        chosen = samples[sub.instance_start : sub.instance_end]
        return sum(self.sample_loss_tokens(spec, model, s) for s in chosen)

    # -- costs ----------------------------------------------------------------------------------

    def layer_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        """Forward operators of one transformer layer on `w`."""
        return self_attention_ops(spec.layer, w, c, causal=self.causal) + mlp_ops(spec.layer, w, c)

    def layer_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> Stored:
        """What one layer keeps for backward (`stored.py`)."""
        rms = self.norm_of(spec) == "RMSNorm"
        return transformer_layer_stored(spec.layer, w, c, rms=rms, rotary=self.rotary)

    # The layer's pre-norms (`runtime.module_recompute` wraps a layer's direct children that
    # are norms): two in a standard layer.
    norms_per_layer: ClassVar[int] = 2

    def recompute_saved(self, spec: ModuleSpec, w: Work, c: CostContext, module: str) -> Stored:
        """What one layer keeps less when `module` (`schedule.ir.RECOMPUTE_MODULES`) is
        recomputed in backward (`stored.recompute_saved`, per pre-norm for "layernorm")."""
        del w
        rms = self.norm_of(spec) == "RMSNorm"
        saved = recompute_saved(spec.layer, c, module, rms=rms)
        if module == "layernorm":
            per_norm = norm_stored(spec.layer.hidden, c, rms=rms)
            for _ in range(self.norms_per_layer - 2):
                saved += per_norm
        return saved

    def recompute_ops(self, spec: ModuleSpec, w: Work, c: CostContext, module: str) -> list[Op]:
        """Forward operators the backward runs again when `module` is recomputed: the layer's
        norms or its MLP activation (memory-bound element-wise passes, `costs.norm_op`,
        `costs.activation_op`, as the layer's own forward prices them)."""
        if module == "layernorm":
            return [norm_op(spec.layer, w, c)] * self.norms_per_layer
        return [activation_op(spec.layer, w, c)]

    def input_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        """Forward operators of the input layers (charged to the first chunk)."""
        del spec, w, c
        return []

    def output_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        """Forward operators of the output layers (charged to the last chunk)."""
        del spec, w, c
        return []

    def input_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        """Bytes the input layers keep for backward beyond the input data (none here: the
        embedding of token ids or patches keeps only its input, the sub-microbatch's data)."""
        del spec, w, c
        return 0.0

    def chunk_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        """Bytes every chunk keeps once, shared by all its layers (none here)."""
        del spec, w, c
        return 0.0

    def output_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        """Bytes the output layers keep for backward: the final norm's."""
        rms = self.norm_of(spec) == "RMSNorm"
        return norm_stored(spec.layer.hidden, c, rms=rms).nbytes(spec.layer.hidden, w, c)

    def received_bytes(self, spec: ModuleSpec, w: Work, c: CostContext, *, first: bool) -> float:
        """Bytes of the messages a chunk receives and keeps until its backward (what full
        recomputation keeps): the producers' hand-overs (`w.input_tokens` rows of this
        module's hidden width) for the first chunk, the previous chunk's hidden states else."""
        if first:
            return c.dt * w.input_tokens * spec.layer.hidden
        return c.dt * w.tokens * spec.layer.hidden / c.rep

    def layer_params(self, spec: ModuleSpec) -> int:
        """Parameters of one transformer layer (all TP ranks together)."""
        lay = spec.layer
        h, q, kv = lay.hidden, lay.attention_width, 2 * lay.kv_groups * lay.head_dim
        qkv_bias = (q + kv) if spec.arch.qkv_bias and not self.linear_bias else 0
        qk_norm = 2 * lay.head_dim if spec.arch.qk_norm else 0
        mlp = h * lay.ffn * (3 if lay.gated_mlp else 2)
        return h * (q + kv) + q * h + mlp + 2 * h + qkv_bias + qk_norm

    def input_params(self, spec: ModuleSpec) -> int:
        """Parameters of the input layers."""
        del spec
        return 0

    def output_params(self, spec: ModuleSpec) -> int:
        """Parameters of the output layers (the final norm included)."""
        return spec.layer.hidden

    def profile_grid(self, spec: ModuleSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(tokens per instance, instances per sub-microbatch) worth profiling."""
        del spec
        return (256, 1024, 2704, 4096), (1, 2, 4, 8, 12, 16)

    # -- torch parts (imported lazily; `chunk` is a `models.chunk.ModelChunk`) --------------------

    def layer_style(self, spec: ModuleSpec):
        """`models.common.LayerStyle` of the module's transformer layers."""
        from megatron_dip.models.common import LayerStyle

        return LayerStyle(
            normalization=self.norm_of(spec),
            bias=self.linear_bias,
            activation=self.activation(spec),
        )

    def is_causal(self, chunk) -> bool:
        """Whether the module's self-attention is causal within each segment."""
        del chunk
        return self.causal

    def layer_stack(
        self, spec: ModuleSpec, *, tconfig, backend, groups, start: int, end: int, causal: bool
    ):
        """Megatron layers for global layers [start, end) (chunks and the profiler)."""
        from megatron_dip.models.common import (
            build_transformer_layers,
            gpt_layer_spec,
            mark_qk_norm_weights,
        )

        qk_norm = spec.arch.qk_norm
        layer_spec = gpt_layer_spec(self.norm_of(spec), backend, causal=causal, qk_norm=qk_norm)
        layers = build_transformer_layers(
            spec=layer_spec, config=tconfig, groups=groups, start=start, end=end
        )
        if qk_norm:
            mark_qk_norm_weights(layers)
        return layers

    def run_stack(self, spec: ModuleSpec, layers, state: dict, batch, *, rotary_base: float):
        """`layers` on state["hidden"] over the packed sequence of `batch` (every instance its
        own attention segment, `models.attention`) with this modality's rotary tables (its
        `Architecture`: scaling, layout, M-RoPE; `models.rope.rotary_of`); the packed-sequence
        parameters and tables are cached in the batch, shared by all chunks of the
        sub-microbatch."""
        from megatron_dip.models.common import cached
        from megatron_dip.models.rope import rotary_of

        dtype = state["hidden"].dtype
        head_dim = spec.layer.head_dim
        # Learned absolute positions (CLIP, SigLIP) are added to the embeddings: no rotary.
        rotary = None
        if not spec.arch.learned_positions:
            rotary = cached(
                batch,
                ("rotary", head_dim, rotary_base, spec.arch, dtype),
                lambda: rotary_of(
                    spec.arch, batch.positions, head_dim=head_dim, base=rotary_base, dtype=dtype
                ),
            )
        hidden = state["hidden"]
        for layer in layers:
            members = getattr(layer, "members", None)  # recompute's group of layers
            if members is None:
                packed = self.layer_attention(spec, layer.layer_number - 1, batch)
                hidden, _ = layer(hidden, rotary_pos_emb=rotary, **packed)
            else:
                own = [self.layer_attention(spec, m.layer_number - 1, batch) for m in members]
                hidden, _ = layer(hidden, rotary_pos_emb=rotary, member_kwargs=own)
        return hidden

    def layer_attention(self, spec: ModuleSpec, layer: int, batch) -> dict:
        """The packed-sequence keyword arguments of global layer `layer`'s self-attention:
        every instance its own segment (`models.attention`), cached in the batch."""
        from megatron_dip.models import attention
        from megatron_dip.models.common import cached

        del spec, layer
        return cached(
            batch, ("attention",), lambda: attention.self_attention_kwargs(batch.segments)
        )

    def build_layers(self, chunk):
        """The chunk's transformer layers."""
        c = chunk.chunk
        return self.layer_stack(
            chunk.module_spec,
            tconfig=chunk.config,
            backend=chunk.backend,
            groups=chunk.groups,
            start=c.layer_start,
            end=c.layer_end,
            causal=self.is_causal(chunk),
        )

    def build_pre(self, chunk):
        """Input layers of chunk 0 (None: none)."""
        del chunk

    def build_post(self, chunk):
        """Output layers of the last chunk (None: none)."""
        del chunk

    def embed(self, chunk, inputs: Sequence[Mapping[str, Any]], batch) -> dict:
        """Chunk 0: the message state (at least "hidden") from the data and producer inputs."""
        raise NotImplementedError

    def run_layers(self, chunk, state: dict, batch):
        """The chunk's layers on state["hidden"]; returns the new hidden states."""
        return self.run_stack(
            chunk.module_spec,
            chunk.layers,
            state,
            batch,
            rotary_base=chunk.module_spec.arch.rotary_base,
        )

    def finish(self, chunk, state: dict, batch) -> dict:
        """Last chunk: output layers; the loss or the hand-over to the consumer."""
        raise NotImplementedError

    def zero_init_prefixes(self, chunk) -> tuple[str, ...]:
        """Local parameter-name prefixes initialised to zero."""
        del chunk
        return ()

    def tied_embedding_weight(self, chunk):
        """This chunk's copy of a tied embedding that needs reducing (None otherwise)."""
        del chunk

    def build_sub_batch(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleArrays],
        sub: SubMicrobatch,
        *,
        seq_length: int,
        seed: int,
    ):
        """The `models.batch.SubBatch` of `sub` from all samples of its microbatch, in order."""
        raise NotImplementedError

    def profile_batch(self, spec: ModuleSpec, *, tokens: int, instances: int, caption: int):
        """(SubBatch, state extras) of a synthetic sub-microbatch of `instances` instances of
        `tokens` tokens, for timing `run_stack` (the profiler)."""
        import torch

        from megatron_dip.models.batch import SubBatch

        del caption
        segments = torch.arange(instances).repeat_interleave(tokens)
        local = torch.arange(tokens).repeat(instances)
        width = max(1, math.isqrt(tokens - 1) + 1)  # a square grid holding `tokens`
        row, col = local // width, local % width
        columns = {1: [local], 2: [row, col], 3: [0 * local, row, col]}
        positions = torch.stack(columns[self.rotary_axes], dim=1)
        sub = SubMicrobatch(spec.name, 0, 0, 0, instances, tokens * instances, tokens * instances)
        return SubBatch(sub=sub, kind=self.kind, segments=segments, positions=positions), {}
