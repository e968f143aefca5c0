"""Architecture flags (training/architecture.py): presets with real values, --dip-hf-config,
--dip-arch, Megatron-LM's shape/rotary/norm flags and the freeze flags, all refused early with
the flag named when wrong; what the chunks and the cost model then see (in-process)."""

from __future__ import annotations

import pytest

from megatron_dip.modalities import modality_of
from megatron_dip.modelspec import PAPER_SETUPS, RopeScaling
from megatron_dip.training.config.arguments import parse_config
from megatron_dip.training.config.validate import ConfigError, resolve

BASE = ["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1e-3"]


def _resolve(*extra: str, base=BASE):
    return resolve(parse_config([*base, *extra]), world_size=1, cuda=False)


ONE_LLM_CHUNK = ("--dip-segments", "vit=1,llm=1")


def _hf_llama_config(folder, **changes):
    from transformers import LlamaConfig

    fields = {
        "hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 128,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 512},
        **changes,
    }  # fmt: skip
    LlamaConfig(**fields).save_pretrained(folder)
    return str(folder)


def test_presets_carry_the_real_values_of_their_models():
    llama = PAPER_SETUPS["vlm-s"].model.module("llm").arch
    assert (llama.rotary_base, llama.norm_eps, llama.qkv_bias) == (500000.0, 1e-5, False)
    qwen = PAPER_SETUPS["vlm-m"].model.module("llm").arch
    assert (qwen.rotary_base, qwen.norm_eps, qwen.qkv_bias) == (1000000.0, 1e-6, True)
    text = PAPER_SETUPS["t2v-l"].model.module("text").arch
    assert text.qkv_bias and not text.tie_embeddings


def test_hf_config_gives_the_llm_and_the_vit_follows(tmp_path):
    spec = _resolve("--dip-hf-config", f"llm={_hf_llama_config(tmp_path)}", *ONE_LLM_CHUNK)
    llm = spec.model.module("llm")
    assert (llm.layer.hidden, llm.layer.ffn, llm.layer.heads, llm.layer.kv_groups) == (48, 96, 4, 2)
    assert llm.num_layers == 3 and llm.vocab_size == 128
    assert llm.arch.tie_embeddings and llm.arch.norm_eps == 1e-6
    assert llm.arch.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 512)
    assert spec.model.module("vit").out_hidden == 48  # the projector feeds the new width
    # a --num-layers that contradicts the config is refused (it would import a truncated
    # model), one that agrees applies
    with pytest.raises(ConfigError, match="^--num-layers: 2 contradicts .* 3 in .*config.json"):
        _resolve("--dip-hf-config", str(tmp_path), "--num-layers", "2", *ONE_LLM_CHUNK)
    same = _resolve("--dip-hf-config", str(tmp_path), "--num-layers", "3", *ONE_LLM_CHUNK)
    assert same.model.module("llm").num_layers == 3
    with pytest.raises(ConfigError, match="^--use-distributed-optimizer: .*tied .* 2 chunks"):
        _resolve("--dip-hf-config", str(tmp_path), "--use-distributed-optimizer")
    untied = _resolve("--dip-hf-config", str(tmp_path), "--untie-embeddings-and-output-weights")
    assert not untied.model.module("llm").arch.tie_embeddings


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ],
)
def test_hf_config_that_our_layers_cannot_compute_is_refused(tmp_path, changes, words):
    folder = _hf_llama_config(tmp_path, **changes)
    with pytest.raises(ConfigError, match=f"^--dip-hf-config: .*{words}"):
        _resolve("--dip-hf-config", folder)


def test_hf_config_flag_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="^--dip-hf-config: .*no config.json"):
        _resolve("--dip-hf-config", str(tmp_path))
    with pytest.raises(ConfigError, match="^--dip-hf-config: .*no module 'dit'"):
        _resolve("--dip-hf-config", f"dit={tmp_path}")
    with pytest.raises(ConfigError, match="^--dip-hf-config: .*does not describe module 'vit'"):
        _resolve("--dip-hf-config", f"vit={_hf_llama_config(tmp_path)}")


def test_dip_arch_sets_any_module_and_refuses_unknown_keys():
    spec = _resolve(
        "--dip-arch", "vit.activation=quick_gelu,vit.norm-epsilon=1e-6,llm.add-qkv-bias=1"
    )
    vit, llm = spec.model.module("vit"), spec.model.module("llm")
    assert modality_of(vit).activation(vit) == "quick_gelu" and vit.arch.norm_eps == 1e-6
    assert llm.arch.qkv_bias
    for bad, words in [
        ("vit.nope=1", "unknown key"),
        ("vit.activation=relu", "activation 'relu'"),
        ("xx.norm-epsilon=1", "no module 'xx'"),
        ("vit.add-qkv-bias=maybe", "true/false"),
        ("norm-epsilon", "MODULE.KEY=VALUE"),
    ]:
        with pytest.raises(ConfigError, match=f"^--dip-arch: .*{words}"):
            _resolve("--dip-arch", bad)


