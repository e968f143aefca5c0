"""Our chunks against Hugging Face `transformers` on the same weights (megatron_dip.hf):
tiny random Llama (tied and untied, llama3 rope scaling) and Qwen2 (q/k/v biases) decoders,
fp32, two documents packed in one sequence; Qwen2-VL (vision tower with Conv3d patches, blocked
2-D rotary, quick_gelu and merger; LLM with M-RoPE) on two images of different sizes in one
sequence. Logits and loss must agree to 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import LAYERS, VOCAB, llm_only, save_llama, save_qwen2

from megatron_dip.data.sample import Sample
from megatron_dip.hf.names import decoder_maps
from megatron_dip.hf.weights import SafetensorsFolder, fill_chunk
from megatron_dip.modalities import build_module_chunks, build_sub_batch
from megatron_dip.models import ModelConfig
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.schedule.ir import SubMicrobatch

SEQ = 96
DOCS = (41, 37)  # two documents packed in one sequence, then padding
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    from megatron_dip.cpu_support import seed_model_parallel_rng

    seed_model_parallel_rng(0)  # Megatron's attention reads its RNG tracker
    return ModelGroups(tp=single_rank_world, cp=single_rank_world)


def _documents() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(1, VOCAB, size=n).astype(np.int64) for n in DOCS]


def _our_chunk(folder, groups):
    model = llm_only(folder)
    (chunk,) = build_module_chunks(
        model, "llm", [(0, LAYERS)], config=ModelConfig(dtype="float32"), groups=groups
    )
    kept = fill_chunk(chunk, SafetensorsFolder(folder), decoder_maps(model.module("llm")))
    assert kept == []  # every parameter comes from the checkpoint
    return model, chunk


def _our_logits_and_loss(model, chunk, docs):
    samples = [Sample(i, d) for i, d in enumerate(docs)]
    sub = SubMicrobatch("llm", 0, 0, 0, 1, SEQ, SEQ)
    batch = build_sub_batch(model, samples, sub, seq_length=SEQ, seed=0)
    with torch.no_grad():
        state = chunk.parts.embed(chunk, [], batch)
        hidden = chunk.post.final_norm(chunk.parts.run_layers(chunk, state, batch))
        tied = chunk.module_spec.arch.tie_embeddings
        weight = chunk.pre.word_embeddings.weight if tied else None
        logits, _ = chunk.post.output_layer(hidden, weight=weight)
        out = chunk(inputs=[], batch=batch)
    return logits[:, 0], out["loss"], int(out["num_tokens"])


def _reference(hf_model, docs):
    """Per-document logits of the Hugging Face model and its summed next-token loss."""
    logits, total = [], 0.0
    with torch.no_grad():
        for d in docs:
            ids = torch.from_numpy(d)[None]
            out = hf_model(input_ids=ids, labels=ids)
            logits.append(out.logits[0])
            total += float(out.loss) * (len(d) - 1)
    return logits, total


def _compare(folder, hf_model, groups) -> float:
    model, chunk = _our_chunk(folder, groups)
    docs = _documents()
    ours, loss, tokens = _our_logits_and_loss(model, chunk, docs)
    theirs, total = _reference(hf_model, docs)
    start, worst = 0, 0.0
    for d, ref in zip(docs, theirs, strict=True):
        worst = max(worst, float((ours[start : start + len(d)] - ref).abs().max()))
        start += len(d)
    assert tokens == sum(len(d) - 1 for d in docs)
    assert float(loss) == pytest.approx(total, rel=1e-5)
    return worst


@pytest.mark.parametrize("tied", [False, True])
def test_llama_with_llama3_rope_scaling_matches_transformers(tmp_path, groups, tied):
    hf_model = save_llama(tmp_path, tied=tied)
    assert _compare(tmp_path, hf_model, groups) <= TOLERANCE


def test_qwen2_with_qkv_biases_matches_transformers(tmp_path, groups):
    hf_model = save_qwen2(tmp_path)
    assert _compare(tmp_path, hf_model, groups) <= TOLERANCE


def test_qwen3_with_qk_norms_and_explicit_head_dim_matches_transformers(tmp_path, groups):
    from hf_models import save_qwen3

    hf_model = save_qwen3(tmp_path)
    assert _compare(tmp_path, hf_model, groups) <= TOLERANCE


def test_mistral_without_a_sliding_window_matches_transformers(tmp_path, groups):
    from hf_models import save_mistral

    hf_model = save_mistral(tmp_path)
    assert _compare(tmp_path, hf_model, groups) <= TOLERANCE


def test_the_architecture_options_matter(tmp_path, groups):
    """Without the llama3 scaling (what the presets built before) the logits differ: the
    comparison above can fail."""
    hf_model = save_llama(tmp_path, tied=False)
    model, chunk = _our_chunk(tmp_path, groups)
    plain = model.replace_module("llm", arch={"rope_scaling": None})
    chunk.module_spec = plain.module("llm")
    chunk.model_spec = plain
    docs = _documents()
    ours, _, _ = _our_logits_and_loss(plain, chunk, docs)
    theirs, _ = _reference(hf_model, docs)
    assert float((ours[: DOCS[0]] - theirs[0]).abs().max()) > 100 * TOLERANCE


def _vl_sample(rng):
    """Text, a 16x24-px image (4x6 patches -> 2x3 LLM tokens), text, a 16x16 one (2x2), text."""
    from hf_models import IMAGE_TOKEN_ID

    images = [rng.standard_normal((3, 16, 24)), rng.standard_normal((3, 16, 16))]
    text = [rng.integers(9, VOCAB, 10), np.full(6, IMAGE_TOKEN_ID), rng.integers(9, VOCAB, 7)]
    text += [np.full(4, IMAGE_TOKEN_ID), rng.integers(9, VOCAB, 9)]
    images = [i.astype(np.float32) for i in images]
    return Sample(0, np.concatenate(text).astype(np.int64), {"vit": images})


def _hf_vl_reference(hf_model, sample, spec):
    """Image embeddings, logits and summed next-token loss of the Hugging Face model (the
    patches in its image processor's layout: what our conv3d patchify writes)."""
    from megatron_dip.modalities.vit import patchify_image

    pixels = [
        patchify_image(i, patch=spec.patch_size, merge=spec.merge, frames=2)[0]
        for i in sample.media["vit"]
    ]
    grid = [
        [1, i.shape[1] // spec.patch_size, i.shape[2] // spec.patch_size]
        for i in sample.media["vit"]
    ]
    ids = torch.from_numpy(sample.text)[None]
    kwargs = {
        "input_ids": ids, "pixel_values": torch.from_numpy(np.concatenate(pixels)),
        "image_grid_thw": torch.tensor(grid), "mm_token_type_ids": (ids == spec.placeholder_id).int(),
    }  # fmt: skip
    with torch.no_grad():
        features = hf_model.model.get_image_features(
            kwargs["pixel_values"], kwargs["image_grid_thw"]
        )
        out = hf_model(**kwargs, labels=ids.masked_fill(ids == spec.placeholder_id, -100))
    embeds = torch.cat(list(features.pooler_output), dim=0)
    return embeds, out.logits[0], out.loss


def test_qwen2_vl_vision_tower_and_mrope_llm_match_transformers(tmp_path, groups):
    from hf_models import qwen2_vl_model, save_qwen2_vl

    from megatron_dip.hf.names import module_maps

    hf_model = save_qwen2_vl(tmp_path)
    model = qwen2_vl_model(tmp_path)
    source, config = SafetensorsFolder(tmp_path), ModelConfig(dtype="float32")
    chunks = {}
    for m in model.modules:
        (chunks[m.name],) = build_module_chunks(
            model, m.name, [(0, m.num_layers)], config=config, groups=groups
        )
        assert fill_chunk(chunks[m.name], source, module_maps(m, source.where)) == []
    sample = _vl_sample(np.random.default_rng(5))
    vit_sub = SubMicrobatch("vit", 0, 0, 0, 2, 40, 40)
    with torch.no_grad():
        vit_batch = build_sub_batch(model, [sample], vit_sub, seq_length=SEQ, seed=0)
        handed = chunks["vit"](inputs=[], batch=vit_batch)
    embeds, logits, loss = _hf_vl_reference(hf_model, sample, model.module("vit"))
    assert float((handed["vit.embeddings"] - embeds).abs().max()) <= TOLERANCE
    _assert_llm_matches(model, chunks["llm"], sample, handed, logits=logits, loss=loss)


def _assert_llm_matches(model, llm, sample, handed, *, logits, loss) -> None:
    """Our LLM chunk on `sample` with the vision tower's hand-over `handed`: its logits within
    TOLERANCE of transformers' `logits`, and its loss per target token equal to `loss`
    (transformers averages over the targets that are not placeholders; ours sums them)."""
    batch = build_sub_batch(
        model, [sample], SubMicrobatch("llm", 0, 0, 0, 1, SEQ, SEQ), seq_length=SEQ, seed=0
    )
    with torch.no_grad():
        state = llm.parts.embed(llm, [handed], batch)
        hidden = llm.post.final_norm(llm.parts.run_layers(llm, state, batch))
        ours, _ = llm.post.output_layer(hidden)
        out = llm(inputs=[handed], batch=batch)
    n = len(sample.text)
    assert float((ours[:n, 0] - logits).abs().max()) <= TOLERANCE
    assert float(out["loss"] / out["num_tokens"]) == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_options_keep_chunking_invariance(tmp_path, groups, family):
    """The Qwen2-VL options (Conv3d patches, blocked rotary, M-RoPE positions) and Qwen2.5-VL's
    (window attention per global layer, RMSNorm, gated MLP) under a pipelined layout: split
    chunks and one image per sub-microbatch give the loss and gradients of one chunk per
    module (fp64)."""
    from hf_models import hf_vlm_model, save_qwen2_5_vl, save_qwen2_vl

    from megatron_dip.reference import reference_loss_and_grads

    {"qwen2_vl": save_qwen2_vl, "qwen2_5_vl": save_qwen2_5_vl}[family](tmp_path)
    model, config = hf_vlm_model(tmp_path), ModelConfig(dtype="float64", seed=3)
    batch = [[_vl_sample(np.random.default_rng(5))]]
    one = reference_loss_and_grads(
        model, batch, seed=0, seq_length=SEQ, groups=groups, config=config
    )
    split = reference_loss_and_grads(
        model,
        batch,
        seed=0,
        seq_length=SEQ,
        groups=groups,
        config=config,
        ranges={"vit": [(0, 1), (1, model.module("vit").num_layers)], "llm": [(0, 1), (1, 3)]},
        sizes={"vit": 1},
    )
    assert one[0] == pytest.approx(split[0], rel=1e-12)
    assert one[1].keys() == split[1].keys()
    for name, grad in one[1].items():
        torch.testing.assert_close(grad, split[1][name], rtol=1e-9, atol=1e-12, msg=name)
    assert all(g.abs().sum() > 0 for g in one[1].values())


def test_qwen2_5_vl_window_layers_keep_their_scope_under_grouped_recompute(tmp_path, groups):
    """Recompute's layer groups (uniform, all three tower layers in one checkpointed call) run
    each member with its own attention scope: window layers within windows, the full layer over
    the whole image. The loss and gradients equal the ungrouped run's (fp64)."""
    from hf_models import hf_vlm_model, save_qwen2_5_vl

    from megatron_dip.reference import LocalPipeline
    from megatron_dip.runtime.recompute import grouped_layers
    from megatron_dip.schedule.ir import Recompute

    save_qwen2_5_vl(tmp_path)
    model, config = hf_vlm_model(tmp_path), ModelConfig(dtype="float64", seed=3)
    vit = model.module("vit")
    assert 0 < len(vit.arch.full_attention_layers) < vit.num_layers  # the group mixes both
    batch = [[_vl_sample(np.random.default_rng(5))]]
    pipe = LocalPipeline.build(model, config=config, groups=groups, seq_length=SEQ, seed=0)
    plain = float(pipe.forward_backward(batch))
    plain_grads = {n: g.clone() for n, g in pipe.grads().items()}
    pipe.zero_grad()
    with grouped_layers(pipe.chunks["vit"][0], Recompute.UNIFORM, vit.num_layers):
        grouped = float(pipe.forward_backward(batch))
    assert grouped == pytest.approx(plain, rel=1e-12)
    for name, grad in pipe.grads().items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-9, atol=1e-12, msg=name)


def _llava_sample(rng, tower: str, *, tokens: int, placeholder: int) -> tuple[Sample, list]:
    """Text, an image, text, another image, text; the images through transformers' own
    processor (non-square pictures: CLIP resizes the short side and crops, SigLIP squashes)."""
    from hf_models import llava_processor
    from PIL import Image

    pictures = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        for h, w in ((20, 27), (31, 18))
    ]
    pixels = [llava_processor(tower)(p, return_tensors="np")["pixel_values"][0] for p in pictures]
    text = [rng.integers(9, VOCAB, 7), np.full(tokens, placeholder), rng.integers(9, VOCAB, 5)]
    text += [np.full(tokens, placeholder), rng.integers(9, VOCAB, 6)]
    sample = Sample(0, np.concatenate(text).astype(np.int64), {"vit": pixels})
    return sample, pixels


