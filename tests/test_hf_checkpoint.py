"""Hugging Face checkpoints in and out (tools/hf_checkpoint.py, training/hf_checkpoint.py,
megatron_dip/hf/weights.py): sliced per-rank reads, import -> export bit-exact and loadable by
`transformers`, the importer's log of what it initialised. One process; tiny random models."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from hf_models import llm_only, save_llama, save_mistral, save_qwen2, save_qwen2_vl, save_qwen3
from safetensors.torch import load_file
from test_models import _TensorParallelRank

from megatron_dip.hf.names import decoder_maps
from megatron_dip.hf.weights import SafetensorsFolder, fill_chunk
from megatron_dip.modalities import build_module_chunks
from megatron_dip.models import ModelConfig
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.init import global_param_name, is_gated_fc1, shard_for_rank

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("hf_checkpoint", ROOT / "tools/hf_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _filled(folder, world, tp):
    """{global name: (chunk, local name, parameter)} of the LLM filled at TP rank tp, and the
    bytes read."""
    model = llm_only(folder)
    groups = ModelGroups(tp=tp, cp=world)
    chunks = build_module_chunks(
        model, "llm", [(0, 2), (2, 3)], config=ModelConfig(), groups=groups
    )
    source = SafetensorsFolder(folder)
    maps = decoder_maps(model.module("llm"))
    for c in chunks:
        assert fill_chunk(c, source, maps) == []
    params = {global_param_name(c, n): (c, n, p) for c in chunks for n, p in c.named_parameters()}
    return params, source.bytes_read


def test_each_tensor_parallel_rank_reads_only_its_slices(tmp_path, single_rank_world):
    from megatron_dip.cpu_support import seed_model_parallel_rng

    seed_model_parallel_rng(0)
    save_llama(tmp_path, tied=False)
    full, full_bytes = _filled(tmp_path, single_rank_world, single_rank_world)
    on_disk = sum(
        t.numel() * t.element_size() for t in load_file(tmp_path / "model.safetensors").values()
    )
    assert full_bytes == on_disk  # TP1 reads every tensor once
    replicated = sum(
        p.numel() * 4 for c, n, p in full.values() if not getattr(p, "tensor_model_parallel", False)
    )
    read = []
    for rank in range(2):
        shards, nbytes = _filled(tmp_path, single_rank_world, _TensorParallelRank(rank, 2))
        read.append(nbytes)
        for name, (chunk, local, whole) in full.items():
            shard = shards[name][2]
            glu = is_gated_fc1(chunk, local)
            expected = shard_for_rank(whole.detach(), shard, tp_rank=rank, tp_size=2, glu=glu)
            assert torch.equal(shard.detach(), expected), name
    # every sharded element is read by one rank only; replicated ones (norms) by both
    assert read[0] == read[1] == (on_disk - replicated) // 2 + replicated


@pytest.mark.parametrize(
    "make",
    [
        lambda d: save_llama(d, tied=False),
        lambda d: save_llama(d, tied=True),
        save_qwen2,
        save_qwen3,
        save_mistral,
    ],
    ids=["llama", "llama-tied", "qwen2", "qwen3", "mistral"],
)
def test_import_then_export_is_bit_exact_and_loads_in_transformers(
    tmp_path, make, caplog, single_rank_world
):
    hf = tmp_path / "hf"
    original = make(hf)
    tool = _tool()
    flags = ["--model", "tiny-vlm", "--dip-hf-config", f"llm={hf}"]
    with caplog.at_level(logging.INFO):
        assert tool.main(["import", *flags, "--save", str(tmp_path / "ours")]) == 0
    assert "not in the Hugging Face checkpoint, initialised" in caplog.text
    assert "vit.pre.patch_embed.weight" in caplog.text  # the ViT and projector: as in training
    out = tmp_path / "exported"
    assert tool.main(
        ["export", *flags, "--load", str(tmp_path / "ours"), "--module", "llm", "--hf-out", str(out)]
    ) == 0  # fmt: skip
    before, after = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, original(input_ids=ids).logits)
    assert type(loaded) is type(original)


def test_a_tied_checkpoint_imported_untied_starts_its_head_as_the_embedding(
    tmp_path, single_rank_world
):
    hf = tmp_path / "hf"
    original = save_llama(hf, tied=True)
    tool = _tool()
    flags = ["--model", "tiny-vlm", "--dip-hf-config", f"llm={hf}"]
    flags += ["--untie-embeddings-and-output-weights"]
    assert tool.main(["import", *flags, "--save", str(tmp_path / "ours")]) == 0
    out = tmp_path / "exported"
    assert (
        tool.main(["export", *flags, "--load", str(tmp_path / "ours"), "--hf-out", str(out)]) == 0
    )
    after = load_file(out / "model.safetensors")
    assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not loaded.config.tie_word_embeddings
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, original(input_ids=ids).logits)


def test_a_sharded_checkpoint_with_an_index_is_read_by_slices(tmp_path, single_rank_world):
    """save_pretrained's shards + model.safetensors.index.json: the same tensors as one file,
    read through the index, each TP rank reading its part of every shard."""
    save_llama(tmp_path / "one", tied=False)
    save_llama(tmp_path / "sharded", tied=False, shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    one, _ = _filled(tmp_path / "one", single_rank_world, single_rank_world)
    sharded, _ = _filled(tmp_path / "sharded", single_rank_world, single_rank_world)
    assert all(torch.equal(one[k][2], sharded[k][2]) for k in one)
    _, full = _filled(tmp_path / "sharded", single_rank_world, single_rank_world)
    _, half = _filled(tmp_path / "sharded", single_rank_world, _TensorParallelRank(1, 2))
    assert half < 0.6 * full


def test_llama_as_the_text_encoder_of_a_t2v_model(tmp_path, single_rank_world):
    """The T2V text encoder from a Llama folder: the decoder's tensors in, and out again as a
    bare LlamaModel (a text encoder has no head) that transformers loads."""
    hf = tmp_path / "hf"
    original = save_llama(hf, tied=False)
    tool = _tool()
    flags = ["--model", "tiny-t2v", "--dip-hf-config", f"text={hf}"]
    assert tool.main(["import", *flags, "--save", str(tmp_path / "ours")]) == 0
    out = tmp_path / "exported"
    assert (
        tool.main(["export", *flags, "--load", str(tmp_path / "ours"), "--hf-out", str(out)]) == 0
    )
    before, after = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    decoder = {k.removeprefix("model."): t for k, t in before.items() if k != "lm_head.weight"}
    assert sorted(decoder) == sorted(after)
    assert all(torch.equal(t, after[name]) for name, t in decoder.items())
    from transformers import AutoModel

    loaded = AutoModel.from_pretrained(out).eval()
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        hidden = original.model(input_ids=ids).last_hidden_state
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, hidden)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_import_then_export_is_bit_exact(tmp_path, single_rank_world, family):
    """A Qwen2-VL / Qwen2.5-VL folder gives both the ViT and the LLM (a bare --dip-hf-config
    DIR); the export writes the pair back as one folder of that family."""
    from hf_models import save_qwen2_5_vl

    hf = tmp_path / "hf"
    original = {"qwen2_vl": save_qwen2_vl, "qwen2_5_vl": save_qwen2_5_vl}[family](hf)
    tool = _tool()
    flags = ["--model", "tiny-vlm", "--dip-hf-config", str(hf)]
    assert tool.main(["import", *flags, "--save", str(tmp_path / "ours")]) == 0
    out = tmp_path / "exported"
    assert (
        tool.main(["export", *flags, "--load", str(tmp_path / "ours"), "--hf-out", str(out)]) == 0
    )
    before, after = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(t, after[name]) for name, t in before.items())
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(loaded) is type(original)
    ids = torch.arange(9, 40)[None]
    kwargs = {"input_ids": ids, "mm_token_type_ids": torch.zeros_like(ids, dtype=torch.int)}
    with torch.no_grad():
        assert torch.equal(loaded(**kwargs).logits, original(**kwargs).logits)


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_import_then_export_is_bit_exact(tmp_path, single_rank_world, tower):
    """A LLaVA folder alone (no --model): the tower layers after vision_feature_layer, the
    post-layernorm and SigLIP's head, which the model never runs, ride through our checkpoint
    as frozen carried tensors; the export writes every tensor back bit-exact, a config that
    transformers loads, and the same logits on an image."""
    from hf_models import LLAVA_IMAGE, save_llava
    from transformers import LlavaForConditionalGeneration

    hf = tmp_path / "hf"
    original = save_llava(hf, tower=tower)
    tool = _tool()
    flags = ["--dip-hf-config", str(hf)]
    assert tool.main(["import", *flags, "--save", str(tmp_path / "ours")]) == 0
    out = tmp_path / "exported"
    assert (
        tool.main(["export", *flags, "--load", str(tmp_path / "ours"), "--hf-out", str(out)]) == 0
    )
    before, after = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert any(".layers.2." in n or "post_layernorm" in n for n in before)
    assert all(torch.equal(t, after[name]) for name, t in before.items())
    loaded = LlavaForConditionalGeneration.from_pretrained(out).eval()
    for key in ("vision_feature_layer", "vision_feature_select_strategy"):
        assert getattr(loaded.config, key) == getattr(original.config, key)
    tokens = 16 + (original.config.vision_feature_select_strategy == "full" and tower == "clip")
    ids = torch.cat([torch.arange(9, 20), torch.full((tokens,), 5), torch.arange(20, 30)])[None]
    pixels = torch.randn(1, 3, LLAVA_IMAGE, LLAVA_IMAGE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = loaded(input_ids=ids, pixel_values=pixels).logits
        assert torch.equal(got, original(input_ids=ids, pixel_values=pixels).logits)


def test_import_and_export_refuse_missing_flags(tmp_path, single_rank_world):
    tool = _tool()
    with pytest.raises(SystemExit, match="--dip-hf-config"):
        tool.main(["import", "--model", "tiny-vlm", "--save", str(tmp_path)])
    with pytest.raises(SystemExit, match="--hf-out"):
        tool.main(["export", "--model", "tiny-vlm", "--load", str(tmp_path), "--module", "llm"])
    with pytest.raises(SystemExit, match="--module"):
        tool.main(["export", "--model", "tiny-vlm", "--load", str(tmp_path), "--hf-out", "x"])
    assert tool.main(["import", "--model", "tiny-vlm", "--dip-hf-config", str(tmp_path)]) == 2


def test_a_tied_qwen2_vl_as_transformers_5_saves_it_round_trips_tied(tmp_path, single_rank_world):
    """Trip-wire 1: tie_word_embeddings only at the top level (text settings nested in
    text_config): imported tied, exported without an lm_head, the same logits."""
    import json

    hf = tmp_path / "hf"
    original = save_qwen2_vl(hf, tied=True)
    saved = json.loads((hf / "config.json").read_text())
    assert saved["tie_word_embeddings"] and "tie_word_embeddings" not in saved["text_config"]
    tool = _tool()
    assert tool.main(["import", "--dip-hf-config", str(hf), "--save", str(tmp_path / "o")]) == 0
    out = tmp_path / "exported"
    args = ["export", "--load", str(tmp_path / "o"), "--module", "vit,llm", "--hf-out", str(out)]
    assert tool.main(args) == 0
    after = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in after
    assert sorted(after) == sorted(load_file(hf / "model.safetensors"))
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(loaded) is type(original)
    ids = torch.arange(9, 40)[None]
    kwargs = {"input_ids": ids, "mm_token_type_ids": torch.zeros_like(ids, dtype=torch.int)}
    with torch.no_grad():
        assert torch.equal(loaded(**kwargs).logits, original(**kwargs).logits)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-layers", "2"], "--num-layers: 2 contradicts num_hidden_layers / depth 3"),
        (["--rotary-base", "10000"], "--rotary-base: 10000.0 contradicts 500000.0 in"),
        (["--hidden-size", "4096"], "--hidden-size: 4096 contradicts 32 in"),
    ],
)
def test_megatron_flags_contradicting_config_json_are_refused(
    tmp_path, flags, message, caplog, single_rank_world
):
    """Trip-wire 2: one line naming the flag and both values; nothing is written. A flag that
    agrees with config.json (or that it leaves open) still applies."""
    hf = tmp_path / "hf"
    save_llama(hf, tied=False)
    tool = _tool()
    save = tmp_path / "ours"
    with caplog.at_level(logging.ERROR):
        assert tool.main(["import", "--dip-hf-config", str(hf), "--save", str(save), *flags]) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert message in line and f"{hf}" in line and "\n" not in line
    assert not save.exists()
    agreeing = ["--rotary-base", "500000", "--num-layers", "3", "--hidden-size", "32"]
    assert tool.main(["import", "--dip-hf-config", str(hf), "--save", str(save), *agreeing]) == 0


def test_export_writes_the_checkpoints_own_architecture_and_refuses_another_models(
    tmp_path, caplog, single_rank_world
):
    """Trip-wire 3: without --dip-hf-config the config.json is the checkpoint's (not the
    preset's); flags of another model are refused in one line naming both signatures."""
    import json

    hf = tmp_path / "hf"
    save_qwen3(hf)
    tool = _tool()
    assert tool.main(["import", "--dip-hf-config", str(hf), "--save", str(tmp_path / "o")]) == 0
    out = tmp_path / "exported"
    args = ["export", "--load", str(tmp_path / "o"), "--module", "llm", "--hf-out", str(out)]
    assert tool.main([*args, "--model", "tiny-vlm"]) == 2  # the preset's LLM: another model
    assert "was saved as ['llm', 'llm', 3, 32, 64, 4, 128]" in caplog.text
    assert not out.exists()
    assert tool.main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == (
        "qwen3",
        32,
        3,
    )
    assert (config["head_dim"], config["tie_word_embeddings"]) == (16, True)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen3ForCausalLM"


