"""Multimodal models built from Megatron-Core layers, chunkable into any run of layers.

Modules: ViT (vision encoder + merger/projector), LLM (decoder with head and loss), text encoder
(an LLM without head) and DiT (diffusion transformer with adaLN and cross-attention). A chunk
(`ModelChunk`) is built from an explicit `ChunkSpec` only on the rank that owns it.

Importing this package does not import torch or megatron-core: `layout`, `config` and `presets`
are torch-free (the planner uses them); the torch parts load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import ModelConfig
from .layout import (
    cross_module_dependencies,
    instance_tokens,
    loss_tokens_of,
    message_tensors,
    split_submicrobatches,
)
from .presets import model_preset, preset_names

_LAZY = {
    "ModelChunk": "chunk",
    "ModelGroups": "chunk",
    "build_chunk": "chunk",
    "build_module_chunks": "chunk",
    "reduce_tied_embedding_grads": "chunk",
    "global_param_name": "init",
    "SubBatch": "inputs",
    "build_sub_batch": "inputs",
    "patchify_clip": "inputs",
    "unpatchify_clip": "inputs",
    "patchify_image": "inputs",
    "LocalPipeline": "reference",
    "reference_loss_and_grads": "reference",
}

__all__ = [
    "ModelConfig",
    "cross_module_dependencies",
    "instance_tokens",
    "loss_tokens_of",
    "message_tensors",
    "model_preset",
    "preset_names",
    "split_submicrobatches",
    "ModelChunk",
    "ModelGroups",
    "build_chunk",
    "build_module_chunks",
    "reduce_tied_embedding_grads",
    "global_param_name",
    "SubBatch",
    "build_sub_batch",
    "patchify_clip",
    "unpatchify_clip",
    "patchify_image",
    "LocalPipeline",
    "reference_loss_and_grads",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
