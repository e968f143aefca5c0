"""Module shapes and architecture options from a Hugging Face `config.json` (torch-free).

`text_module_fields(config)` turns a Llama / Mistral / Qwen2 / Qwen3 decoder's config into the `ModuleSpec` fields
it fixes (layers, `LayerShape`, vocabulary, `Architecture`), for the LLM or the text encoder.
`parse_hf_config_flag` reads `--dip-hf-config` ("DIR" or "llm=DIR,vit=DIR"). Anything the
config asks for that our layers cannot compute (sliding windows, MLP biases, other rope types)
is refused with a ValueError naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_dip.modelspec import Architecture, LayerShape, ModuleSpec, MultimodalSpec, RopeScaling

TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava")
LLAVA_TOWERS = ("clip_vision_model", "siglip_vision_model")
# Hugging Face vision activations -> ours.
_VISION_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
# The text config of a VLM (nested under "text_config") and the text family it is.
_TEXT_OF_VLM = {
    "qwen2_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_5_vl_text": "qwen2",
}  # fmt: skip
CONFIG_FILE = "config.json"


def read_config(folder: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a Hugging Face model folder (ValueError when missing)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"{folder}: no {CONFIG_FILE} there (a Hugging Face model folder holds one)"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _rope(config: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(rotary base, scaling) from transformers 5's `rope_parameters` or the older
    `rope_theta` / `rope_scaling` fields."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind in ("default", "mrope"):  # "mrope": Qwen2-VL's sections, read by the caller
        return float(base), None
    if kind != "llama3":
        raise ValueError(f"{where}: rope type {kind!r} is not supported (default, llama3)")
    source = params if "factor" in params else legacy
    scaling = RopeScaling(
        factor=float(source["factor"]),
        low_freq_factor=float(source["low_freq_factor"]),
        high_freq_factor=float(source["high_freq_factor"]),
        original_max_position_embeddings=int(source["original_max_position_embeddings"]),
    )
    return float(base), scaling


def _refuse_unsupported(config: dict[str, Any], kind: str, where: str) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {config['hidden_act']!r}; only silu (SwiGLU)")
    if config.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias is not supported")
    if config.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is not supported (full attention only)")
    window = config.get("sliding_window") if kind == "mistral" else None
    if window is not None and window < int(config.get("max_position_embeddings") or 0):
        raise ValueError(
            f"{where}: sliding_window {window} (< max_position_embeddings "
            f"{config.get('max_position_embeddings')}) is not supported: full attention only"
        )
    if kind in ("llama", "mistral", "qwen3") and config.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias (o_proj bias) is not supported")


def _tied(config: dict[str, Any]) -> bool:
    """Whether the output head is the input embedding: a VLM's top-level tie_word_embeddings
    (where transformers 5 writes it; its text_config then has none) over its text config's."""
    text = config.get("text_config") or {}
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text.get("tie_word_embeddings", False))


def text_module_fields(config: dict[str, Any], *, where: str = CONFIG_FILE) -> dict[str, Any]:
    """`ModuleSpec` fields of a Llama / Mistral / Qwen2 / Qwen3 decoder config (a Qwen2-VL
    config's text part too): num_layers, layer, vocab_size, arch."""
    tied = _tied(config)
    config = dict(config.get("text_config") or config)
    kind = _TEXT_OF_VLM.get(config.get("model_type"), config.get("model_type"))
    if kind not in TEXT_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {config.get('model_type')!r}; supported: "
            f"{', '.join((*TEXT_MODEL_TYPES, *VLM_MODEL_TYPES))}"
        )
    _refuse_unsupported(config, kind, where)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    layer = LayerShape(
        hidden,
        int(config["intermediate_size"]),
        heads,
        int(config.get("num_key_value_heads") or heads),
        gated_mlp=True,
        kv_channels=None if head_dim * heads == hidden else int(head_dim),
    )
    base, scaling = _rope(config, where)
    sections = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get(
        "mrope_section"
    )
    arch = Architecture(
        rotary_base=base,
        rope_scaling=scaling,
        mrope_sections=None if sections is None else tuple(sections),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        # Qwen2 always has q/k/v biases; the others none (attention_bias is refused above).
        qkv_bias=kind == "qwen2",
        tie_embeddings=tied,
        qk_norm=kind == "qwen3",
        family=kind if kind in ("mistral", "qwen3") else None,
    )
    return {
        "num_layers": int(config["num_hidden_layers"]),
        "layer": layer,
        "vocab_size": int(config["vocab_size"]),
        "arch": arch,
    }


