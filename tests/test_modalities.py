"""The modality registry and protocol, and the audio encoder (the third modality) end to end on
one process: token arithmetic, conventions, per-segment convolutions, placeholder scatter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_dip.batching import split_samples
from megatron_dip.data.meta import sample_meta
from megatron_dip.data.sample import Sample
from megatron_dip.modalities import (
    build_module_chunks,
    build_sub_batch,
    check_model,
    known_kinds,
    modality,
    modality_of,
)
from megatron_dip.modalities.audio import frames_for_seconds
from megatron_dip.modalities.base import Modality
from megatron_dip.models import ModelConfig
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.modelspec import LayerShape, ModuleSpec, MultimodalSpec, tiny_omni
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import get_device
from megatron_dip.profiling import default_grid

CFG = ModelConfig(dtype="float64", seed=3)
OMNI = tiny_omni()  # audio: 8 mel bins, conv stride 2, 2 tokens pooled per LLM token, id 127
AUDIO_TOKEN = OMNI.module("audio").placeholder_id


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    from megatron_dip.cpu_support import seed_model_parallel_rng

    seed_model_parallel_rng(CFG.seed)  # Megatron's attention reads its RNG tracker
    return ModelGroups(tp=single_rank_world, cp=single_rank_world)


def test_registry_knows_the_five_kinds_and_names_them_for_an_unknown_one():
    assert set(known_kinds()) >= {"vit", "llm", "text_encoder", "dit", "audio"}
    assert all(isinstance(modality(k), Modality) and modality(k).kind == k for k in known_kinds())
    spec = ModuleSpec("ear", "sonar", 2, LayerShape(8, 16, 2, 2))
    with pytest.raises(KeyError, match="module 'ear': unknown modality kind 'sonar'; known"):
        modality_of(spec)


def test_kind_specific_fields_are_checked_by_their_modality():
    layer = LayerShape(8, 16, 2, 2)
    llm = ModuleSpec("llm", "llm", 2, layer, vocab_size=32)
    no_out = ModuleSpec("audio", "audio", 2, layer, feeds="llm", placeholder_id=31)
    with pytest.raises(ValueError, match="needs out_hidden"):
        check_model(MultimodalSpec("m", (no_out, llm)))
    outside = ModuleSpec("audio", "audio", 2, layer, feeds="llm", out_hidden=8, placeholder_id=99)
    with pytest.raises(ValueError, match="placeholder id 99 outside the vocabulary of 32"):
        check_model(MultimodalSpec("m", (outside, llm)))
    with pytest.raises(ValueError, match="needs vocab_size"):
        check_model(MultimodalSpec("m", (ModuleSpec("llm", "llm", 2, layer),)))
    assert check_model(OMNI) is OMNI


def test_every_modality_prices_its_layers_and_names_a_profile_grid():
    cost = CostModel(OMNI, get_device("h100"))
    for m in OMNI.modules:
        tokens, instances = default_grid(m).tokens, default_grid(m).instances
        assert tokens and instances
        assert (
            cost.layer_params(m.name) > 0 and cost.module_time(m.name, instances=2, tokens=64) > 0
        )


def _mel(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((8, frames)).astype(np.float32)


def _omni_sample(sample_id: int, segments: list[int], images: int = 0) -> Sample:
    """Audio placeholder runs (frames / 4 LLM tokens each) first, then images, then words."""
    parts = [np.full(f // 4, AUDIO_TOKEN) for f in segments]
    parts += [np.full(1, 1)] * images + [np.arange(5, 12)]
    image = np.zeros((3, 16, 16), np.float32)
    media = {"audio": [_mel(f, sample_id + k) for k, f in enumerate(segments)]}
    media["vit"] = [image] * images
    return Sample(sample_id, np.concatenate(parts).astype(np.int64), media)


def test_audio_token_arithmetic_and_metadata():
    audio = OMNI.module("audio")
    assert frames_for_seconds(audio, 30.0) == 3000  # Whisper: 30 s -> 3000 frames -> 1500 tokens
    assert frames_for_seconds(audio, 0.001) == 4  # at least one LLM token
    meta = sample_meta(_omni_sample(3, [8, 20], images=1), model=OMNI)
    assert meta.instances_of("audio").tokens == (4, 10)  # frames / stride 2
    assert meta.instances_of("audio").placeholders == (2, 5)  # tokens / pool 2
    assert meta.instances_of("vit").placeholders == (1,)
    assert meta.text_tokens == 2 + 5 + 1 + 7 and meta.loss_tokens == 7  # words after placeholders


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.media["audio"].__setitem__(0, _mel(6, 0)), "not a positive multiple of"),
        (lambda s: s.media["audio"].__setitem__(0, np.zeros((5, 8), np.float32)), "8 mel bins"),
        (lambda s: s.media["audio"].append(_mel(8, 1)), "audio segments need"),
    ],
)
def test_audio_conventions_are_checked_naming_the_sample(mutate, message):
    sample = _omni_sample(41, [8])
    mutate(sample)
    with pytest.raises(ValueError, match=f"sample 41: .*{message}"):
        sample_meta(sample, model=OMNI)


def _audio_sub(samples):
    subs = split_samples(OMNI, samples, microbatch=0, seq_length=64)
    return next(s for s in subs if s.module == "audio")


def test_audio_encoder_attends_and_convolves_within_each_segment(groups):
    """Changing one segment's mel frames changes only its own LLM embeddings: the convolutions
    pad at segment edges and attention stays inside a segment."""
    (chunk,) = build_module_chunks(OMNI, "audio", [(0, 4)], config=CFG, groups=groups)
    samples = [_omni_sample(0, [8, 12]), _omni_sample(1, [16])]
    sub = _audio_sub(samples)

    def run():
        batch = build_sub_batch(OMNI, samples, sub, seq_length=64, seed=0)
        return chunk(inputs=[], batch=batch)["audio.embeddings"]

    base = run()
    assert base.shape == (2 + 3 + 4, 32)  # one row per audio placeholder, segments in order
    samples[0].media["audio"][1] = samples[0].media["audio"][1] + 1.0  # the second segment
    changed = run()
    torch.testing.assert_close(changed[:2], base[:2], rtol=0, atol=0)
    torch.testing.assert_close(changed[5:], base[5:], rtol=0, atol=0)
    assert not torch.allclose(changed[2:5], base[2:5])


def test_audio_convolutions_are_whisper_s_on_each_segment(groups):
    """Chunk 0's subsampling equals torch's Conv1d stack applied to every segment alone."""
    (chunk,) = build_module_chunks(OMNI, "audio", [(0, 1), (1, 4)], config=CFG, groups=groups)[:1]
    samples = [_omni_sample(0, [8, 12])]
    batch = build_sub_batch(OMNI, samples, _audio_sub(samples), seq_length=64, seed=0)
    got = modality("audio").embed_media(chunk, batch)
    pre, f = chunk.pre, torch.nn.functional
    want = []
    for mel in samples[0].media["audio"]:
        x = torch.from_numpy(mel).double()[None]
        want.append(f.gelu(pre.conv2(f.gelu(pre.conv1(x))))[0].T)
    positions = batch.positions[:, 0].double()
    from megatron_dip.models.common import sinusoidal_embedding

    torch.testing.assert_close(got, torch.cat(want) + sinusoidal_embedding(positions, 32))


def test_llm_scatters_each_producer_into_its_own_placeholders(groups):
    model = OMNI
    (llm,) = build_module_chunks(model, "llm", [(0, 8)], config=CFG, groups=groups)
    samples = [_omni_sample(0, [8], images=2)]
    subs = split_samples(model, samples, microbatch=0, seq_length=64)
    batch = build_sub_batch(model, samples, subs[-1], seq_length=64, seed=0)
    image, audio = torch.randn(2, 32, dtype=torch.float64), torch.randn(2, 32, dtype=torch.float64)
    inputs = [{"vit.embeddings": image}, {"audio.embeddings": audio}]
    hidden = llm.parts.embed(llm, inputs, batch)["hidden"][:, 0]
    torch.testing.assert_close(hidden[batch.tensors["audio.positions"]], audio)
    torch.testing.assert_close(hidden[batch.tensors["vit.positions"]], image)
    with pytest.raises(ValueError, match="audio placeholders but no audio inputs"):
        llm.parts.embed(llm, inputs[:1], batch)
    with pytest.raises(ValueError, match="3 vit embeddings for 2 placeholder positions"):
        llm.parts.embed(llm, [{"vit.embeddings": torch.cat([image, image[:1]])}, inputs[1]], batch)


@pytest.mark.parametrize("rows, cols", [(2, 3), (3, 5), (4, 4), (5, 2)])
def test_vit_windows_are_transformers_windows(rows, cols):
    """`window_order` (windows of 2 x 2 merged tokens, cut at the edges) is Qwen2.5-VL's
    `get_vision_window_index` on a grid of rows x cols merged tokens."""
    from transformers.vision_utils import get_vision_window_index

    from megatron_dip.modalities.vit import window_order

    order, sizes = window_order(rows, cols, window=2)
    index, cu = get_vision_window_index(
        torch.tensor([[1, 2 * rows, 2 * cols]]), spatial_merge_size=2, window_size=16, patch_size=4
    )
    assert order.tolist() == index.tolist()
    assert (np.cumsum(sizes) * 4).tolist() == cu[1:].tolist()


def test_window_attention_options_are_checked():
    """Windows of whole merged tokens, on a ViT with rotary positions; full-attention layers
    among its layers: refused naming the module otherwise."""
    from megatron_dip.modelspec import Architecture

    layer = LayerShape(8, 16, 2, 2)
    llm = ModuleSpec("llm", "llm", 2, layer, vocab_size=32)

    def vit(**arch):
        spec = ModuleSpec(
            "vit", "vit", 3, layer, feeds="llm", out_hidden=8, placeholder_id=5, patch_size=4,
            merge=2, arch=Architecture(**arch),
        )  # fmt: skip
        return MultimodalSpec("m", (spec, llm))

    assert check_model(vit(window_size=16, full_attention_layers=(1,)))
    with pytest.raises(ValueError, match="window_size 12 must be a multiple of patch"):
        check_model(vit(window_size=12))
    with pytest.raises(ValueError, match=r"full_attention_layers \[3\] outside its 3 layers"):
        check_model(vit(window_size=16, full_attention_layers=(1, 3)))
    with pytest.raises(ValueError, match="need a positive window_size"):
        vit(full_attention_layers=(1,))