@pytest.mark.parametrize(
    "tower, strategy, tokens",
    [("clip", "default", 16), ("clip", "full", 17), ("siglip", "full", 16)],
)
def test_llava_towers_and_projector_match_transformers(tmp_path, groups, tower, strategy, tokens):
    """LLaVA with a CLIP tower (class token, learned positions, pre-norm, quick_gelu, features
    of layer -2, with and without the class token) or a SigLIP one (gelu-tanh, patch bias),
    the two-layer projector and a Llama LLM: image features, logits and loss to 1e-4."""
    from hf_models import hf_vlm_model, save_llava

    from megatron_dip.hf.names import module_maps

    hf_model = save_llava(tmp_path, tower=tower, strategy=strategy)
    model = hf_vlm_model(tmp_path)
    source, config = SafetensorsFolder(tmp_path), ModelConfig(dtype="float32")
    chunks = {}
    for m in model.modules:
        (chunks[m.name],) = build_module_chunks(
            model, m.name, [(0, m.num_layers)], config=config, groups=groups
        )
        assert fill_chunk(chunks[m.name], source, module_maps(m, source.where)) == []
    compare_llava(model, chunks, hf_model, tower=tower, tokens=tokens)


def compare_llava(model, chunks, hf_model, *, tower: str, tokens: int) -> None:
    """Our ViT and LLM `chunks` (one each) against the Hugging Face LLaVA `hf_model` on two
    processed images in one sequence: image features, logits and loss to 1e-4."""
    strategy = hf_model.config.vision_feature_select_strategy
    placeholder = model.module("vit").placeholder_id
    sample, pixels = _llava_sample(
        np.random.default_rng(5), tower, tokens=tokens, placeholder=placeholder
    )
    per_image = 16 + (tower == "clip")  # patches and the class token
    with torch.no_grad():
        vit_batch = build_sub_batch(
            model,
            [sample],
            SubMicrobatch("vit", 0, 0, 0, 2, per_image * 2, 40),
            seq_length=SEQ,
            seed=0,
        )
        handed = chunks["vit"](inputs=[], batch=vit_batch)
        ids = torch.from_numpy(sample.text)[None]
        pixel_values = torch.from_numpy(np.stack(pixels))
        features = hf_model.model.get_image_features(
            pixel_values,
            vision_feature_layer=hf_model.config.vision_feature_layer,
            vision_feature_select_strategy=strategy,
        ).pooler_output
        labels = ids.masked_fill(ids == placeholder, -100)
        out_hf = hf_model(input_ids=ids, pixel_values=pixel_values, labels=labels)
    embeds = torch.cat(list(features), dim=0)
    assert embeds.shape[0] == 2 * tokens
    assert float((handed["vit.embeddings"] - embeds).abs().max()) <= TOLERANCE
    _assert_llm_matches(
        model, chunks["llm"], sample, handed, logits=out_hf.logits[0], loss=out_hf.loss
    )


