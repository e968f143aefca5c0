"""`megatron_dip.megatron_compat`'s release differences that no other module's tests cover."""

from __future__ import annotations

import warnings

from megatron_dip import megatron_compat
from megatron_dip.emulation.chunk import emulated_config
from megatron_dip.modalities import modality_of
from megatron_dip.models import ModelConfig
from megatron_dip.models.common import transformer_config
from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.parallel import ONE_PROCESS


def _megatron_warnings(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if "megatron" in w.filename]


def test_the_configs_we_build_draw_no_warning_from_megatron():
    # 0.16's own default cuda_graph_scope="full" warned once per config built (every chunk of
    # every rank) in runs that use no CUDA graph; 0.19's default is quiet.
    llm = PAPER_SETUPS["vlm-s"].model.module("llm")
    style = modality_of(llm).layer_style(llm)
    assert (
        _megatron_warnings(
            lambda: transformer_config(llm, ModelConfig(), shape=ONE_PROCESS, style=style)
        )
        == []
    )
    assert _megatron_warnings(emulated_config) == []
    config = transformer_config(llm, ModelConfig(), shape=ONE_PROCESS, style=style)
    # the whole layer, as "full" meant, where a CUDA graph is asked for
    assert getattr(config, "cuda_graph_modules", config.cuda_graph_scope) == []


def test_quiet_defaults_replace_only_a_default_that_warns():
    from megatron.core.transformer import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    quiet = megatron_compat.quiet_config_defaults()
    assert len(quiet) == 1 and all(value == [] for value in quiet.values())
    assert all(fields[name].default == "full" for name in quiet)
