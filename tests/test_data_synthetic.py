"""Synthetic mixtures: one seeded stream for metadata and tensors, paper-like distributions."""

import numpy as np
import pytest

from megatron_dip.batching import loss_tokens_of
from megatron_dip.data.meta import sample_meta
from megatron_dip.data.packing import PackingLimits, pack_microbatches
from megatron_dip.data.sample import IMAGE_TOKEN
from megatron_dip.data.synthetic import (
    MIXTURES,
    SyntheticSource,
    generate_meta,
    generate_samples,
    get_mixture,
)
from megatron_dip.modelspec import DIT_5B, PAPER_SETUPS, tiny_omni, tiny_t2v, tiny_vlm

PAPER_VLM = PAPER_SETUPS["vlm-s"].model
PAPER_T2V = PAPER_SETUPS["t2v-s"].model
TINY = (tiny_vlm(), tiny_t2v(), tiny_omni())


@pytest.mark.parametrize("name", sorted(MIXTURES))
def test_samples_have_exactly_the_metadata_the_planner_sees(name):
    model = next(m for m in TINY if get_mixture(name).suits(m))
    kwargs = {"model": model, "num_samples": 40, "seed": 11, "start": 1000, "scale": 1 / 16}
    samples = generate_samples(name, **kwargs)
    metas = generate_meta(name, **kwargs)
    assert [sample_meta(s, model=model) for s in samples] == metas
    assert [m.sample_id for m in metas] == list(range(1000, 1040))
    # loss_tokens (part of the equality above) is what the models count as loss tokens.
    assert [m.loss_tokens for m in metas] == [loss_tokens_of(model, [s]) for s in samples]
    vocab = 128
    placeholders = [IMAGE_TOKEN, *(p.placeholder_id for p in model.modules_of_kind("audio"))]
    for s, m in zip(samples, metas):
        for p in model.modules_of_kind("audio"):  # no word uses the audio placeholder id
            assert (s.text == p.placeholder_id).sum() == sum(m.instances_of("audio").placeholders)
        words = s.text[~np.isin(s.text, placeholders)]
        assert words.min() >= 2 and words.max() < vocab and s.text.dtype == np.int64
        assert all(x.dtype == np.float32 for xs in s.media.values() for x in xs)


def test_stream_is_seeded_and_any_range_is_reproducible():
    a = generate_meta("mixed", model=PAPER_VLM, num_samples=3000, seed=5)
    b = generate_meta("mixed", model=PAPER_VLM, num_samples=1000, seed=5, start=1500)
    assert a[1500:2500] == b
    assert a != generate_meta("mixed", model=PAPER_VLM, num_samples=3000, seed=6)
    src = SyntheticSource("mixed", model=PAPER_VLM, seed=5)
    assert src.metas([1023, 1024, 7, 2999]) == [a[1023], a[1024], a[7], a[2999]]


def test_generate_meta_at_paper_scale_is_seeded():
    """10k paper-scale samples (the simulation's batches): the seed alone fixes them, and a
    shorter draw is their prefix (no wall-clock assertion: speed belongs to benchmarks)."""
    metas = generate_meta("mixed", model=PAPER_VLM, num_samples=10_000, seed=0)
    assert len(metas) == 10_000
    assert generate_meta("mixed", model=PAPER_VLM, num_samples=10_000, seed=0) == metas
    assert generate_meta("mixed", model=PAPER_VLM, num_samples=10_000, seed=1) != metas
    assert generate_meta("mixed", model=PAPER_VLM, num_samples=100, seed=0) == metas[:100]


def test_laion_packs_up_to_about_48_images_of_169_tokens():
    metas = generate_meta("laion", model=PAPER_VLM, num_samples=2000, seed=0)
    assert {m.instances_of("vit").placeholders for m in metas} == {(169,)}
    assert {m.instances_of("vit").tokens for m in metas} == {(52 * 52,)}  # 728 px, patch 14
    packing = pack_microbatches(metas, seq_length=8192)
    images = [mb.num_instances for mb in packing[:-1]]
    assert 40 <= max(images) <= 48 and np.mean(images) > 35
    assert all(mb.text_tokens <= 8192 for mb in packing)


def test_obelics_documents_interleave_text_and_images():
    metas = generate_meta("obelics", model=PAPER_VLM, num_samples=2000, seed=0)
    counts = np.array([m.num_instances for m in metas])
    text = np.array([m.text_tokens - 169 * m.num_instances for m in metas])
    assert counts.min() == 0 and counts.max() == 6
    assert text.min() >= 300 and text.max() <= 3000
    (s,) = generate_samples(
        "obelics", model=tiny_vlm(), num_samples=1, seed=0, start=3, scale=1 / 16
    )
    runs = np.flatnonzero(np.diff((s.text == IMAGE_TOKEN).astype(int)) == 1)
    assert len(runs) == len(s.media["vit"])  # separate runs: text between images