def vision_module_fields(config: dict[str, Any], *, where: str = CONFIG_FILE) -> dict[str, Any]:
    """`ModuleSpec` fields of the vision tower of a Qwen2-VL or LLaVA config."""
    if config.get("model_type") not in VLM_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {config.get('model_type')!r} has no vision tower "
            f"we read (supported: {', '.join(VLM_MODEL_TYPES)})"
        )
    if config["model_type"] == "llava":
        return llava_vision_fields(config, where=where)
    if config["model_type"] == "qwen2_5_vl":
        return qwen2_5_vl_vision_fields(config, where=where)
    return qwen2_vl_vision_fields(config, where=where)


def _llava_feature_layers(config: dict[str, Any], vision: dict, where: str) -> int:
    """The tower's layers LLaVA uses: those up to `vision_feature_layer` (hidden_states[k]:
    k = 0 the embeddings, -1 the last layer's output; the later layers are never run)."""
    index = config.get("vision_feature_layer", -2)
    if not isinstance(index, int):
        raise ValueError(f"{where}: vision_feature_layer {index!r}: one layer only (not a list)")
    total = int(vision["num_hidden_layers"])
    used = total + 1 + index if index < 0 else index
    if not 1 <= used <= total:
        raise ValueError(f"{where}: vision_feature_layer {index} outside the {total} layers")
    return used


