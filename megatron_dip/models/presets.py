"""Named model presets: the tiny test models and the paper's models (torch-free).

The shapes are those of `megatron_dip.modelspec` (tiny_vlm, tiny_t2v, tiny_omni, PAPER_SETUPS), so a preset
means the same model to the cost model, the planner and the builders in this package.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_dip.modelspec import PAPER_SETUPS, MultimodalSpec, tiny_omni, tiny_t2v, tiny_vlm

_TINY: dict[str, Callable[[], MultimodalSpec]] = {
    "tiny-vlm": tiny_vlm,
    "tiny-t2v": tiny_t2v,
    "tiny-omni": tiny_omni,
}


def preset_names() -> list[str]:
    """All preset names: the tiny models, then the paper setups (vlm-s, ..., t2v-l)."""
    return [*_TINY, *PAPER_SETUPS]


def model_preset(name: str) -> MultimodalSpec:
    """The `MultimodalSpec` of a preset: "tiny-vlm", "tiny-t2v", "tiny-omni" or a paper setup name."""
    if name in _TINY:
        return _TINY[name]()
    if name in PAPER_SETUPS:
        return PAPER_SETUPS[name].model
    raise KeyError(f"unknown model preset {name!r}; known: {preset_names()}")