def test_interleaved_documents_open_with_an_image_as_often_as_uniform_positions_say():
    """Whether a document's first token is an image (then no word is lost as a loss target)
    comes from the metadata stream: P = images / words, as for uniform distinct positions."""
    kwargs = {"model": tiny_vlm(), "num_samples": 300, "seed": 2, "scale": 1 / 16}
    samples = generate_samples("obelics", **kwargs)
    metas = generate_meta("obelics", **kwargs)
    opens = np.array([s.text[0] == IMAGE_TOKEN for s in samples])
    words = np.array([(s.text != IMAGE_TOKEN).sum() for s in samples])
    assert [m.loss_tokens for m in metas] == (words - ~opens).tolist()
    expected = sum(len(s.media["vit"]) / w for s, w in zip(samples, words))
    assert opens.sum() > 0 and abs(opens.sum() - expected) < 4 * np.sqrt(expected) + 1


def test_text_only_has_no_images():
    metas = generate_meta("text-only", model=PAPER_VLM, num_samples=500, seed=0)
    assert all(m.num_instances == 0 for m in metas)


def test_t2v_clips_follow_16fps_4x_causal_vae_and_patch_2():
    metas = generate_meta("t2v", model=PAPER_T2V, num_samples=3000, seed=0)
    frames = np.array([m.frames for m in metas])
    assert frames.min() == 1 + (32 - 1) // 4 and frames.max() == 64  # 2 s .. 16 s at 16 FPS
    per_frame = {m.instance_tokens // m.frames for m in metas}
    assert per_frame == {16 * 16, 16 * 28}  # 256x256 and 256x448 / 448x256 px, 8x VAE, patch 2
    t2i = generate_meta("t2i", model=PAPER_T2V, num_samples=100, seed=0)
    assert {m.frames for m in t2i} == {1}
    (s,) = generate_samples("t2v", model=tiny_t2v(), num_samples=1, seed=0, scale=1 / 16)
    t, c, h, w = s.media["dit"][0].shape
    assert c == 4 and h % 2 == 0 and w % 2 == 0 and s.labels_mask is None


def _dit_flops(mb):
    """Forward FLOPs of one DiT-5B layer on a microbatch: linear layers plus per-clip attention."""
    h, f = DIT_5B.hidden, DIT_5B.ffn
    tokens = np.array(mb.instances_of("dit").tokens, dtype=np.float64)
    return float((tokens * (8 * h * h + 4 * h * f) + 4 * h * tokens**2).sum())


def test_vision_work_per_microbatch_varies_several_fold():
    """DESIGN section 1: after packing, vision work differs several-fold between microbatches
    (the paper: 4.15x heaviest/lightest for text-to-video)."""
    mixed = generate_meta("mixed", model=PAPER_VLM, num_samples=4000, seed=0)
    mbs = pack_microbatches(mixed, seq_length=8192)[:-1]
    vit = [sum(mb.instances_of("vit").tokens) for mb in mbs]
    assert max(vit) / min(vit) >= 4
    t2v = generate_meta("t2v", model=PAPER_T2V, num_samples=2000, seed=0)
    mbs = pack_microbatches(t2v, limits=PackingLimits.t2v())[:-1]
    assert all(mb.num_instances <= 8 and mb.frames <= 64 for mb in mbs)
    work = [_dit_flops(mb) for mb in mbs]
    assert 3 <= max(work) / min(work) <= 6


def test_mismatched_model_and_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="needs a module of kind 'vit'"):
        generate_meta("laion", model=PAPER_T2V, num_samples=1, seed=0)
    with pytest.raises(ValueError, match="multiple of 56"):
        generate_meta("laion", model=PAPER_VLM, num_samples=1, seed=0, image_size=700)
    with pytest.raises(KeyError, match="presets"):
        get_mixture("webvid")
    metas = generate_meta("laion", model=PAPER_VLM, num_samples=3, seed=0, image_size=448)
    assert metas[0].instances_of("vit").placeholders == (64,)


@pytest.mark.parametrize("name", ["t2v", "t2i"])
def test_image_size_overrides_every_frame_grid_of_a_diffusion_mixture(name):
    """Regression: the per-sample grid draw indexed a one-entry tuple (IndexError)."""
    model = tiny_t2v()
    kwargs = {"model": model, "num_samples": 40, "seed": 0, "scale": 1 / 64}
    plain = generate_meta(name, **kwargs)
    sized = generate_meta(name, image_size=16, **kwargs)
    assert len({m.instance_tokens // m.frames for m in sized}) == 1
    assert [m.frames for m in sized] == [m.frames for m in plain]  # same draws otherwise
    samples = generate_samples(name, image_size=16, **{**kwargs, "num_samples": 6})
    assert [sample_meta(s, model=model) for s in samples] == sized[:6]
    assert {s.media["dit"][0].shape[2:] for s in samples} == {(2, 2)}
