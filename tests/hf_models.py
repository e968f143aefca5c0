"""Tiny random Hugging Face models saved to a folder, built offline with `transformers` (the
reference implementation of the parity and checkpoint tests; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_dip.hf.config import read_config, text_module_fields
from megatron_dip.modelspec import ModuleSpec, MultimodalSpec

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 32, 64, 4, 2, 3, 128
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # wavelengths of a head of 8 at base 5e5: 6.3, 167, 4440, 1.2e5 -> kept, blended, scaled x2
    "original_max_position_embeddings": 512,
}


def _common(**extra) -> dict:
    return {
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
        "max_position_embeddings": 1024, **extra,
    }  # fmt: skip


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights too: ones would hide a mapped-away norm)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def save_llama(
    folder: Path, *, tied: bool, scaling: bool = True, seed: int = 0, layers: int = LAYERS
):
    """A tiny LlamaForCausalLM (rope base 5e5, eps 1e-5, llama3 scaling) saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_theta": 500000.0, **(LLAMA3_SCALING if scaling else {"rope_type": "default"})}
    fields = _common(rms_norm_eps=1e-5, tie_word_embeddings=tied, num_hidden_layers=layers)
    config = LlamaConfig(**fields, rope_parameters=rope)
    return _save(LlamaForCausalLM(config), folder, seed)


def save_qwen2(folder: Path, *, seed: int = 0):
    """A tiny Qwen2ForCausalLM (q/k/v biases, rope base 1e6, eps 1e-6) saved to `folder`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_common(rms_norm_eps=1e-6, tie_word_embeddings=False),
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    )
    return _save(Qwen2ForCausalLM(config), folder, seed)


def _save(model, folder: Path, seed: int):
    _randomise(model, seed)
    model.eval()
    model.save_pretrained(folder)
    return model


def llm_only(folder: Path, *, name: str = "llm", kind: str = "llm") -> MultimodalSpec:
    """A one-module model whose LLM is the Hugging Face model in `folder`."""
    fields = text_module_fields(read_config(folder))
    return MultimodalSpec("hf-llm", (ModuleSpec(name, kind, **fields),))
