"""Shared pieces of the modality modules: configs, layer building and rotary tables.

Layers are Megatron-Core `TransformerLayer`s (or the DiT layer composed of Megatron-Core
attention and MLP modules) built one by one with an explicit global `layer_number` and a
`TransformerConfig` whose pipeline size is 1: Megatron never learns that the model is
pipelined, so none of its layer-offset, virtual-stage or first/last-stage logic (all read
from `parallel_state`) applies. Process groups are passed explicitly.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch.nn import functional

from megatron_dip import megatron_compat
from megatron_dip.modelspec import ModuleSpec
from megatron_dip.parallel import ParallelShape
from megatron_dip.parallel.groups import layer_collection

from .config import ModelConfig

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name used in plans and configs."""
    return _TORCH_DTYPES[name]


@dataclass(frozen=True)
class ModelGroups:
    """Process groups a chunk uses; nothing is looked up in Megatron's `parallel_state`.

    `tp`: tensor-parallel group (size 1 without tensor parallelism). `cp`: a context-parallel
    group of size 1 (Megatron's rotary code asks for one; context parallelism is not supported),
    e.g. Megatron's context-parallel group with CP=1, or the world group of a 1-process run.
    `embedding`: the group over which tied input/output embeddings of the LLM are summed (the
    ranks holding its first and last chunks); None when embeddings are untied.
    """

    tp: torch.distributed.ProcessGroup
    cp: torch.distributed.ProcessGroup
    embedding: torch.distributed.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.cp.size() != 1:
            raise ValueError(
                "context parallelism is not supported: ModelGroups.cp must have size 1"
            )

    @property
    def tp_size(self) -> int:
        return self.tp.size()

    @property
    def tp_rank(self) -> int:
        return self.tp.rank()

    def collection(self):
        """A Megatron `ProcessGroupCollection` with only what the layers read
        (`parallel.groups.layer_collection`)."""
        return layer_collection(tp=self.tp, cp=self.cp)


