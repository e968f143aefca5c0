"""The registry of modality kinds: a module's kind -> its `Modality` (torch-free).

`register` adds a kind (the built-in ones are registered by `modalities/__init__.py`); `modality`
and `modality_of` look one up and refuse an unknown kind with the known ones named;
`check_model` runs every module's own checks (`Modality.check_spec`) once for a model.
"""

from __future__ import annotations

from megatron_dip.modelspec import ModuleSpec, MultimodalSpec

from .base import Modality

_REGISTRY: dict[str, Modality] = {}


def register(modality: Modality) -> Modality:
    """Register `modality` under its `kind`; a kind can be registered once."""
    kind = modality.kind
    if not kind:
        raise ValueError(f"{type(modality).__name__} has no kind")
    if kind in _REGISTRY and type(_REGISTRY[kind]) is not type(modality):
        raise ValueError(f"modality kind {kind!r} is already registered")
    _REGISTRY[kind] = modality
    return modality


def known_kinds() -> list[str]:
    """The registered kinds, in registration order."""
    return list(_REGISTRY)


def modality(kind: str) -> Modality:
    """The modality of `kind`; KeyError naming the known kinds otherwise."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise KeyError(f"unknown modality kind {kind!r}; known kinds: {known_kinds()}") from None


def modality_of(spec: ModuleSpec) -> Modality:
    """The modality of a module."""
    try:
        return modality(spec.kind)
    except KeyError as err:
        raise KeyError(f"module {spec.name!r}: {err.args[0]}") from None


def check_model(model: MultimodalSpec) -> MultimodalSpec:
    """Run every module's kind-specific checks; returns `model` (ValueError on a bad one)."""
    for spec in model.modules:
        modality_of(spec).check_spec(spec, model)
    return model


def media_modules(model: MultimodalSpec) -> list[ModuleSpec]:
    """The modules whose instances are media (images, clips, audio), not text, in model order."""
    return [m for m in model.modules if not modality_of(m).reads_text]


def text_module(model: MultimodalSpec) -> ModuleSpec:
    """The module that reads the token ids (the LLM or the text encoder)."""
    found = [m for m in model.modules if modality_of(m).reads_text]
    if len(found) != 1:
        raise ValueError(
            f"model {model.name!r}: exactly one module must read the text, got "
            f"{[m.name for m in found]}"
        )
    return found[0]
