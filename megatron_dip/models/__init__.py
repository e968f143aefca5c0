"""Torch building blocks of the modality modules, on Megatron-Core layers.

`chunk.ModelChunk` (any run of a module's layers, driven by the module's modality), `batch`
(a sub-microbatch's inputs), `common` (configs, norms, masks, rotary tables, layer builders),
`dit_layer` (the DiT layer), `init` (initialisation from global parameter names), `sharded`
(where each tensor lies in the global, placement-free checkpoint tensors: the chunks'
`sharded_state_dict()`), `config` (build-time options). What a kind computes lives in `megatron_dip.modalities`; this package
knows no kinds.

Importing this package does not import torch or megatron-core: `config` and `presets` are
torch-free; the torch parts load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import ModelConfig
from .presets import model_preset, preset_names

_LAZY = {
    "ModelChunk": "chunk",
    "ModelGroups": "chunk",
    "build_chunk": "chunk",
    "reduce_tied_embedding_grads": "chunk",
    "global_param_name": "init",
    "SubBatch": "batch",
}

__all__ = [
    "ModelConfig",
    "model_preset",
    "preset_names",
    "ModelChunk",
    "ModelGroups",
    "build_chunk",
    "reduce_tied_embedding_grads",
    "global_param_name",
    "SubBatch",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