def _tower_layer_tensors(i: int, hidden: int, ffn: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of layer `i` of a CLIP / SigLIP tower (below the tower's prefix)."""
    out = []
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        out += [
            (f"self_attn.{proj}.weight", (hidden, hidden)),
            (f"self_attn.{proj}.bias", (hidden,)),
        ]
    for norm in ("layer_norm1", "layer_norm2"):
        out += [(f"{norm}.weight", (hidden,)), (f"{norm}.bias", (hidden,))]
    out += [("mlp.fc1.weight", (ffn, hidden)), ("mlp.fc1.bias", (ffn,))]
    out += [("mlp.fc2.weight", (hidden, ffn)), ("mlp.fc2.bias", (hidden,))]
    return [(f"encoder.layers.{i}.{name}", shape) for name, shape in out]


def llava_carried(vision: dict[str, Any], used: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The tensors of a LLaVA tower that LLaVA never runs (`Architecture.carried`): the layers
    after the `used` ones, the post-layernorm, and a SigLIP tower's pooling head
    (`vision_use_head`), named below the tower's prefix as transformers' models hold them."""
    h, f = int(vision["hidden_size"]), int(vision["intermediate_size"])
    out = []
    for i in range(used, int(vision["num_hidden_layers"])):
        out += _tower_layer_tensors(i, h, f)
    out += [("post_layernorm.weight", (h,)), ("post_layernorm.bias", (h,))]
    if vision.get("model_type") == "siglip_vision_model" and vision.get("vision_use_head", True):
        out += [
            ("head.probe", (1, 1, h)), ("head.attention.in_proj_weight", (3 * h, h)),
            ("head.attention.in_proj_bias", (3 * h,)), ("head.attention.out_proj.weight", (h, h)),
            ("head.attention.out_proj.bias", (h,)), ("head.layernorm.weight", (h,)),
            ("head.layernorm.bias", (h,)), ("head.mlp.fc1.weight", (f, h)),
            ("head.mlp.fc1.bias", (f,)), ("head.mlp.fc2.weight", (h, f)), ("head.mlp.fc2.bias", (h,)),
        ]  # fmt: skip
    return tuple(out)


def llava_vision_fields(config: dict[str, Any], *, where: str = CONFIG_FILE) -> dict[str, Any]:
    """`ModuleSpec` fields of a LLaVA vision tower and projector: a CLIP tower (class token,
    learned positions, pre-norm, quick_gelu) or a SigLIP one (learned positions, no class
    token, gelu-tanh, Conv2d bias), the layers up to `vision_feature_layer`, no final norm,
    `vision_feature_select_strategy` ("default" drops the class token), the two-layer GELU
    projector into the LLM's width; base resolution only."""
    vision, text = config["vision_config"], config["text_config"]
    tower = vision.get("model_type", "clip_vision_model")
    if tower not in LLAVA_TOWERS:
        raise ValueError(f"{where}: vision tower {tower!r}; supported: {', '.join(LLAVA_TOWERS)}")
    clip = tower == "clip_vision_model"
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full") or (strategy == "default" and not clip):
        raise ValueError(
            f"{where}: vision_feature_select_strategy {strategy!r} with a {tower} is not "
            "supported (CLIP: default or full; SigLIP, which has no class token to drop: full)"
        )
    act = _VISION_ACTS.get(vision.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"))
    if act is None or config.get("projector_hidden_act", "gelu") != "gelu":
        raise ValueError(
            f"{where}: vision hidden_act {vision.get('hidden_act')!r} / projector "
            f"{config.get('projector_hidden_act')!r}; supported: "
            f"{', '.join(_VISION_ACTS)} / gelu"
        )
    if not config.get("multimodal_projector_bias", True):
        raise ValueError(f"{where}: multimodal_projector_bias false is not supported")
    patch, side = int(vision["patch_size"]), int(vision["image_size"])
    hidden, heads = int(vision["hidden_size"]), int(vision["num_attention_heads"])
    out = int(text["hidden_size"])
    used = _llava_feature_layers(config, vision, where)
    arch = Architecture(
        norm_eps=float(vision.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
        activation=act,
        patch_embedding="conv2d",
        patch_bias=not clip,
        learned_positions=(side // patch) ** 2 + clip,
        class_token=clip,
        keep_class_token=clip and strategy == "full",
        pre_norm=clip,
        final_norm=False,
        projector_hidden=out,
        carried=llava_carried(vision, used),
    )
    token = config.get("image_token_id", config.get("image_token_index"))
    return {
        "num_layers": used,
        "layer": LayerShape(hidden, int(vision["intermediate_size"]), heads, heads),
        "patch_size": patch, "in_channels": int(vision.get("num_channels", 3)), "merge": 1,
        "out_hidden": out, "placeholder_id": int(token), "arch": arch,
    }  # fmt: skip


def qwen2_vl_vision_fields(config: dict[str, Any], *, where: str = CONFIG_FILE) -> dict[str, Any]:
    """`ModuleSpec` fields of a Qwen2-VL vision tower (the `vision_config` of a Qwen2-VL
    config): layers, shape, patch and merge sizes, the LLM width it projects to, its
    placeholder (`image_token_id`) and options (LayerNorm 1e-6, quick_gelu, Conv3d patches,
    blocked 2-D rotary)."""
    vision = _qwen_vision_config(config, where)
    act = vision.get("hidden_act", "quick_gelu")
    if act not in ("quick_gelu", "gelu"):
        raise ValueError(f"{where}: vision hidden_act {act!r}; supported: quick_gelu, gelu")
    dim, heads = int(vision["embed_dim"]), int(vision["num_heads"])
    layer = LayerShape(dim, int(dim * vision.get("mlp_ratio", 4)), heads, heads)
    return _qwen_tower_fields(
        config, layer, _qwen_tower_arch(vision, act), out_hidden=int(vision["hidden_size"])
    )


def qwen2_5_vl_vision_fields(config: dict[str, Any], *, where: str = CONFIG_FILE) -> dict[str, Any]:
    """`ModuleSpec` fields of a Qwen2.5-VL vision tower: Qwen2-VL's Conv3d patches and blocked
    2-D rotary, with RMSNorm (1e-6), a gated MLP with biases (`hidden_act`, silu), window
    attention (`window_size` pixels; `fullatt_block_indexes` the layers over the whole image)
    and the merger's RMSNorm; `hidden_size` is the tower's width, `out_hidden_size` the LLM's."""
    vision = _qwen_vision_config(config, where)
    act = _VISION_ACTS.get(vision.get("hidden_act", "silu"), vision.get("hidden_act"))
    if act not in ("silu", "quick_gelu", "gelu", "gelu_tanh"):
        raise ValueError(
            f"{where}: vision hidden_act {act!r}; supported: silu, {', '.join(_VISION_ACTS)}"
        )
    dim, heads = int(vision["hidden_size"]), int(vision["num_heads"])
    layer = LayerShape(dim, int(vision["intermediate_size"]), heads, heads, gated_mlp=True)
    arch = replace(
        _qwen_tower_arch(vision, act),
        normalization="RMSNorm",
        window_size=int(vision.get("window_size", 112)),
        full_attention_layers=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
    )
    return _qwen_tower_fields(config, layer, arch, out_hidden=int(vision["out_hidden_size"]))


def _qwen_vision_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The `vision_config` of a Qwen2-VL / Qwen2.5-VL config (two-frame temporal patches only)."""
    vision = config["vision_config"]
    if int(vision.get("temporal_patch_size", 2)) != 2:
        raise ValueError(f"{where}: temporal_patch_size {vision['temporal_patch_size']}; only 2")
    return vision


def _qwen_tower_arch(vision: dict[str, Any], activation: str) -> Architecture:
    """The options both Qwen VL towers share: norm eps 1e-6, Conv3d patches, blocked rotary."""
    return Architecture(
        rotary_base=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        norm_eps=1e-6,
        activation=activation,
        patch_embedding="conv3d",
        rotary_layout="blocked",
    )


def _qwen_tower_fields(
    config: dict[str, Any], layer: LayerShape, arch: Architecture, *, out_hidden: int
) -> dict[str, Any]:
    vision = config["vision_config"]
    return {
        "num_layers": int(vision["depth"]),
        "layer": layer,
        "patch_size": int(vision["patch_size"]),
        "in_channels": int(vision.get("in_channels", 3)),
        "merge": int(vision["spatial_merge_size"]),
        "out_hidden": out_hidden,
        "placeholder_id": int(config["image_token_id"]),
        "arch": arch,
    }


def parse_hf_config_flag(text: str | None, *, modules: list[str]) -> dict[str, str]:
    """`--dip-hf-config`: "DIR" (for every module that the folder describes) or
    "MODULE=DIR,..."; returns {module or "": folder}."""
    if not text:
        return {}
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, folder = part.partition("=")
        if not sep:
            name, folder = "", part
        if name and name not in modules:
            raise ValueError(f"{part!r}: the model has no module {name!r} (modules: {modules})")
        if name in out:
            raise ValueError(f"{part!r}: module {name or 'default'} given twice")
        out[name] = folder
    return out


def text_family(spec: ModuleSpec) -> str:
    """The Hugging Face model type of a text module: its `Architecture.family`, else qwen2
    (q/k/v biases) or llama."""
    if spec.arch.family is not None:
        return spec.arch.family
    return "qwen2" if spec.arch.qkv_bias else "llama"


_CLASS_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def hf_text_config(
    spec: ModuleSpec, *, max_positions: int = 8192, dtype: str = "float32"
) -> dict[str, Any]:
    """The `config.json` of module `spec` (an LLM or a text encoder) as a Hugging Face Llama,
    Mistral, Qwen2 or Qwen3 model (`text_family`): the inverse of `text_module_fields`."""
    lay, arch = spec.layer, spec.arch
    kind = text_family(spec)
    if (kind == "qwen2") != arch.qkv_bias or (kind == "qwen3") != arch.qk_norm:
        raise ValueError(
            f"module {spec.name!r}: a {kind} model has {'' if kind == 'qwen2' else 'no '}q/k/v "
            f"biases and {'' if kind == 'qwen3' else 'no '}q/k norms (qkv_bias={arch.qkv_bias}, "
            f"qk_norm={arch.qk_norm})"
        )
    head = "ForCausalLM" if spec.kind == "llm" else "Model"
    rope: dict[str, Any] = {"rope_theta": arch.rotary_base, "rope_type": "default"}
    if arch.rope_scaling is not None:
        s = arch.rope_scaling
        rope = {
            "rope_theta": arch.rotary_base, "rope_type": s.rope_type, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }  # fmt: skip
    if arch.mrope_sections is not None:
        rope["mrope_section"] = list(arch.mrope_sections)
    config = {
        "architectures": [_CLASS_NAMES[kind] + head],
        "model_type": kind,
        "hidden_size": lay.hidden,
        "intermediate_size": lay.ffn,
        "num_attention_heads": lay.heads,
        "num_key_value_heads": lay.kv_groups,
        "head_dim": lay.head_dim,
        "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": arch.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": arch.tie_embeddings,
        "max_position_embeddings": max_positions,
        # transformers 5 reads rope_parameters; older releases rope_theta and rope_scaling
        "rope_parameters": rope,
        "rope_theta": arch.rotary_base,
        "rope_scaling": None if arch.rope_scaling is None else rope,
        # transformers 5 writes "dtype", older releases "torch_dtype": both, alike
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if kind in ("llama", "mistral", "qwen3"):
        config.update(attention_bias=False)
    if kind == "llama":
        config.update(mlp_bias=False)
    if kind == "mistral":
        config.update(sliding_window=None)
    if kind in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def _ratio(ffn: int, hidden: int) -> int | float:
    """Qwen2-VL's mlp_ratio: an int where the sizes allow (its config class asks for one)."""
    return ffn // hidden if ffn % hidden == 0 else ffn / hidden


def hf_qwen2_vl_config(
    vit: ModuleSpec, llm: ModuleSpec, *, dtype: str = "float32"
) -> dict[str, Any]:
    """The `config.json` of a Qwen2-VL model made of our `vit` and `llm` (the inverse of
    `vision_module_fields` and `text_module_fields`)."""
    text = hf_text_config(llm, dtype=dtype)
    del text["architectures"]
    text["model_type"] = "qwen2_vl_text"
    vision = {
        "model_type": "qwen2_vl_vision", "depth": vit.num_layers, "embed_dim": vit.layer.hidden,
        "hidden_size": vit.out_hidden, "num_heads": vit.layer.heads,
        "mlp_ratio": _ratio(vit.layer.ffn, vit.layer.hidden), "hidden_act": vit.arch.activation or "gelu",
        "in_channels": vit.in_channels, "patch_size": vit.patch_size,
        "spatial_merge_size": vit.merge, "temporal_patch_size": 2,
    }  # fmt: skip
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": vit.placeholder_id,
        "tie_word_embeddings": llm.arch.tie_embeddings,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def hf_qwen2_5_vl_config(
    vit: ModuleSpec, llm: ModuleSpec, *, dtype: str = "float32"
) -> dict[str, Any]:
    """The `config.json` of a Qwen2.5-VL model made of our `vit` (window attention, RMSNorm,
    gated MLP) and `llm` (the inverse of `qwen2_5_vl_vision_fields` and `text_module_fields`)."""
    out = hf_qwen2_vl_config(vit, llm, dtype=dtype)
    out["text_config"]["model_type"] = "qwen2_5_vl_text"
    out["vision_config"] = {
        "model_type": "qwen2_5_vl_vision", "depth": vit.num_layers,
        "hidden_size": vit.layer.hidden, "intermediate_size": vit.layer.ffn,
        "out_hidden_size": vit.out_hidden, "num_heads": vit.layer.heads,
        "hidden_act": vit.arch.activation or "silu", "in_channels": vit.in_channels,
        "patch_size": vit.patch_size, "spatial_merge_size": vit.merge, "temporal_patch_size": 2,
        "window_size": vit.arch.window_size,
        "fullatt_block_indexes": list(vit.arch.full_attention_layers),
    }  # fmt: skip
    out.update(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl")
    return out


def hf_llava_config(vit: ModuleSpec, llm: ModuleSpec, *, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of a LLaVA model made of our `vit` (a CLIP tower with a class token,
    else SigLIP; its carried tensors give the layers after the features and SigLIP's head) and
    `llm` (the inverse of `llava_vision_fields` and `text_module_fields`)."""
    a, clip = vit.arch, vit.arch.class_token
    text = hf_text_config(llm, dtype=dtype)
    del text["architectures"]
    carried = {name for name, _ in a.carried}
    total = vit.num_layers
    while f"encoder.layers.{total}.mlp.fc1.weight" in carried:
        total += 1
    side = math.isqrt(a.learned_positions - clip) * vit.patch_size
    act = {ours: theirs for theirs, ours in _VISION_ACTS.items()}[a.activation]
    vision = {
        "model_type": "clip_vision_model" if clip else "siglip_vision_model",
        "hidden_size": vit.layer.hidden, "intermediate_size": vit.layer.ffn,
        "num_attention_heads": vit.layer.heads, "num_hidden_layers": total, "image_size": side,
        "patch_size": vit.patch_size, "num_channels": vit.in_channels, "hidden_act": act,
        "layer_norm_eps": a.norm_eps,
    }  # fmt: skip
    if not clip:
        vision["vision_use_head"] = "head.probe" in carried
    return {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": text, "vision_config": vision, "image_token_id": vit.placeholder_id,
        "vision_feature_layer": vit.num_layers - total - 1,
        "vision_feature_select_strategy": "default" if clip and not a.keep_class_token else "full",
        "projector_hidden_act": "gelu", "multimodal_projector_bias": True,
        "tie_word_embeddings": llm.arch.tie_embeddings, "dtype": dtype, "torch_dtype": dtype,
    }  # fmt: skip


def hf_vlm_config(vit: ModuleSpec, llm: ModuleSpec, *, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of the Hugging Face VLM our `vit` and `llm` are: LLaVA (learned
    positions), Qwen2.5-VL (window attention) or Qwen2-VL (Conv3d patches)."""
    if vit.arch.learned_positions:
        return hf_llava_config(vit, llm, dtype=dtype)
    if vit.arch.window_size:
        return hf_qwen2_5_vl_config(vit, llm, dtype=dtype)
    return hf_qwen2_vl_config(vit, llm, dtype=dtype)


def merged_config(ours: dict[str, Any], template: dict[str, Any] | None) -> dict[str, Any]:
    """`ours` over the Hugging Face config it came from (`template`, e.g. the imported folder's):
    what we do not model (token ids, context length, ...) is kept from the template."""
    if not template:
        return ours
    out = dict(template)
    for key, value in ours.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged_config(value, out[key])
        elif key == "max_position_embeddings" and key in out:
            continue
        else:
            out[key] = value
    return out


# What a Hugging Face config gives each kind of module (the kinds we read weights for).
def encoder_module_fields(config: dict[str, Any], *, where: str = CONFIG_FILE) -> dict[str, Any]:
    """`text_module_fields` for a text encoder: it has no output head, so nothing is tied."""
    fields = text_module_fields(config, where=where)
    fields["arch"] = replace(fields["arch"], tie_embeddings=False)
    return fields


FIELDS_OF_KIND = {
    "llm": text_module_fields,
    "text_encoder": encoder_module_fields,
    "vit": vision_module_fields,
}


def describes(config: dict[str, Any], kind: str) -> bool:
    """Whether a Hugging Face `config` describes a module of `kind`."""
    model_type = config.get("model_type")
    if kind == "vit":
        return model_type in VLM_MODEL_TYPES
    return kind in FIELDS_OF_KIND and model_type in (*TEXT_MODEL_TYPES, *VLM_MODEL_TYPES)


FAMILIES = {
    "llama": "Llama 2 / 3 / 3.1 / 3.2 decoders (llama3 rope scaling, tied or untied)",
    "mistral": "Mistral decoders without a sliding window (sliding_window null)",
    "qwen2": "Qwen2 / Qwen2.5 decoders (q/k/v biases)",
    "qwen3": "Qwen3 dense decoders (per-head q/k RMSNorm, explicit head_dim)",
    "qwen2_vl": "Qwen2-VL: vision tower + merger as the ViT, M-RoPE Qwen2 decoder as the LLM",
    "qwen2_5_vl": "Qwen2.5-VL: vision tower with window attention (RMSNorm, gated MLP) + merger "
    "as the ViT, M-RoPE Qwen2 decoder as the LLM",
    "llava": "LLaVA (base resolution): CLIP or SigLIP tower + two-layer projector as the ViT, "
    "Llama / Mistral / Qwen2 as the LLM",
}


def model_of_config(config: dict[str, Any], *, where: str = CONFIG_FILE) -> MultimodalSpec:
    """The model a Hugging Face folder is on its own (no --model preset): its decoder as the
    module "llm", and a VLM's vision tower as "vit" feeding it."""
    kind = config.get("model_type")
    llm = ModuleSpec("llm", "llm", **text_module_fields(config, where=where))
    if kind not in VLM_MODEL_TYPES:
        return MultimodalSpec(f"hf-{kind}", (llm,))
    vit = ModuleSpec("vit", "vit", feeds="llm", **vision_module_fields(config, where=where))
    return MultimodalSpec(f"hf-{kind}", (vit, llm))
