"""sample_meta: token arithmetic and validation messages that name the sample."""

import subprocess
import sys

import numpy as np
import pytest

from megatron_dip.data.meta import sample_meta
from megatron_dip.data.sample import IMAGE_TOKEN, InstanceCounts, Sample, SampleMeta, loss_targets
from megatron_dip.modalities.dit import clip_tokens
from megatron_dip.modalities.vit import image_tokens
from megatron_dip.modelspec import PAPER_SETUPS, tiny_t2v, tiny_vlm

VLM = tiny_vlm()  # ViT patch 8, merge 2 -> images in multiples of 16 pixels
T2V = tiny_t2v()  # DiT patch 2, 4 latent channels


def _vlm_sample(sid=7, sizes=((32, 48),), text_before=3, text_after=4):
    parts, images = [np.full(text_before, 5)], []
    for h, w in sizes:
        parts += [np.full((h // 16) * (w // 16), IMAGE_TOKEN), np.full(2, 6)]
        images.append(np.zeros((3, h, w), np.float32))
    parts.append(np.full(text_after, 7))
    text = np.concatenate(parts).astype(np.int64)
    return Sample(sid, text, {"vit": images}, (text != IMAGE_TOKEN).astype(np.uint8))


def test_paper_vit_image_is_169_llm_tokens():
    vit = PAPER_SETUPS["vlm-s"].model.module("vit")
    assert image_tokens(height=728, width=728, vit=vit) == (52 * 52, 169)


def test_vlm_meta_counts_patches_and_merged_tokens():
    s = _vlm_sample(sizes=((32, 48), (16, 16)))
    meta = sample_meta(s, model=VLM)
    # 11 words, 7 placeholders; every word but the first is a target
    assert meta == SampleMeta(7, 18, {"vit": InstanceCounts((4 * 6, 2 * 2), (6, 1))}, 10)
    assert meta.num_instances == 2


def test_loss_tokens_count_labelled_targets_never_the_first_token_or_placeholders():
    """labels_mask[j] = 1: token j is predicted (by position j - 1); see data/sample.py."""
    text = np.array([IMAGE_TOKEN] * 6 + [5, 6, 7, 8, 9], dtype=np.int64)
    image = {"vit": [np.zeros((3, 32, 48), np.float32)]}
    assert sample_meta(Sample(1, text, image), model=VLM).loss_tokens == 5  # image first
    mask = np.array([0] * 6 + [0, 0, 1, 1, 1], dtype=np.uint8)  # a 2-token prompt
    assert sample_meta(Sample(1, text, image, mask), model=VLM).loss_tokens == 3
    words = np.array([5, 6, 7], dtype=np.int64)
    assert sample_meta(Sample(2, words), model=VLM).loss_tokens == 2  # first is no target
    first_labelled = np.array([1, 0, 1], dtype=np.uint8)
    assert sample_meta(Sample(2, words, {}, first_labelled), model=VLM).loss_tokens == 1
    np.testing.assert_array_equal(loss_targets(words, first_labelled), [False, False, True])
    # Hand-built metadata gets an estimate; the data side always sets the exact count.
    assert SampleMeta(3, 20, {"vit": InstanceCounts((24,), (6,))}).loss_tokens == 13
    assert SampleMeta(3, 20, {"dit": InstanceCounts((60,), (), (5,))}).loss_tokens == 60


def test_adjacent_images_share_one_placeholder_run():
    text = np.array([5] + [IMAGE_TOKEN] * (6 + 1) + [5])
    images = [np.zeros((3, 32, 48), np.float32), np.zeros((3, 16, 16), np.float32)]
    meta = sample_meta(Sample(3, text, {"vit": images}), model=VLM)
    assert meta.instances_of("vit").placeholders == (6, 1)


def test_diffusion_meta_counts_latent_tokens_and_frames():
    clip = np.zeros((5, 4, 6, 8), np.float32)
    meta = sample_meta(Sample(2, np.array([9, 10, 11]), {"dit": [clip]}), model=T2V)
    assert meta == SampleMeta(2, 3, {"dit": InstanceCounts((5 * 3 * 4,), (), (5,))}, 60)
    assert clip_tokens(frames=5, height=6, width=8, dit=T2V.module("dit")) == 60


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda s: Sample(s.sample_id, s.text, {"vit": [np.zeros((3, 32, 40), np.float32)]}),
            "multiple of patch\\*merge",
        ),
        (lambda s: Sample(s.sample_id, s.text[:-8], s.media), "placeholder"),
        (lambda s: Sample(s.sample_id, np.array([IMAGE_TOKEN] * 3), s.media), "only 3 tokens"),
        (
            lambda s: Sample(s.sample_id, np.where(s.text == 5, 500, s.text), s.media),
            "token ids must lie",
        ),
        (
            lambda s: Sample(s.sample_id, s.text, {"vit": [np.zeros((1, 32, 48), np.float32)]}),
            "must be \\[3, H, W\\]",
        ),
        (
            lambda s: Sample(s.sample_id, s.text, s.media, np.ones(s.text.size, np.uint8)),
            "labels_mask marks",
        ),
        (
            lambda s: Sample(s.sample_id, s.text, s.media, np.ones(2, np.uint8)),
            "labels_mask has shape",
        ),
    ],
)
def test_vlm_errors_name_the_sample(mutate, message):
    bad = mutate(_vlm_sample(sid=41))
    with pytest.raises(ValueError, match=f"sample 41: .*{message}"):
        sample_meta(bad, model=VLM)


def test_run_that_splits_an_image_is_rejected():
    # 7 placeholders in runs of 3 and 4 for images of 6 and 1 tokens: totals agree, runs do not.
    text = np.array([5] + [IMAGE_TOKEN] * 3 + [5] + [IMAGE_TOKEN] * 4)
    images = [np.zeros((3, 32, 48), np.float32), np.zeros((3, 16, 16), np.float32)]
    with pytest.raises(ValueError, match="sample 9: placeholder run 0 has 3 tokens"):
        sample_meta(Sample(9, text, {"vit": images}), model=VLM)


def test_diffusion_errors_name_the_sample():
    clip = np.zeros((2, 4, 6, 8), np.float32)
    with pytest.raises(ValueError, match="sample 5: .*one latent clip"):
        sample_meta(Sample(5, np.array([3]), {"dit": [clip, clip]}), model=T2V)
    with pytest.raises(ValueError, match="sample 5: .*multiples of the DiT patch"):
        sample_meta(
            Sample(5, np.array([3]), {"dit": [np.zeros((2, 4, 5, 8), np.float32)]}), model=T2V
        )
    with pytest.raises(ValueError, match="sample 5: .*\\[T, 4, h, w\\]"):
        sample_meta(
            Sample(5, np.array([3]), {"dit": [np.zeros((2, 3, 6, 8), np.float32)]}), model=T2V
        )
    with pytest.raises(ValueError, match="sample 5: the caption is empty"):
        sample_meta(Sample(5, np.array([], np.int64), {"dit": [clip]}), model=T2V)


def test_data_package_imports_neither_torch_nor_megatron():
    code = (
        "import sys\n"
        "import megatron_dip.data.diffusion, megatron_dip.data.llava, megatron_dip.data.stream\n"
        "import megatron_dip.data.synthetic, megatron_dip.data.tiny_llava\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
