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
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
    } | extra


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights too: ones would hide a mapped-away norm)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def save_llama(
    folder: Path,
    *,
    tied: bool,
    scaling: bool = True,
    seed: int = 0,
    layers: int = LAYERS,
    shard_size: str | None = None,
    vocab: int = VOCAB,
):
    """A tiny LlamaForCausalLM (rope base 5e5, eps 1e-5, llama3 scaling) saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_theta": 500000.0, **(LLAMA3_SCALING if scaling else {"rope_type": "default"})}
    fields = _common(
        rms_norm_eps=1e-5, tie_word_embeddings=tied, num_hidden_layers=layers, vocab_size=vocab
    )
    config = LlamaConfig(**fields, rope_parameters=rope)
    save = {"max_shard_size": shard_size} if shard_size else {}
    return _save(LlamaForCausalLM(config), folder, seed, **save)


def save_qwen2(folder: Path, *, seed: int = 0):
    """A tiny Qwen2ForCausalLM (q/k/v biases, rope base 1e6, eps 1e-6) saved to `folder`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_common(rms_norm_eps=1e-6, tie_word_embeddings=False),
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    )
    return _save(Qwen2ForCausalLM(config), folder, seed)


def save_qwen3(folder: Path, *, seed: int = 0, tied: bool = True):
    """A tiny Qwen3ForCausalLM (per-head q/k RMSNorm, head_dim 16 != hidden / heads = 8, tied
    like the small Qwen3 models, rope base 1e6) saved to `folder`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **_common(rms_norm_eps=1e-6, tie_word_embeddings=tied, head_dim=16),
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        bos_token_id=None,
        eos_token_id=None,
    )
    return _save(Qwen3ForCausalLM(config), folder, seed)


def save_mistral(folder: Path, *, seed: int = 0, sliding_window: int | None = None):
    """A tiny MistralForCausalLM (no sliding window unless asked, rope base 1e6, odd ffn 72)
    saved to `folder`."""
    from transformers import MistralConfig, MistralForCausalLM

    fields = _common(rms_norm_eps=1e-5, tie_word_embeddings=False, intermediate_size=72)
    config = MistralConfig(
        **fields,
        sliding_window=sliding_window,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        bos_token_id=None,
        eos_token_id=None,
    )
    return _save(MistralForCausalLM(config), folder, seed)


def _save(model, folder: Path, seed: int, **save):
    _randomise(model, seed)
    model.eval()
    model.save_pretrained(folder, **save)
    return model


def qwen2_vl_model(folder: Path) -> MultimodalSpec:
    """Our ViT + LLM model of the Qwen2-VL folder (`hf.config`)."""
    from megatron_dip.hf.config import vision_module_fields

    config = read_config(folder)
    vit = ModuleSpec("vit", "vit", feeds="llm", **vision_module_fields(config))
    llm = ModuleSpec("llm", "llm", **text_module_fields(config))
    return MultimodalSpec("hf-qwen2-vl", (vit, llm))


def llm_only(folder: Path, *, name: str = "llm", kind: str = "llm") -> MultimodalSpec:
    """A one-module model whose LLM is the Hugging Face model in `folder`."""
    fields = text_module_fields(read_config(folder))
    return MultimodalSpec("hf-llm", (ModuleSpec(name, kind, **fields),))


IMAGE_TOKEN_ID = 5  # Qwen2-VL's image placeholder in the tiny vocabulary (6-8: video/vision tags)
VISION_PATCH, VISION_MERGE = 4, 2


def save_qwen2_vl(
    folder: Path, *, seed: int = 0, image_token: int = IMAGE_TOKEN_ID, tied: bool = False
):
    """A tiny Qwen2VLForConditionalGeneration (vision tower 2 x 32, 4-px patches, 2x2 merge,
    quick_gelu; Qwen2 LLM with M-RoPE sections 2/1/1 of its 4 frequency slots) saved."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = _common(rms_norm_eps=1e-6, bos_token_id=None)
    text["eos_token_id"] = None
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1e6,
        "mrope_section": [2, 1, 1],
    }
    vision = {
        "depth": 2, "embed_dim": HIDDEN, "hidden_size": HIDDEN, "num_heads": HEADS,
        "mlp_ratio": 2, "patch_size": VISION_PATCH, "spatial_merge_size": VISION_MERGE,
        "temporal_patch_size": 2, "in_channels": 3,
    }  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image_token,
        video_token_id=6,
        vision_start_token_id=7,
        vision_end_token_id=8,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=tied,
    )
    return _save(Qwen2VLForConditionalGeneration(config), folder, seed)


