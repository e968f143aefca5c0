"""Module shapes and architecture options from the flags (torch-free; part of `validate`).

Applied to the `--model` preset's modules in this order, each later source winning:
`--dip-hf-config` (a Hugging Face folder's config.json, `hf.config`), `--dip-arch`
(MODULE.KEY=VALUE for any module), then Megatron-LM's flags (--hidden-size, --rotary-base,
--norm-epsilon, ...), which apply to the loss module as --num-layers does (refused where they
contradict the module's config.json: `refuse_contradictions`), and the freeze flags
(--freeze-LM, --freeze-ViT, --dip-freeze). Producers' `out_hidden` and consumers' `cond_hidden`
follow the hidden sizes of the modules they connect.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_dip.hf.config import (
    FIELDS_OF_KIND,
    TEXT_MODEL_TYPES,
    VLM_MODEL_TYPES,
    describes,
    parse_hf_config_flag,
    read_config,
)
from megatron_dip.modelspec import ModuleSpec, MultimodalSpec, RopeScaling

from .arguments import TrainConfig
from .arguments import fail as _fail

# Megatron-Core's fixed llama3 scaling parameters (--use-rope-scaling).
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original": 8192}

# --dip-arch KEY -> (field of LayerShape or Architecture, parser)
_SHAPE_KEYS = {
    "hidden-size": "hidden",
    "ffn-hidden-size": "ffn",
    "num-attention-heads": "heads",
    "num-query-groups": "kv_groups",
    "kv-channels": "kv_channels",
}
_ARCH_KEYS = {
    "rotary-base": ("rotary_base", float),
    "norm-epsilon": ("norm_eps", float),
    "add-qkv-bias": ("qkv_bias", "bool"),
    "tie-embeddings": ("tie_embeddings", "bool"),
    "activation": ("activation", str),
    "patch-embedding": ("patch_embedding", str),
}


def _bool(text: str, where: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise _fail("--dip-arch", f"{where}: {text!r} is not true/false")


def _changed(spec: ModuleSpec, *, shape: dict, arch: dict, flag: str) -> ModuleSpec:
    try:
        layer = dataclasses.replace(spec.layer, **shape) if shape else spec.layer
        new_arch = dataclasses.replace(spec.arch, **arch) if arch else spec.arch
        return dataclasses.replace(spec, layer=layer, arch=new_arch)
    except (ValueError, TypeError) as e:
        raise _fail(flag, f"module {spec.name!r}: {e}") from None


def hf_folders(config: TrainConfig, model: MultimodalSpec) -> dict[str, str]:
    """{module name: Hugging Face folder} of --dip-hf-config: a bare DIR describes every
    module its config.json describes (a Llama / Qwen2 folder the text modules, a Qwen2-VL folder
    the ViT too)."""
    try:
        given = parse_hf_config_flag(
            config.architecture.dip_hf_config, modules=[m.name for m in model.modules]
        )
        out = {}
        for name, folder in given.items():
            hf = read_config(folder)
            modules = [model.module(name)] if name else model.modules
            targets = [m for m in modules if describes(hf, m.kind)]
            if not targets or (name and len(targets) != 1):
                what = f"module {name!r} ({modules[0].kind})" if name else "any module of the model"
                raise ValueError(
                    f"{folder}: a {hf.get('model_type')!r} config does not describe {what} "
                    f"(read: llm and text_encoder from {' / '.join(TEXT_MODEL_TYPES + VLM_MODEL_TYPES)}, "
                    f"vit from {' / '.join(VLM_MODEL_TYPES)})"
                )
            for target in targets:
                out.setdefault(target.name, folder)
    except ValueError as e:
        raise _fail("--dip-hf-config", str(e)) from None
    return out


def _apply_hf_configs(config: TrainConfig, model: MultimodalSpec) -> MultimodalSpec:
    for name, folder in hf_folders(config, model).items():
        read = FIELDS_OF_KIND[model.module(name).kind]
        try:
            fields = read(read_config(folder), where=f"{folder}/config.json")
        except ValueError as e:
            raise _fail("--dip-hf-config", str(e)) from None
        model = model.replace_module(name, **fields)
    return model


def parse_dip_arch(text: str | None, model: MultimodalSpec) -> dict[str, tuple[dict, dict]]:
    """`--dip-arch`: {module: (LayerShape changes, Architecture changes)}."""
    out: dict[str, tuple[dict, dict]] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        target, sep, value = part.partition("=")
        module, dot, key = target.partition(".")
        if not sep or not dot:
            raise _fail("--dip-arch", f"{part!r} is not MODULE.KEY=VALUE")
        if module not in [m.name for m in model.modules]:
            raise _fail("--dip-arch", f"{part!r}: the model has no module {module!r}")
        shape, arch = out.setdefault(module, ({}, {}))
        try:
            if key in _SHAPE_KEYS:
                shape[_SHAPE_KEYS[key]] = int(value)
            elif key in _ARCH_KEYS:
                field, kind = _ARCH_KEYS[key]
                arch[field] = _bool(value, part) if kind == "bool" else kind(value)
            else:
                keys = sorted([*_SHAPE_KEYS, *_ARCH_KEYS])
                raise _fail("--dip-arch", f"{part!r}: unknown key {key!r} (keys: {keys})")
        except ValueError as e:
            raise _fail("--dip-arch", f"{part!r}: {e}") from None
    return out


def _megatron_changes(config: TrainConfig, spec: ModuleSpec) -> tuple[dict, dict]:
    """(LayerShape changes, Architecture changes) of Megatron-LM's flags for the loss module."""
    a = config.architecture
    shape = {
        field: value
        for field, value in (
            ("hidden", a.hidden_size),
            ("ffn", a.ffn_hidden_size),
            ("heads", a.num_attention_heads),
            ("kv_groups", a.num_query_groups),
            ("kv_channels", a.kv_channels),
        )
        if value is not None
    }
    arch: dict[str, Any] = {}
    if a.rotary_base is not None:
        arch["rotary_base"] = a.rotary_base
    if a.norm_epsilon is not None:
        arch["norm_eps"] = a.norm_epsilon
    if a.add_qkv_bias:
        arch["qkv_bias"] = True
    if a.untie_embeddings_and_output_weights:
        if spec.kind != "llm":
            raise _fail("--untie-embeddings-and-output-weights", f"{spec.name!r} has no head")
        arch["tie_embeddings"] = False
    if a.use_rope_scaling:
        m = _MEGATRON_LLAMA3
        arch["rope_scaling"] = RopeScaling(
            factor=a.rope_scaling_factor,
            low_freq_factor=m["low_freq_factor"],
            high_freq_factor=m["high_freq_factor"],
            original_max_position_embeddings=m["original"],
        )
    return shape, arch