@dataclass(frozen=True)
class LayerStyle:
    """How a module's transformer layers are built (its modality says): the norm, whether the
    linear layers have biases, and the MLP activation ("gelu", "silu" for SwiGLU)."""

    normalization: str = "LayerNorm"
    bias: bool = True
    activation: str = "gelu"

    def __post_init__(self) -> None:
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unsupported normalization {self.normalization!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the GELU approximation of CLIP and Qwen2-VL's vision tower (the
    formula of Hugging Face's QuickGELUActivation)."""
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (SigLIP's gelu_pytorch_tanh)."""
    return functional.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "gelu": functional.gelu, "gelu_tanh": gelu_tanh, "quick_gelu": quick_gelu,
    "silu": functional.silu,
}  # fmt: skip


class LearnedPositions(torch.nn.Module):
    """A learned absolute position table added to a vision tower's patch embeddings (CLIP,
    SigLIP), and CLIP's class embedding, which takes the rows marked as class tokens."""

    def __init__(self, rows: int, hidden: int, *, class_token: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, hidden, dtype=dtype))
        self.class_embedding = None
        if class_token:
            self.class_embedding = torch.nn.Parameter(torch.empty(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor, index: torch.Tensor, class_rows: torch.Tensor):
        """x [T, hidden] with the class embedding at `class_rows`, plus row `index` [T]."""
        if self.class_embedding is not None:
            x = torch.where(class_rows[:, None], self.class_embedding.to(x.dtype), x)
        return x + self.weight[index]


def carried_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """How a carried tensor (`Architecture.carried`) is held: as it is up to 2-D, else with
    its trailing dims flattened (what `hf.weights` reads and writes back)."""
    if len(shape) <= 2:
        return tuple(shape)
    return (shape[0], math.prod(shape[1:]))


def carried_parameters(carried, *, dtype: torch.dtype) -> torch.nn.ParameterList:
    """Frozen parameters holding a module's carried Hugging Face tensors, in order (the
    checkpoints keep them; no optimizer or gradient sees them)."""
    return torch.nn.ParameterList(
        torch.nn.Parameter(torch.empty(carried_shape(shape), dtype=dtype), requires_grad=False)
        for _, shape in carried
    )


class Parts(torch.nn.Module):
    """A named bag of submodules (the `pre` / `post` parts of a chunk)."""

    def __init__(self, **modules: torch.nn.Module | None) -> None:
        super().__init__()
        for name, module in modules.items():
            if module is not None:
                self.add_module(name, module)


def transformer_config(
    module: ModuleSpec, config: ModelConfig, *, shape: ParallelShape, style: LayerStyle
):
    """Megatron `TransformerConfig` of one module's layers (pipeline size 1, no dropout).

    Its tensor-parallel size and `sequence_parallel` are `shape`'s (sequence parallelism only
    where the shape says it is in effect: asked for and TP > 1). Dropout is off because a
    random mask would differ between layouts; Megatron's own weight initialisation is skipped
    (`perform_initialization=False`): `init.py` initialises every parameter from its global
    name. With `config.delay_wgrad` and Transformer Engine layers that can, their weight
    GEMMs wait for `backward_dw` (`megatron_compat.delay_weight_gradients`).
    """
    from megatron.core.transformer import TransformerConfig

    layer = module.layer
    dtype = torch_dtype(config.dtype)
    tconfig = TransformerConfig(
        num_layers=module.num_layers,
        hidden_size=layer.hidden,
        ffn_hidden_size=layer.ffn,
        num_attention_heads=layer.heads,
        num_query_groups=layer.kv_groups,
        kv_channels=layer.head_dim,
        normalization=style.normalization,
        layernorm_epsilon=module.arch.norm_eps,
        gated_linear_unit=layer.gated_mlp,
        activation_func=_ACTIVATIONS[style.activation],
        add_bias_linear=style.bias,
        add_qkv_bias=style.bias or module.arch.qkv_bias,
        # Per-head q/k norms (Qwen3): the layer spec builds them; 0.19 refuses a spec with
        # q_layernorm unless the config says so too.
        qk_layernorm=module.arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        tensor_model_parallel_size=shape.tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=shape.sequence_parallel,
        perform_initialization=False,
        use_cpu_initialization=False,
        init_method_std=config.init_std,
        **megatron_compat.quiet_config_defaults(),
    )
    if megatron_compat.te_queues_weight_gradients(config.delay_wgrad, config.use_te):
        megatron_compat.delay_weight_gradients(tconfig)
    return tconfig


def gpt_layer_spec(normalization: str, backend, *, causal: bool, qk_norm: bool = False):
    """Megatron's GPT layer spec (with `normalization`) for packed sequences.

    Self-attention takes Megatron's packed-sequence mask type (`padding_causal` when `causal`,
    else `padding`): every layer runs on `PackedSeqParams` (`models.attention`), never on a
    dense mask. The core attention is the backend's (`attention.packed_backend` replaces the
    local one, which refuses packed sequences). When the backend's norm is
    `SequenceParallelNorm` (local layers under sequence parallelism), the spec's unfused norms
    (Megatron's `WrappedTorchNorm`, which refuses sequence parallelism) are replaced by it.
    `qk_norm`: the backend's norm over each query and key head (Megatron's q_layernorm /
    k_layernorm, built by its attention with the head size; `mark_qk_norm_weights`).
    """
    from .attention import mask_type

    spec = copy.deepcopy(backend.gpt_layer_spec(normalization=normalization))
    attention = spec.submodules.self_attention
    attention.params = {**(attention.params or {}), "attn_mask_type": mask_type(causal=causal)}
    attention.submodules.core_attention = backend.core_attention
    if qk_norm:
        attention.submodules.q_layernorm = backend.norm
        attention.submodules.k_layernorm = backend.norm
    if backend.norm is SequenceParallelNorm:
        from megatron.core.transformer.identity_op import IdentityOp

        for name in ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm"):
            if getattr(spec.submodules, name, IdentityOp) is not IdentityOp:
                setattr(spec.submodules, name, SequenceParallelNorm)
    return spec


class SequenceParallelNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (as `config.normalization` says) with Megatron's norm signature.

    A plain torch norm usable under sequence parallelism on CPU and GPU (Megatron's
    `WrappedTorchNorm` refuses it; Transformer Engine's `TENorm` is used instead when TE is
    the backend). Parameter names and maths are those of `torch.nn.LayerNorm` / `RMSNorm`.
    Under sequence parallelism a norm sees only this rank's sequence shard, so its weight
    (and bias) carry Megatron's `sequence_parallel = True`: their gradients must be summed
    over the tensor-parallel group after the backward (`runtime.ddp.reduce_sequence_parallel_grads`,
    Megatron's `_allreduce_layernorm_grads`).
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ) -> None:
        super().__init__()
        del persist_layer_norm, zero_centered_gamma
        self.kind = normalization or config.normalization
        if self.kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"SequenceParallelNorm: unsupported normalization {self.kind!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.hidden_size,)
        if self.kind == "LayerNorm":
            return functional.layer_norm(x, shape, self.weight, self.bias, self.eps)
        return functional.rms_norm(x, shape, self.weight, self.eps)


def sequence_parallel_backend(backend, tconfig):
    """`backend` with `SequenceParallelNorm` as its norm when the local (non-TE) layers run
    under sequence parallelism; unchanged otherwise (TE's norms handle it themselves)."""
    if not tconfig.sequence_parallel or backend.use_te:
        return backend
    import dataclasses

    return dataclasses.replace(backend, norm=SequenceParallelNorm)


def without_sequence_parallel(tconfig):
    """A copy of a `TransformerConfig` with sequence parallelism off (for layers whose input is
    replicated across tensor-parallel ranks, e.g. the DiT's cross-attention key/value
    projection of "cond" and the ViT merger); `tconfig` itself when it is already off."""
    if not tconfig.sequence_parallel:
        return tconfig
    out = copy.copy(tconfig)
    out.sequence_parallel = False
    return out


def scatter_sequence(x: torch.Tensor, tconfig, groups: ModelGroups) -> torch.Tensor:
    """Under sequence parallelism, this rank's shard of `x` along dim 0 (Megatron's
    `scatter_to_sequence_parallel_region`: backward all-gathers); `x` otherwise."""
    if not tconfig.sequence_parallel or groups.tp_size == 1:
        return x
    from megatron.core import tensor_parallel

    return tensor_parallel.scatter_to_sequence_parallel_region(x, group=groups.tp)


def gather_sequence(x: torch.Tensor, tconfig, groups: ModelGroups) -> torch.Tensor:
    """Under sequence parallelism, the whole sequence from every rank's shard along dim 0;
    `x` otherwise. For outputs whose consumers are replicated across the tensor-parallel
    ranks (every rank computes the same loss / hand-over from the full sequence, so the
    incoming gradient is complete and identical on every rank): the backward keeps this rank's
    slice of it (`tensor_parallel_output_grad=False`), not a reduce-scatter."""
    if not tconfig.sequence_parallel or groups.tp_size == 1:
        return x
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_sequence_parallel_region(
        x, tensor_parallel_output_grad=False, group=groups.tp
    )


def sequence_slice(x: torch.Tensor, tconfig, groups: ModelGroups) -> torch.Tensor:
    """This rank's slice along dim 0 of a per-token tensor that is not differentiated (e.g. the
    token -> clip index), matching `scatter_sequence`; `x` otherwise."""
    if not tconfig.sequence_parallel or groups.tp_size == 1:
        return x
    part = x.shape[0] // groups.tp_size
    return x[groups.tp_rank * part : (groups.tp_rank + 1) * part]


def build_transformer_layers(
    *, spec, config, groups: ModelGroups, start: int, end: int
) -> torch.nn.ModuleList:
    """Megatron `TransformerLayer`s for global layers [start, end) (layer_number = index + 1)."""
    from megatron.core.transformer.spec_utils import build_module

    collection = groups.collection()
    return torch.nn.ModuleList(
        build_module(spec, config=config, layer_number=i + 1, pg_collection=collection)
        for i in range(start, end)
    )


def mark_qk_norm_weights(layers: torch.nn.Module) -> None:
    """Mark the q/k norm weights (`gpt_layer_spec(qk_norm=True)`) for the tensor-parallel
    gradient sum: replicated, but each TP rank's heads give only part of their gradient (what
    Megatron's `_allreduce_layernorm_grads` sums for q_layernorm / k_layernorm too)."""
    for name, param in layers.named_parameters():
        if ".q_layernorm." in f".{name}" or ".k_layernorm." in f".{name}":
            param.sequence_parallel = True


def build_norm(backend, tconfig, hidden: int):
    """A norm module of this backend (LayerNorm or RMSNorm as the config says)."""
    return backend.norm(config=tconfig, hidden_size=hidden, eps=tconfig.layernorm_epsilon)


def mark_tensor_parallel_weights(module: torch.nn.Module) -> None:
    """Set Megatron's tensor-parallel attributes on the parallel layers' parameters.

    Megatron sets `tensor_model_parallel` / `partition_dim` on Column/RowParallelLinear and
    VocabParallelEmbedding weights only inside its own initialisation, which
    `perform_initialization=False` skips; `init.py` (which draws the full tensor and cuts this
    rank's shard), DDP and gradient clipping rely on them. Weights split along dim 0
    (column-parallel, vocab-parallel) or 1 (row-parallel); column-parallel biases along dim 0
    (Megatron marks those itself). Raises if a parameter already says otherwise.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    splits = (
        (ColumnParallelLinear, {"weight": 0, "bias": 0}),
        (RowParallelLinear, {"weight": 1}),
        (VocabParallelEmbedding, {"weight": 0}),
    )
    for name, sub in module.named_modules():
        for cls, dims in splits:
            if not isinstance(sub, cls):
                continue
            for attr, dim in dims.items():
                param = getattr(sub, attr, None)
                if param is None:
                    continue
                if not hasattr(param, "tensor_model_parallel"):
                    set_tensor_model_parallel_attributes(param, True, dim, 1)
                elif not param.tensor_model_parallel or param.partition_dim != dim:
                    raise RuntimeError(
                        f"{name}.{attr}: tensor_model_parallel={param.tensor_model_parallel}, "
                        f"partition_dim={param.partition_dim}; {cls.__name__} splits dim {dim}"
                    )


def cached(batch, key: tuple, make):
    """`batch.cache[key]`, computed by `make()` on first use (shared by all chunks)."""
    if key not in batch.cache:
        batch.cache[key] = make()
    return batch.cache[key]


def sinusoidal_embedding(values: torch.Tensor, dim: int, *, max_period: float = 10000.0):
    """Sinusoidal features [n, dim] of scalars [n] (timesteps scaled to [0, 1000))."""
    half = dim // 2
    freqs = torch.exp(
        -torch.log(torch.tensor(max_period, dtype=torch.float64))
        * torch.arange(half, dtype=torch.float64, device=values.device)
        / half
    )
    args = values.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def build_merger(chunk, *, width: int, out: int, inner: int | None = None):
    """The two-layer projector of a scatter producer (merged tokens of `width` -> `out`): a
    column-parallel fc1 (width -> inner, default width) and a row-parallel fc2 (inner -> out).
    It runs on the gathered sequence, so without sequence parallelism."""
    from megatron.core import tensor_parallel

    config = without_sequence_parallel(chunk.config)
    inner = width if inner is None else inner
    fc1 = tensor_parallel.ColumnParallelLinear(
        width,
        inner,
        config=config,
        init_method=chunk.config.init_method,
        bias=True,
        gather_output=False,
        tp_group=chunk.groups.tp,
    )
    fc2 = tensor_parallel.RowParallelLinear(
        inner,
        out,
        config=config,
        init_method=chunk.config.init_method,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=chunk.groups.tp,
    )
    return fc1, fc2


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-sharded logits [S, 1, V/tp] over `group`.

    Megatron's own version reads the global tensor-parallel group; this one takes it
    explicitly. Sums over the group are all-reduced forward and passed through unchanged
    backward (every rank holds the same loss).
    """
    from megatron.core import tensor_parallel

    logits = (
        logits[:, 0].float() if logits.dtype in (torch.float16, torch.bfloat16) else logits[:, 0]
    )
    if group.size() == 1:
        return functional.cross_entropy(logits, target, reduction="none")
    with torch.no_grad():
        top = logits.max(dim=-1).values
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - top[:, None]
    reduce = tensor_parallel.reduce_from_tensor_model_parallel_region
    sum_exp = reduce(shifted.exp().sum(dim=-1), group=group)
    part = logits.shape[-1]
    local = target - group.rank() * part
    inside = (local >= 0) & (local < part)
    picked = shifted.gather(1, local.clamp(0, part - 1)[:, None])[:, 0] * inside
    return torch.log(sum_exp) - reduce(picked, group=group)