def test_export_carries_tokenizer_configs_and_the_source_dtype(tmp_path, single_rank_world):
    """Trip-wire 4: a bf16 source comes back bf16 (config and tensors agree), with its
    generation and preprocessor configs and the --tokenizer-model tokenizer."""
    import json

    from megatron_dip.data.tiny_tokenizer import make_tiny_tokenizer

    hf = tmp_path / "hf"
    save_llama(hf, tied=False, vocab=512).to(torch.bfloat16).save_pretrained(hf)
    (hf / "preprocessor_config.json").write_text('{"image_processor_type": "X"}')
    assert (hf / "generation_config.json").is_file()
    tokenizer = make_tiny_tokenizer(tmp_path / "tok", ["a tiny corpus of words", "more words"])
    tool = _tool()
    flags = ["--dip-hf-config", str(hf)]
    assert tool.main(["import", *flags, "--save", str(tmp_path / "o")]) == 0
    out = tmp_path / "exported"
    args = ["export", *flags, "--load", str(tmp_path / "o"), "--hf-out", str(out)]
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
    assert tool.main([*args, *tok]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    before, after = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, after[k]) for k, t in before.items())
    assert (out / "preprocessor_config.json").read_text() == '{"image_processor_type": "X"}'
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("more words").input_ids


def test_help_lists_every_flag_and_family_and_a_typo_is_one_line(capsys):
    """Trip-wire 5: --help names the families and the model flags; a mistyped flag one line."""
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    text = capsys.readouterr().out
    for family in ("llama", "mistral", "qwen2", "qwen3", "qwen2_vl"):
        assert f"  {family} " in text
    for flag in ("--dip-hf-config", "--hf-dtype", "--num-layers", "--tokenizer-model", "--save"):
        assert flag in text
    with pytest.raises(SystemExit):
        tool.main(["import", "--hiden-size", "3"])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unrecognized arguments: --hiden-size 3" in err