def test_megatron_flags_reach_the_loss_module_the_chunks_and_the_cost_model():
    plain = _resolve()
    spec = _resolve(
        "--rotary-base", "1e6", "--norm-epsilon", "1e-6", "--add-qkv-bias", "--use-rope-scaling",
        "--num-query-groups", "4", "--kv-channels", "16",
    )  # fmt: skip
    llm = spec.model.module("llm")
    assert (llm.arch.rotary_base, llm.arch.norm_eps, llm.arch.qkv_bias) == (1e6, 1e-6, True)
    assert llm.arch.rope_scaling.original_max_position_embeddings == 8192
    assert (llm.layer.kv_groups, llm.layer.head_dim, llm.layer.attention_width) == (4, 16, 64)
    assert spec.model.module("vit").arch == plain.model.module("vit").arch
    # the planner's parameter count sees the wider attention and the q/k/v biases
    old, new = plain.model.module("llm"), llm
    h = old.layer.hidden
    growth = modality_of(new).layer_params(new) - modality_of(old).layer_params(old)
    q_kv = lambda lay: lay.attention_width + 2 * lay.kv_groups * lay.head_dim  # noqa: E731
    assert growth == h * (q_kv(new.layer) - q_kv(old.layer)) + h * 32 + q_kv(new.layer)
    with pytest.raises(ConfigError, match="^--untie-embeddings-and-output-weights"):
        _resolve("--untie-embeddings-and-output-weights", base=["--model", "tiny-t2v", *BASE[2:]])


def test_transformer_config_of_a_module_has_its_options():
    from megatron_dip.models import ModelConfig
    from megatron_dip.models.common import transformer_config
    from megatron_dip.parallel import ONE_PROCESS

    llm = _resolve("--norm-epsilon", "1e-6", "--add-qkv-bias").model.module("llm")
    style = modality_of(llm).layer_style(llm)
    config = transformer_config(llm, ModelConfig(), shape=ONE_PROCESS, style=style)
    assert config.layernorm_epsilon == 1e-6 and config.add_qkv_bias and not config.add_bias_linear


def test_freeze_flags():
    spec = _resolve("--freeze-ViT")
    assert not spec.model.module("vit").trainable and spec.model.module("llm").trainable
    assert not _resolve("--dip-freeze", "llm").model.module("llm").trainable
    with pytest.raises(ConfigError, match="^--dip-freeze: every module"):
        _resolve("--freeze-ViT", "--freeze-LM")
    with pytest.raises(ConfigError, match="^--freeze-ViT: the model has no vit"):
        _resolve("--freeze-ViT", base=["--model", "tiny-t2v", *BASE[2:]])


def test_hf_vocabulary_is_kept_with_a_hf_tokenizer(tmp_path):
    """The checkpoint's rows are the vocabulary (not the tokenizer's padded size), as long as
    the tokenizer fits in it."""
    from megatron_dip.data.tiny_tokenizer import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(tmp_path / "tok", ["a tiny corpus of text"] * 4, vocab_size=300)
    hf = _hf_llama_config(tmp_path / "hf", vocab_size=320, tie_word_embeddings=False)
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
    spec = _resolve(*flags, "--dip-hf-config", hf, "--dip-data", "synthetic-text-only")
    assert spec.model.module("llm").vocab_size == 320  # padding would give 384
    small = _hf_llama_config(tmp_path / "small", vocab_size=128, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match="^--dip-hf-config: 128 is smaller than the tokenizer"):
        _resolve(*flags, "--dip-hf-config", small, "--dip-data", "synthetic-text-only")


def test_megatron_lms_num_query_groups_needs_group_query_attention():
    import argparse

    from megatron_dip.training.config.arguments import TrainConfig

    ns = argparse.Namespace(num_query_groups=1, group_query_attention=False)
    assert TrainConfig.from_namespace(ns).architecture.num_query_groups is None
    ns.group_query_attention = True
    assert TrainConfig.from_namespace(ns).architecture.num_query_groups == 1


def test_a_tied_llama_as_text_encoder_ties_nothing(tmp_path):
    """A text encoder has no head: a tied checkpoint's flag does not carry over."""
    folder = _hf_llama_config(tmp_path)  # tie_word_embeddings=True
    spec = _resolve("--dip-hf-config", folder, base=["--model", "tiny-t2v", *BASE[2:]])
    text = spec.model.module("text")
    assert text.layer.hidden == 48 and not text.arch.tie_embeddings
    assert spec.model.module("dit").cond_hidden == 48  # the DiT reads the new width