def _qwen2_5_vl_sample(rng) -> tuple[Sample, dict]:
    """Text, a 21x37-px picture, text, a 14x15 one, text, through transformers' own processor
    (resized to 24x40 and 16x16: 6x10 patches, windows of 2x2 merged tokens cut at the right
    and bottom edges; 4x4 patches, one window); the Hugging Face model's image inputs."""
    from hf_models import IMAGE_TOKEN_ID, qwen_vl_pixels
    from PIL import Image

    pictures = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        for h, w in ((21, 37), (14, 15))
    ]
    pixels, grid, images = qwen_vl_pixels(pictures)
    tokens = [h * w // 4 for _, h, w in grid.tolist()]
    assert tokens == [15, 4]
    text = [rng.integers(9, VOCAB, 10), np.full(15, IMAGE_TOKEN_ID), rng.integers(9, VOCAB, 7)]
    text += [np.full(4, IMAGE_TOKEN_ID), rng.integers(9, VOCAB, 9)]
    sample = Sample(0, np.concatenate(text).astype(np.int64), {"vit": images})
    return sample, {
        "pixel_values": torch.from_numpy(pixels),
        "image_grid_thw": torch.from_numpy(grid),
    }


def test_qwen2_5_vl_window_attention_tower_and_mrope_llm_match_transformers(tmp_path, groups):
    """Qwen2.5-VL: vision tower with window attention (layers 0 and 2 within windows, 1 over
    the whole image; RMSNorm, gated MLP with biases), its merger and the M-RoPE LLM, on two
    pictures of transformers' own processor in one sequence: features, logits, loss to 1e-4."""
    from hf_models import hf_vlm_model, save_qwen2_5_vl

    from megatron_dip.hf.names import module_maps
    from megatron_dip.modalities.vit import patchify_image

    hf_model = save_qwen2_5_vl(tmp_path)
    model = hf_vlm_model(tmp_path)
    assert model.module("vit").arch.full_attention_layers == (1,)
    source, config = SafetensorsFolder(tmp_path), ModelConfig(dtype="float32")
    chunks = {}
    for m in model.modules:
        (chunks[m.name],) = build_module_chunks(
            model, m.name, [(0, m.num_layers)], config=config, groups=groups
        )
        assert fill_chunk(chunks[m.name], source, module_maps(m, source.where)) == []
    sample, pixels = _qwen2_5_vl_sample(np.random.default_rng(5))
    ours_pixels = [patchify_image(i, patch=4, merge=2, frames=2)[0] for i in sample.media["vit"]]
    assert np.array_equal(np.concatenate(ours_pixels), pixels["pixel_values"].numpy())
    compare_qwen2_5_vl(model, chunks, hf_model, sample, pixels)


def compare_qwen2_5_vl(model, chunks, hf_model, sample: Sample, pixels: dict) -> None:
    """Our ViT and LLM `chunks` against the Hugging Face Qwen2.5-VL `hf_model` on `sample`
    (`pixels`: its processor's inputs): image features, logits and loss to 1e-4."""
    ids = torch.from_numpy(sample.text)[None]
    placeholder = model.module("vit").placeholder_id
    with torch.no_grad():
        vit_batch = build_sub_batch(
            model, [sample], SubMicrobatch("vit", 0, 0, 0, 2, 76, 80), seq_length=SEQ, seed=0
        )
        handed = chunks["vit"](inputs=[], batch=vit_batch)
        features = hf_model.model.get_image_features(**pixels).pooler_output
        labels = ids.masked_fill(ids == placeholder, -100)
        out_hf = hf_model(
            input_ids=ids, mm_token_type_ids=(ids == placeholder).int(), labels=labels, **pixels
        )
    embeds = torch.cat(list(features), dim=0)
    assert float((handed["vit.embeddings"] - embeds).abs().max()) <= TOLERANCE
    _assert_llm_matches(
        model, chunks["llm"], sample, handed, logits=out_hf.logits[0], loss=out_hf.loss
    )