def test_an_llm_only_import_builds_only_the_llm(tmp_path, caplog, single_rank_world):
    """Trip-wire 5: no --model: only the folder's LLM is built and saved (nothing initialised),
    and training loads it per module."""
    from megatron_dip.training.checkpoint import storage
    from megatron_dip.training.checkpoint.dirs import find_resume

    hf = tmp_path / "hf"
    save_llama(hf, tied=False)
    tool = _tool()
    with caplog.at_level(logging.INFO):
        assert tool.main(["import", "--dip-hf-config", str(hf), "--save", str(tmp_path / "o")]) == 0
    assert "initialised" not in caplog.text
    saved = storage.tensor_metadata(find_resume(tmp_path / "o", None).path)
    assert saved and all(k.startswith("llm.") for k in saved)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-model-parallel-size", "3"], "TP=3 does not divide the heads (4)"),
        (["--pipeline-model-parallel-size", "2"], "world size 1 != TP x PP = 1 x 2"),
    ],
)
def test_sizes_that_cannot_import_are_one_line(tmp_path, flags, message, caplog, single_rank_world):
    """Trip-wire 6: divisibility and world size, before anything is built."""
    hf = tmp_path / "hf"
    save_llama(hf, tied=False)
    with caplog.at_level(logging.ERROR):
        args = ["import", "--dip-hf-config", str(hf), "--save", str(tmp_path / "o"), *flags]
        assert _tool().main(args) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert message in line and "\n" not in line


