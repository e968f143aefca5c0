"""Image preprocessing (`data.image`) against transformers' Qwen2-VL image processor (the PIL
backend, transformers' reference implementation without torchvision): the same resize grid and
pixel values within 1e-5; the processor config read from its own preprocessor_config.json."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from PIL import Image

from megatron_dip.data.image import ImageProcessor, ImageProcessorConfig, smart_resize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as reference_resize,
    )

SIZES = [(20, 30), (5, 5), (50, 70), (224, 224), (333, 1000), (1000, 40), (7, 300), (480, 640)]


def _image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed + height * 1000 + width)
    pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGBA").convert(mode)


def _as_qwen_patches(image: np.ndarray, *, patch: int, merge: int, temporal: int = 2) -> np.ndarray:
    """Our [C, H, W] image in Qwen2-VL's flattened patch layout (written independently of
    transformers': patch rows in merge windows, channel-major, the frame repeated in time)."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    rows = []
    for by in range(gh // merge):
        for bx in range(gw // merge):
            for my in range(merge):
                for mx in range(merge):
                    y, x = (by * merge + my) * patch, (bx * merge + mx) * patch
                    block = image[:, y : y + patch, x : x + patch]  # [C, p, p]
                    rows.append(np.stack([block] * temporal, axis=1).reshape(-1))
    return np.stack(rows)


@pytest.mark.parametrize(
    ("factor", "min_pixels", "max_pixels"),
    [(28, 3136, 12845056), (16, 256, 4096), (28, 3136, 200704)],
)
def test_smart_resize_is_qwen2_vl_rule(factor, min_pixels, max_pixels):
    for h in range(1, 1200, 37):
        for w in (1, 9, 28, 100, 517, 1199):
            if max(h, w) / min(h, w) > 200:
                continue
            ours = smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
            ref = reference_resize(
                h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
            )
            assert ours == tuple(ref), (h, w)
            assert ours[0] % factor == 0 and ours[1] % factor == 0


@pytest.mark.parametrize(("patch", "merge", "max_pixels"), [(14, 2, 28 * 28 * 64), (8, 2, 4096)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_pixels_and_grid_match_transformers(patch, merge, max_pixels, mode):
    min_pixels = (patch * merge) ** 2
    reference = Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=merge, min_pixels=min_pixels, max_pixels=max_pixels
    )
    config = ImageProcessorConfig(
        max_pixels=max_pixels,
        min_pixels=min_pixels,
        image_mean=tuple(reference.image_mean),
        image_std=tuple(reference.image_std),
    )
    ours = ImageProcessor(config, factor=patch * merge)
    for h, w in SIZES:
        image = _image(h, w, mode)
        expected = reference(images=[image], return_tensors="np")
        pixels = ours.preprocess(image)
        assert pixels.dtype == np.float32 and pixels.shape[0] == 3
        assert pixels.shape[1:] == ours.target_size(height=h, width=w)
        assert pixels.shape[1] * pixels.shape[2] <= max_pixels  # the one pixel limit
        t, gh, gw = expected["image_grid_thw"][0]
        if gh * gw * patch * patch > max_pixels:  # Qwen2-VL exceeds it (elongated image):
            short = min(gh, gw) * patch  # ours keeps its short side, cuts the long one back
            assert min(pixels.shape[1:]) == short == patch * merge, (h, w)
            assert max(pixels.shape[1:]) == max_pixels // short // short * short
            continue
        assert (1, pixels.shape[1] // patch, pixels.shape[2] // patch) == (t, gh, gw), (h, w)
        got = _as_qwen_patches(pixels, patch=patch, merge=merge)
        np.testing.assert_allclose(got, expected["pixel_values"], rtol=0, atol=1e-5)


def test_config_file_written_by_transformers_gives_the_same_pixels(tmp_path):
    reference = Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, min_pixels=256, max_pixels=2048
    )
    reference.save_pretrained(str(tmp_path))
    config = ImageProcessorConfig.from_file(tmp_path)  # the directory: preprocessor_config.json
    assert (config.min_pixels, config.max_pixels, config.patch_size, config.merge_size) == (
        256,
        2048,
        8,
        2,
    )
    image = _image(90, 61)
    pixels = ImageProcessor(config, factor=16).preprocess(image)
    expected = reference(images=[image], return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(_as_qwen_patches(pixels, patch=8, merge=2), expected, atol=1e-5)
    config.check_vit(patch=8, merge=2)
    with pytest.raises(ValueError, match=r"--dip-image-processor: .* 16 pixels .* 14 x 2 = 28"):
        config.check_vit(patch=14, merge=2)


def test_default_config_scales_pixels_to_minus_one_one_and_bounds_pixels():
    processor = ImageProcessor(ImageProcessorConfig(max_pixels=32 * 32), factor=16)
    white = Image.fromarray(np.full((400, 300, 3), 255, np.uint8))
    pixels = processor.preprocess(white)
    assert pixels.shape[1] * pixels.shape[2] <= 32 * 32 and np.allclose(pixels, 1.0)
    with pytest.raises(ValueError, match="aspect ratio"):
        processor.target_size(height=1, width=500)
    with pytest.raises(ValueError, match="smaller than one grid unit"):
        ImageProcessor(ImageProcessorConfig(max_pixels=100), factor=16)


def test_a_huge_jpeg_decodes_at_a_reduced_scale_and_an_ordinary_one_whole(tmp_path):
    """Pillow's draft for photos of more than 64x their target's pixels (a 10000 x 10000 one
    took about 1 s to decode whole); ordinary sizes and PNGs are decoded whole."""
    from megatron_dip.data.llava import ImageFile

    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, (1024, 768, 3), dtype=np.uint8)
    Image.fromarray(big).save(tmp_path / "big.jpg", quality=90)
    Image.fromarray(big).save(tmp_path / "big.png")
    processor = ImageProcessor(ImageProcessorConfig(max_pixels=64 * 64), factor=16)
    target = processor.target_size(height=1024, width=768)
    reduced = ImageFile(tmp_path / "big.jpg").open(target=target)
    assert reduced.size[0] < 768 and reduced.size[0] >= 2 * target[1]
    assert reduced.size[1] >= 2 * target[0]
    assert processor.preprocess(reduced).shape == (3, *target)
    assert ImageFile(tmp_path / "big.png").open(target=target).size == (768, 1024)
    assert ImageFile(tmp_path / "big.jpg").open(target=(1024, 768)).size == (768, 1024)


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("size", [(20, 27), (31, 18), (16, 16), (300, 41)])
def test_clip_and_siglip_processor_configs_give_transformers_pixels(tmp_path, tower, size):
    """The fixed-resolution policies of LLaVA's towers read from the preprocessor_config.json
    that transformers writes: CLIP's short-side resize + centre crop, SigLIP's resize to
    height x width; the pixels of its PIL processor (its default without torchvision)."""
    from hf_models import llava_processor

    theirs = llava_processor(tower)
    theirs.save_pretrained(tmp_path)
    config = ImageProcessorConfig.from_file(tmp_path)
    assert config.fixed_size == (16, 16)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (*size, 3), dtype=np.uint8))
    ours = ImageProcessor(config, factor=4).preprocess(image)
    expected = theirs(image, return_tensors="np")["pixel_values"][0]
    assert ours.shape == expected.shape == (3, 16, 16)
    assert float(np.abs(ours - expected).max()) < 1e-5
