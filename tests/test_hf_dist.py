"""Hugging Face families imported by 4 gloo ranks at TP=2 x PP=2 (tools/hf_checkpoint.py, each
rank writing its slices) and compared with transformers after loading at TP=1 (Qwen3, Mistral,
LLaVA with CLIP / SigLIP towers, Qwen2.5-VL), the LLaVA import exported back; a LLaVA (CLIP tower
+ Llama) imported there and fine-tuned under DIP with falling loss. One 4-process launch of its
own (`hf_world4`): the shared training launch of test_training_dist.py is at its time limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from distributed_harness import run_world
from hf_models import save_llava, save_mistral, save_qwen2_5_vl, save_qwen3

pytestmark = pytest.mark.distributed


def hf_world4(*, rank: int, world_size: int, data: str, tmp: str, folders: dict) -> dict:
    """The 4-rank target: every family's import, then the LLaVA fine-tune."""
    import logging

    from test_training_scenarios import COMMON

    del rank
    logging.getLogger("megatron").setLevel(logging.ERROR)
    out = family_imports(folders, tmp=tmp)
    base = COMMON + ["--dip-data", f"llava:{data}"]
    out.update(llava_runs(base, hf=folders["llava"], tmp=tmp, world_size=world_size))
    return out


def family_imports(folders: dict[str, str], *, tmp: str) -> dict:
    """tools/hf_checkpoint.py's import at TP=2 x PP=2 on these 4 ranks of each Hugging Face
    folder alone (no --model); the test compares the checkpoints with transformers."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "hf_checkpoint.py"
    spec = importlib.util.spec_from_file_location("hf_checkpoint_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = {}
    for family, folder in folders.items():
        save = os.path.join(tmp, f"import_{family}")
        argv = ["import", "--dip-hf-config", folder, "--save", save]
        argv += ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
        out[f"import_{family}"] = {"rc": tool.main(argv), "save": save}
    return out


def llava_runs(base: list[str], *, hf: str, tmp: str, world_size: int) -> dict:
    """A LLaVA model (CLIP tower + Llama) imported at TP=2 x PP=2 with the tiny-vlm preset's
    flags and fine-tuned under DIP at TP=2 x PP=2 for 6 iterations on images processed by its
    own preprocessor_config.json (CLIP's resize + crop to the base resolution)."""
    from test_training_scenarios import _import, run

    imported = os.path.join(tmp, "hf_llava_import")
    flags = base + ["--dip-hf-config", hf, "--dip-image-processor", hf, "--dip-lookahead", "0"]
    flags += ["--dip-segments", "vit=1,llm=1", "--calculate-per-token-loss"]
    flags += ["--dip-calibration-frozen"]
    result = _import(flags, save=imported, tp=2, pp=2)
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    tuned = flags + tp2pp2 + ["--pretrained-checkpoint", imported, "--train-iters", "6"]
    return {"llava": run(tuned, world_size=world_size), "llava_kept": list(result.initialised)}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    from megatron_dip.data.tiny_llava import make_tiny_llava_sample

    tmp = tmp_path_factory.mktemp("hf_dist")
    data = make_tiny_llava_sample(tmp / "llava", num_samples=32, seed=0)
    families = {
        "qwen3": save_qwen3, "mistral": save_mistral,
        "llava": lambda d: save_llava(d, image_token=1),  # the byte tokenizer's image id
        "llava_siglip": lambda d: save_llava(d, tower="siglip", image_token=1),
        "qwen2_5_vl": save_qwen2_5_vl,
    }  # fmt: skip
    for family, save in families.items():
        save(tmp / f"hf_{family}")
    return run_world(
        world_size=4,
        target="test_hf_dist:hf_world4",
        kwargs={
            "data": str(data),
            "tmp": str(tmp),
            "folders": {f: str(tmp / f"hf_{f}") for f in families},
        },
        timeout=600,
        daemon=False,  # the checkpoint writer starts a process of its own
    )


def _imported_chunks(world, family: str, groups):
    """(model, {module: one chunk}, folder) of `family`'s TP=2 x PP=2 import, loaded at TP=1."""
    from hf_models import hf_vlm_model

    from megatron_dip.cpu_support import seed_model_parallel_rng
    from megatron_dip.modalities import build_module_chunks
    from megatron_dip.models import ModelConfig
    from megatron_dip.training.checkpoint.state import load_weights

    result = world[0][f"import_{family}"]
    assert [w[f"import_{family}"]["rc"] for w in world] == [0] * 4
    folder = Path(result["save"]).parent / f"hf_{family}"
    seed_model_parallel_rng(0)
    model = hf_vlm_model(folder)
    chunks = {}
    for m in model.modules:
        (chunks[m.name],) = build_module_chunks(
            model, m.name, [(0, m.num_layers)], config=ModelConfig(), groups=groups
        )
    assert load_weights(result["save"], model=model, chunks=list(chunks.values())) == 0
    return model, chunks, folder


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_a_family_imported_at_tp2_pp2_matches_transformers(world, family, single_rank_world):
    """Qwen3 and Mistral imported alone (no --model) by 4 ranks at TP=2 x PP=2, each writing its
    slices: loaded into one TP=1 chunk, the logits of transformers' model within 1e-4."""
    from test_hf_parity import TOLERANCE, _documents, _our_logits_and_loss, _reference
    from transformers import AutoModelForCausalLM

    from megatron_dip.models.chunk import ModelGroups

    groups = ModelGroups(tp=single_rank_world, cp=single_rank_world)
    model, chunks, folder = _imported_chunks(world, family, groups)
    docs = _documents()
    ours, _, _ = _our_logits_and_loss(model, chunks["llm"], docs)
    theirs, _ = _reference(AutoModelForCausalLM.from_pretrained(folder).eval(), docs)
    start = 0
    for doc, ref in zip(docs, theirs, strict=True):
        assert float((ours[start : start + len(doc)] - ref).abs().max()) <= TOLERANCE
        start += len(doc)


@pytest.mark.parametrize("family, tower", [("llava", "clip"), ("llava_siglip", "siglip")])
def test_llava_imported_at_tp2_pp2_matches_transformers(world, family, tower, single_rank_world):
    """LLaVA (CLIP / SigLIP tower + Llama) imported alone by 4 ranks at TP=2 x PP=2: features,
    logits and loss of transformers' model (on its own processor's images) within 1e-4."""
    from test_hf_parity import compare_llava
    from transformers import LlavaForConditionalGeneration

    from megatron_dip.models.chunk import ModelGroups

    groups = ModelGroups(tp=single_rank_world, cp=single_rank_world)
    model, chunks, folder = _imported_chunks(world, family, groups)
    hf_model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    compare_llava(model, chunks, hf_model, tower=tower, tokens=16)


def test_qwen2_5_vl_imported_at_tp2_pp2_matches_transformers(world, single_rank_world):
    """Qwen2.5-VL (window attention tower + M-RoPE LLM) imported alone by 4 ranks at TP=2 x
    PP=2: features, logits and loss of transformers' model (on its own processor's pictures)
    within 1e-4."""
    import numpy as np
    from test_hf_parity import _qwen2_5_vl_sample, compare_qwen2_5_vl
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_dip.models.chunk import ModelGroups

    groups = ModelGroups(tp=single_rank_world, cp=single_rank_world)
    model, chunks, folder = _imported_chunks(world, "qwen2_5_vl", groups)
    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    sample, pixels = _qwen2_5_vl_sample(np.random.default_rng(5))
    compare_qwen2_5_vl(model, chunks, hf_model, sample, pixels)


def test_llava_imported_at_tp2_pp2_exports_bit_exact(world, tmp_path, single_rank_world):
    """The tower layers LLaVA never runs, carried by the TP=2 x PP=2 import's ranks, come back
    bit-exact in the export (one process), with every other tensor."""
    import torch
    from safetensors.torch import load_file
    from test_hf_checkpoint import _tool

    result = world[0]["import_llava"]
    folder = Path(result["save"]).parent / "hf_llava"
    argv = ["export", "--dip-hf-config", str(folder), "--load", result["save"]]
    assert _tool().main([*argv, "--hf-out", str(tmp_path / "out")]) == 0
    before = load_file(folder / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after) and "vision_tower.post_layernorm.weight" in after
    assert all(torch.equal(t, after[name]) for name, t in before.items())


def test_an_imported_llava_fine_tunes_under_dip_with_falling_loss(world):
    """A LLaVA (CLIP tower + Llama) imported at TP=2 x PP=2 and fine-tuned under DIP on the 4
    ranks at TP=2 x PP=2 from iteration 0: every weight from the checkpoint, falling loss."""
    tuned = world[0]["llava"]
    assert tuned["first"] == 0 and sorted(tuned["losses"]) == list(range(1, 7))
    losses = tuned["losses"]
    assert losses[6] < losses[1] - 0.05, losses
    assert all(w["llava_kept"] == [] for w in world)