# Field of LayerShape / Architecture -> the Megatron-LM flag that sets it.
_FLAG_OF = {
    "hidden": "--hidden-size", "ffn": "--ffn-hidden-size", "heads": "--num-attention-heads",
    "kv_groups": "--num-query-groups", "kv_channels": "--kv-channels",
    "rotary_base": "--rotary-base", "norm_eps": "--norm-epsilon", "qkv_bias": "--add-qkv-bias",
    "rope_scaling": "--use-rope-scaling",
}  # fmt: skip


def refuse_contradictions(spec: ModuleSpec, changes: dict, *, folder: str) -> None:
    """Megatron-LM flags that contradict the module's Hugging Face config.json are refused
    (a launch script reused for another model would otherwise import a different model): one
    line naming the flag, both values and the file. Flags config.json leaves open still apply;
    --untie-embeddings-and-output-weights is a choice (the head starts as the embedding)."""
    current = {**dataclasses.asdict(spec.layer), **dataclasses.asdict(spec.arch)}
    current["kv_channels"] = spec.layer.head_dim
    current["rope_scaling"] = spec.arch.rope_scaling
    for field, value in changes.items():
        if field == "tie_embeddings" or current.get(field) == value:
            continue
        raise _fail(
            _FLAG_OF.get(field, field),
            f"{_shown(value)} contradicts {_shown(current.get(field))} in {folder}/config.json "
            f"(module {spec.name!r}); drop the flag or pass the value config.json gives",
        )


def _shown(value: Any) -> str:
    return "llama3 scaling" if isinstance(value, RopeScaling) else repr(value)


def _connect_hidden_sizes(model: MultimodalSpec) -> MultimodalSpec:
    """Producers hand over at their consumer's hidden size; a consumer conditioned on a producer
    (the DiT's `cond_hidden`) reads the producer's."""
    for producer in model.modules:
        if producer.feeds is None:
            continue
        consumer = model.module(producer.feeds)
        if producer.out_hidden and producer.out_hidden != consumer.layer.hidden:
            model = model.replace_module(producer.name, out_hidden=consumer.layer.hidden)
        if consumer.cond_hidden and consumer.cond_hidden != producer.layer.hidden:
            model = model.replace_module(consumer.name, cond_hidden=producer.layer.hidden)
    return model


def frozen_modules(config: TrainConfig, model: MultimodalSpec) -> set[str]:
    """The modules --freeze-LM, --freeze-ViT and --dip-freeze name."""
    out = {m.strip() for m in (config.model.dip_freeze or "").split(",") if m.strip()}
    names = [m.name for m in model.modules]
    for name in out:
        if name not in names:
            raise _fail("--dip-freeze", f"the model has no module {name!r} (modules: {names})")
    for flag, kind, on in (
        ("--freeze-LM", "llm", config.model.freeze_LM),
        ("--freeze-ViT", "vit", config.model.freeze_ViT),
    ):
        if not on:
            continue
        found = model.modules_of_kind(kind)
        if not found:
            raise _fail(flag, f"the model has no {kind} module")
        out |= {m.name for m in found}
    if len(out) == len(names):
        raise _fail("--dip-freeze", "every module is frozen: nothing would train")
    return out


def apply_architecture(config: TrainConfig, model: MultimodalSpec) -> MultimodalSpec:
    """The preset's `model` with the architecture flags applied (module docstring)."""
    model = _apply_hf_configs(config, model)
    for name, (shape, arch) in parse_dip_arch(config.architecture.dip_arch, model).items():
        spec = _changed(model.module(name), shape=shape, arch=arch, flag="--dip-arch")
        model = model.replace_module(name, layer=spec.layer, arch=spec.arch)
    loss = model.loss_module
    shape, arch = _megatron_changes(config, loss)
    folder = hf_folders(config, model).get(loss.name)
    if folder is not None:
        refuse_contradictions(loss, {**shape, **arch}, folder=folder)
    spec = _changed(loss, shape=shape, arch=arch, flag="--hidden-size/--rotary-base/...")
    model = model.replace_module(loss.name, layer=spec.layer, arch=spec.arch)
    for name in frozen_modules(config, model):
        model = model.replace_module(name, trainable=False)
    return _connect_hidden_sizes(model)
