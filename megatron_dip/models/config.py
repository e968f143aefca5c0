"""Build-time options of the multimodal models (torch-free, shared by the planner and runtime)."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "float64", "bfloat16", "float16")
_ATTENTION = ("auto", "varlen", "segments")


@dataclass(frozen=True)
class ModelConfig:
    """How the modality modules are built; the shapes come from `modelspec.ModuleSpec`.

    `seed` drives the deterministic initialisation: every parameter is drawn from a generator
    seeded by (seed, global parameter name), so every chunking of a model starts identical.
    `text_causal`: the text encoder attends causally within each caption (the paper's text
    encoders are decoder LLMs); False makes it bidirectional within each caption.
    `adaln_zero`: DiT modulation and final projection start at zero (adaLN-Zero); tests switch it
    off so that every DiT parameter gets a non-zero gradient from the first step.
    Per-module architecture (rotary base and scaling, norm epsilon, biases, tied embeddings,
    activation) is part of the model spec (`modelspec.Architecture`), not of this config; the
    parallel sizes and whether sequence parallelism is in effect are the run's
    `parallel.ParallelShape`, handed to the chunk builders beside this config.
    `use_te`: Transformer Engine layer specs (None: when transformer_engine imports).
    `delay_wgrad`: Transformer Engine layers queue their weight GEMMs for `backward_dw` (a
    split backward's W; `runtime/delayed_wgrad.py`), where the installed TE can (>= 2.3);
    without TE, or with an older one, nothing changes (the split re-runs those layers'
    backwards in W instead, exact but slower).
    `attention`: the packed-sequence attention kernel (`models.attention`): "auto" is Transformer
    Engine's THD attention with TE layers, else ours (torch's FlashAttention varlen kernel where it
    runs, else SDPA segment by segment); "varlen" / "segments" force our module with that kernel.
    """

    seed: int = 1234
    dtype: str = "float32"
    init_std: float = 0.02
    text_causal: bool = True
    adaln_zero: bool = True
    use_te: bool | None = None
    gradient_accumulation_fusion: bool = False
    delay_wgrad: bool = False
    timestep_embed_dim: int = 256
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.init_std <= 0:
            raise ValueError("ModelConfig.init_std must be positive")
        if self.attention not in _ATTENTION:
            raise ValueError(
                f"ModelConfig.attention must be one of {_ATTENTION}, got {self.attention!r}"
            )
        if self.timestep_embed_dim <= 0 or self.timestep_embed_dim % 2:
            raise ValueError("ModelConfig.timestep_embed_dim must be positive and even")