def test_import_into_a_directory_with_checkpoints_is_refused(tmp_path, caplog, single_rank_world):
    """Trip-wire 6: a second import into the same --save would overwrite its iter_0."""
    hf = tmp_path / "hf"
    save_llama(hf, tied=False)
    tool = _tool()
    args = ["import", "--dip-hf-config", str(hf), "--save", str(tmp_path / "o")]
    assert tool.main(args) == 0
    before = sorted(p.stat().st_mtime_ns for p in (tmp_path / "o").rglob("*") if p.is_file())
    with caplog.at_level(logging.ERROR):
        assert tool.main(args) == 2
    assert "holds checkpoints already (iterations [0])" in caplog.text
    after = sorted(p.stat().st_mtime_ns for p in (tmp_path / "o").rglob("*") if p.is_file())
    assert before == after


def test_a_llava_tower_tensor_neither_read_nor_carried_is_refused():
    """The carried tensors come from config.json: a folder holding tower tensors the config
    does not describe (so an export could not write them back) is refused naming them, and the
    export's config.json is the one the tensors were read with."""
    from transformers import LlavaConfig

    from megatron_dip.hf.config import hf_llava_config, model_of_config
    from megatron_dip.hf.names import llava_vision_maps

    vision = {
        "model_type": "clip_vision_model", "hidden_size": 24, "intermediate_size": 40,
        "num_attention_heads": 4, "num_hidden_layers": 3, "image_size": 16, "patch_size": 4,
    }  # fmt: skip
    config = LlavaConfig(vision_config=vision, vision_feature_layer=-2).to_dict()
    model = model_of_config(config)
    vit, llm = model.module("vit"), model.module("llm")
    assert vit.num_layers == 2 and ("post_layernorm.bias", (24,)) in vit.arch.carried
    names = {p.name for t in llava_vision_maps(vit, _llava_names(vit)).values() for p in t.pieces}
    assert "vision_tower.encoder.layers.2.mlp.fc2.weight" in names
    with pytest.raises(ValueError, match=r"1 tensors of the vision tower are neither read nor"):
        llava_vision_maps(vit, _llava_names(vit) | {"vision_tower.encoder.layers.3.mlp.fc1.weight"})
    written = hf_llava_config(vit, llm)
    assert (
        written["vision_feature_layer"] == -2 and written["vision_config"]["num_hidden_layers"] == 3
    )


def _llava_names(vit) -> set[str]:
    """The tensor names of a LLaVA folder (transformers' save_pretrained) with tower `vit`."""
    from megatron_dip.hf.names import llava_tower_maps

    maps = llava_tower_maps(vit, tower="vision_tower.", projector="multi_modal_projector.")
    return {p.name for t in maps.values() for p in t.pieces}
