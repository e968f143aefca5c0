"""Deterministic initialisation from global parameter names, and the global naming itself.

A chunk's parameters are named locally `pre.*` (input layers, chunk 0 only), `layers.<k>.*`
(local layer k = global layer layer_start + k) and `post.*` (output layers, last chunk only).
The global name is `<module>.pre.*`, `<module>.layers.<global index>.*` or `<module>.post.*`,
the same under every chunking. Each parameter is drawn from a generator seeded by
(ModelConfig.seed, global name) as the full, unpartitioned tensor, then cut to this
tensor-parallel rank's shard, so every layout and every TP size starts from identical weights.
"""

from __future__ import annotations

import math
import re

import torch

from .batch import mix_seed

_WRAPPER_PREFIX = re.compile(r"^(module\.)+")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def global_param_name(chunk_module: torch.nn.Module, local_name: str) -> str:
    """Global name of parameter `local_name` of a `ModelChunk` (wrapper prefixes ignored).

    E.g. "layers.0.mlp.linear_fc1.weight" of chunk llm[3, 5) -> "llm.layers.3.mlp.linear_fc1.weight".
    A tied output-embedding copy maps to its input embedding's name.
    """
    chunk = chunk_module
    while not hasattr(chunk, "chunk"):  # unwrap DDP / mixed-precision wrappers
        chunk = chunk.module
    name = _WRAPPER_PREFIX.sub("", local_name)
    aliases = getattr(chunk, "global_aliases", {})
    if name in aliases:
        return aliases[name]
    spec = chunk.chunk
    match = _LAYER.match(name)
    if match:
        return f"{spec.module}.layers.{spec.layer_start + int(match.group(1))}.{match.group(2)}"
    if name.startswith(("pre.", "post.")):
        return f"{spec.module}.{name}"
    raise ValueError(
        f"parameter {local_name!r} of {spec.module} chunk {spec.index} has no global name"
    )


def _is_norm(module: torch.nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _rule(chunk, local_name: str, owner: torch.nn.Module) -> tuple[str, float]:
    """("ones" | "zeros" | "normal", std) for one parameter."""
    leaf = local_name.rsplit(".", 1)[-1]
    std = chunk.model_config.init_std
    if _is_norm(owner) or leaf == "layer_norm_weight":
        return ("zeros", 0.0) if leaf.endswith("bias") else ("ones", 0.0)
    if leaf.endswith("bias"):
        return "zeros", 0.0
    if any(local_name.startswith(p) for p in chunk.zero_init_prefixes()):
        return "zeros", 0.0
    if local_name.startswith("layers.") and local_name.endswith(
        ("linear_proj.weight", "linear_fc2.weight")
    ):
        # Megatron's scaled init of the residual-branch output projections.
        return "normal", std / math.sqrt(2.0 * chunk.module_spec.num_layers)
    return "normal", std


def _full_shape(param: torch.Tensor, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        shape[param.partition_dim] *= tp_size
    return shape


def is_gated_fc1(chunk, local_name: str) -> bool:
    """Whether parameter `local_name` of a chunk is a gated MLP's fc1, which Megatron keeps as
    [gate; up] on every tensor-parallel rank (each half is split over TP separately)."""
    module_spec = getattr(chunk, "module_spec", None)
    return bool(module_spec is not None and module_spec.layer.gated_mlp) and (
        "linear_fc1." in local_name
    )


def shard_for_rank(
    full: torch.Tensor, param: torch.Tensor, *, tp_rank: int, tp_size: int, glu: bool
) -> torch.Tensor:
    """This TP rank's shard of the full tensor of `param` (Megatron's partitioning).

    Megatron's gated-MLP fc1 keeps [gate; up] per rank, so each half is split separately.
    """
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if glu:
        halves = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(h, tp_size, dim=dim)[tp_rank] for h in halves], dim=dim)
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]


@torch.no_grad()
def init_chunk_parameters(chunk, *, skip=None) -> None:
    """Initialise every parameter of a `ModelChunk` from its global name (see module doc),
    except those whose global name `skip(name)` is true (filled from elsewhere: an importer)."""
    owners = dict(chunk.named_modules())
    seed = chunk.model_config.seed
    tp_rank, tp_size = chunk.groups.tp_rank, chunk.groups.tp_size
    for local_name, param in chunk.named_parameters():
        if skip is not None and skip(global_param_name(chunk, local_name)):
            continue
        owner = owners[local_name.rsplit(".", 1)[0]] if "." in local_name else chunk
        kind, std = _rule(chunk, local_name, owner)
        shape = _full_shape(param, tp_size)
        if kind == "ones":
            full = torch.ones(shape, dtype=torch.float64)
        elif kind == "zeros":
            full = torch.zeros(shape, dtype=torch.float64)
        else:
            gen = torch.Generator().manual_seed(
                mix_seed("init", seed, global_param_name(chunk, local_name))
            )
            full = torch.randn(shape, generator=gen, dtype=torch.float64) * std
        glu = is_gated_fc1(chunk, local_name)
        shard = shard_for_rank(full, param, tp_rank=tp_rank, tp_size=tp_size, glu=glu)
        param.copy_(shard.to(dtype=param.dtype, device=param.device))