LLAVA_IMAGE = 16  # base resolution of the tiny LLaVA towers: 4 x 4 patches of 4 px


def save_llava(
    folder: Path,
    *,
    tower: str = "clip",
    seed: int = 0,
    image_token: int = IMAGE_TOKEN_ID,
    strategy: str | None = None,
    text: str = "llama",
):
    """A tiny LlavaForConditionalGeneration saved to `folder` with its image processor: a CLIP
    tower (3 layers of 24, class token, pre-norm, quick_gelu, vision_feature_layer -2: the
    first 2 used) or a SigLIP one (gelu-tanh, no class token, "full" strategy); a Llama (or
    Mistral / Qwen2) LLM; LLaVA's two-layer GELU projector."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    text_config = _common(model_type=text, rms_norm_eps=1e-5, bos_token_id=None)
    text_config.update(eos_token_id=None, pad_token_id=None)
    vision = {
        "model_type": f"{tower}_vision_model", "hidden_size": 24, "intermediate_size": 40,
        "num_attention_heads": 4, "num_hidden_layers": 3, "image_size": LLAVA_IMAGE,
        "patch_size": 4,
    }  # fmt: skip
    if strategy is None:
        strategy = "default" if tower == "clip" else "full"
    config = LlavaConfig(
        text_config=text_config,
        vision_config=vision,
        image_token_id=image_token,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2 if tower == "clip" else -1,
        tie_word_embeddings=False,
    )
    model = _save(LlavaForConditionalGeneration(config), folder, seed)
    llava_processor(tower).save_pretrained(folder)
    return model


def llava_processor(tower: str):
    """transformers' own image processor of the tiny LLaVA towers (PIL back-end)."""
    if tower == "clip":
        from transformers import CLIPImageProcessorPil

        size = {"shortest_edge": LLAVA_IMAGE}
        crop = {"height": LLAVA_IMAGE, "width": LLAVA_IMAGE}
        return CLIPImageProcessorPil(size=size, crop_size=crop)
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE})


def hf_vlm_model(folder: Path) -> MultimodalSpec:
    """Our ViT + LLM model of a Hugging Face VLM folder alone (`hf.config.model_of_config`)."""
    from megatron_dip.hf.config import model_of_config

    return model_of_config(read_config(folder))


def save_qwen2_5_vl(
    folder: Path, *, seed: int = 0, image_token: int = IMAGE_TOKEN_ID, tied: bool = False
):
    """A tiny Qwen2_5_VLForConditionalGeneration saved to `folder`: vision tower 3 x 32 (4-px
    patches, 2x2 merge, RMSNorm, gated silu MLP of 48 with biases), windows of 16 px (2 x 2
    merged tokens) in layers 0 and 2, layer 1 over the whole image; Qwen2 LLM with M-RoPE."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = _common(rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1e6,
        "mrope_section": [2, 1, 1],
    }
    vision = {
        "depth": 3, "hidden_size": HIDDEN, "intermediate_size": 48, "num_heads": HEADS,
        "out_hidden_size": HIDDEN, "patch_size": VISION_PATCH, "spatial_merge_size": VISION_MERGE,
        "temporal_patch_size": 2, "in_channels": 3, "window_size": 16,
        "fullatt_block_indexes": [1], "hidden_act": "silu",
    }  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=image_token,
        video_token_id=6, vision_start_token_id=7, vision_end_token_id=8,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=tied,
    )  # fmt: skip
    return _save(Qwen2_5_VLForConditionalGeneration(config), folder, seed)


def qwen_vl_pixels(pictures, *, max_pixels: int = 24 * 40):
    """transformers' own Qwen2-VL image processor (Qwen2.5-VL's too) on PIL `pictures`:
    (its pixel_values, its image_grid_thw, the [3, H, W] images those patches are cut from)."""
    import numpy as np
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        patch_size=VISION_PATCH, merge_size=VISION_MERGE, temporal_patch_size=2,
        size={"shortest_edge": 64, "longest_edge": max_pixels},
    )  # fmt: skip
    out = processor(pictures, return_tensors="np")
    pixels, grid, images, start = out["pixel_values"], out["image_grid_thw"], [], 0
    for _, h, w in grid.tolist():
        m, p = VISION_MERGE, VISION_PATCH
        patches = pixels[start : start + h * w].reshape(h // m, w // m, m, m, 3, 2, p, p)
        # (rows, cols of merged tokens, merge rows, merge cols, C, frame, py, px) -> [C, H, W]
        image = patches[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, h * p, w * p)
        images.append(np.ascontiguousarray(image, dtype=np.float32))
        start += h * w
    return pixels, grid, images
