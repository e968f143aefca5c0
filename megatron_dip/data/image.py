"""Image preprocessing from the vision model's processor config (numpy and Pillow, no torch).

The policy is Qwen2-VL's dynamic resolution (transformers' `Qwen2VLImageProcessor`, whose
behaviour the tests check ours against: same grid, pixel values within 1e-5): `smart_resize`
rounds each side to a multiple of `factor` = patch size x merge size, then scales the image so
that its pixels lie in [min_pixels, max_pixels], aspect ratio kept as far as the grid allows;
the image is converted to RGB (transparency composited onto white), resized with the config's resampling (bicubic), rescaled by
`rescale_factor` (1/255) and normalised by the config's mean and std. The output is float32
[3, H, W] with H and W multiples of the ViT's patch x merge; the ViT cuts it into patches itself.

`max_pixels` is the one pixel limit: a larger image is resized down to it, never accepted
unbounded (also where Qwen2-VL's rule would exceed it: a very elongated image, whose short side
is held at one grid unit, has its long side cut to fit). Where it comes from (first found): `--dip-max-pixels`; the processor config
(`--dip-image-processor`, a `preprocessor_config.json` or the directory holding one: Qwen2-VL's
`min_pixels`/`max_pixels` or `size.shortest_edge`/`size.longest_edge`); the square of
`--dip-image-size`; 336 x 336. Without a processor config the mean and std are 0.5 (pixels in
[-1, 1], the tiny presets' convention).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROCESSOR_FILE = "preprocessor_config.json"
DEFAULT_MAX_PIXELS = 336 * 336
MAX_ASPECT = 200  # Qwen2-VL refuses more extreme aspect ratios
_BICUBIC = 3


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(H, W): multiples of `factor`, H x W within [min_pixels, max_pixels], aspect ratio kept
    as far as the grid allows (Qwen2-VL's rule). ValueError for an empty image or an aspect
    ratio beyond 200."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width} must be positive")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"image {height}x{width}: aspect ratio beyond {MAX_ASPECT}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Resize policy and normalisation (module docstring). `patch_size` / `merge_size`: what
    the config was made for (None: any), checked against the ViT by `check_vit`."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    min_pixels: int | None = None  # None: one grid unit squared
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = _BICUBIC
    patch_size: int | None = None
    merge_size: int | None = None
    source: str = "defaults"
    # Fixed-resolution policies (LLaVA's towers) instead of Qwen2-VL's dynamic one: CLIP's
    # resize of the short side to `shortest_edge`, then a centre crop to `crop` (H, W);
    # SigLIP's resize to `resize` (H, W).
    shortest_edge: int | None = None
    crop: tuple[int, int] | None = None
    resize: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.max_pixels < 1 or (self.min_pixels is not None and self.min_pixels < 1):
            raise ValueError(f"{self.source}: min/max pixels must be positive")
        if self.min_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"{self.source}: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"{self.source}: image_mean/image_std need 3 values, std > 0")

    @classmethod
    def from_file(cls, path: str | Path) -> ImageProcessorConfig:
        """Read a Hugging Face `preprocessor_config.json` (or the directory holding one)."""
        file = Path(path)
        if file.is_dir():
            file = file / PROCESSOR_FILE
        try:
            raw: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"--dip-image-processor: cannot read {file}: {err}") from None
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        fields: dict[str, Any] = {"source": str(file)}
        fixed = _fixed_policy(raw, size)
        if fixed:
            fields.update(fixed, **_normalisation(raw))
            return cls(**fields)
        max_pixels = raw.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
        min_pixels = raw.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
        if max_pixels is not None:
            fields["max_pixels"] = int(max_pixels)
        if min_pixels is not None:
            fields["min_pixels"] = int(min_pixels)
        fields.update(_normalisation(raw))
        for key in ("patch_size", "merge_size"):
            if raw.get(key) is not None:
                fields[key] = int(raw[key])
        return cls(**fields)

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """(H, W) of every processed image under a fixed-resolution policy, else None."""
        return self.crop or self.resize

    def check_vit(self, *, patch: int, merge: int) -> None:
        """ValueError unless the config's grid unit is the ViT's (patch x merge pixels)."""
        if self.patch_size is None or self.merge_size is None:
            return
        if self.patch_size * self.merge_size != patch * merge:
            raise ValueError(
                f"--dip-image-processor: {self.source} is for patch {self.patch_size} x merge "
                f"{self.merge_size} = {self.patch_size * self.merge_size} pixels per grid unit, "
                f"the ViT's is {patch} x {merge} = {patch * merge}"
            )


def _fixed_policy(raw: dict[str, Any], size: dict[str, Any]) -> dict[str, Any]:
    """The fields of a CLIP-style (short-side resize + centre crop) or SigLIP-style (resize to
    height x width) processor config; {} for Qwen2-VL's dynamic resolution."""
    crop = raw.get("crop_size")
    if raw.get("do_center_crop") and isinstance(crop, dict) and "shortest_edge" in size:
        return {
            "shortest_edge": int(size["shortest_edge"]),
            "crop": (int(crop["height"]), int(crop["width"])),
            "max_pixels": int(crop["height"]) * int(crop["width"]),
        }
    if "height" in size and "width" in size and "max_pixels" not in raw:
        shape = (int(size["height"]), int(size["width"]))
        return {"resize": shape, "max_pixels": shape[0] * shape[1]}
    return {}


def _normalisation(raw: dict[str, Any]) -> dict[str, Any]:
    """Mean, std, rescale factor and resampling of a processor config."""
    out: dict[str, Any] = {}
    if raw.get("do_normalize", True):
        out.update(
            {k: tuple(float(v) for v in raw[k]) for k in ("image_mean", "image_std") if k in raw}
        )
    else:
        out.update(image_mean=(0.0,) * 3, image_std=(1.0,) * 3)
    if not raw.get("do_rescale", True):
        out["rescale_factor"] = 1.0
    elif "rescale_factor" in raw:
        out["rescale_factor"] = float(raw["rescale_factor"])
    if raw.get("resample") is not None:
        out["resample"] = int(raw["resample"])
    return out


def to_rgb(image):
    """A PIL image as RGB, transparency composited onto white (as transformers converts)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


DRAFT_OVERSIZE = 64  # see `draft`


def draft(image, target: tuple[int, int] | None) -> None:
    """Let an opened, not yet decoded JPEG decode at 1/2, 1/4 or 1/8 scale (Pillow's `draft`),
    never below twice `target` (H, W) per side, when it has more than `DRAFT_OVERSIZE` times
    the target's pixels: a full decode of a 10000 x 10000 photo costs about a second, and for
    such sizes exactness to Qwen2-VL's full-size resize matters less than the step time.
    Images of ordinary sizes, and other formats, are decoded whole."""
    if target is None or image.format != "JPEG":
        return
    h, w = target
    if image.width * image.height > DRAFT_OVERSIZE * h * w:
        image.draft("RGB", (2 * w, 2 * h))


class ImageProcessor:
    """`ImageProcessorConfig` applied to images for a ViT whose grid unit is `factor` pixels."""

    def __init__(self, config: ImageProcessorConfig, *, factor: int) -> None:
        self.config, self.factor = config, factor
        self.min_pixels = factor * factor if config.min_pixels is None else config.min_pixels
        if config.max_pixels < factor * factor:
            raise ValueError(
                f"max_pixels {config.max_pixels} is smaller than one grid unit ({factor}x{factor})"
            )
        self._mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
        self._std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]

    def target_size(self, *, height: int, width: int) -> tuple[int, int]:
        """(H, W) an image of `height` x `width` pixels is resized to: `smart_resize`, whose
        one-unit floor on the short side can exceed max_pixels for very elongated images; then
        the long side is cut back so that max_pixels holds (the only departure from Qwen2-VL).
        A fixed-resolution policy (CLIP, SigLIP) gives its size whatever the image's."""
        if self.config.fixed_size is not None:
            return self.config.fixed_size
        h, w = smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.config.max_pixels,
        )
        limit, unit = self.config.max_pixels, self.factor
        if h * w > limit:
            if h >= w:
                h = max(unit, limit // w // unit * unit)
            else:
                w = max(unit, limit // h // unit * unit)
        return h, w

    def resized_size(self, *, height: int, width: int) -> tuple[int, int]:
        """(H, W) of the resize before any crop: CLIP's short side at `shortest_edge` (the
        long one scaled and truncated, as transformers' get_resize_output_image_size)."""
        edge = self.config.shortest_edge
        if edge is None:
            return self.target_size(height=height, width=width)
        if height <= width:
            return edge, int(edge * width / height)
        return int(edge * height / width), edge

    def preprocess(self, image) -> np.ndarray:
        """A PIL image -> float32 [3, H, W] (RGB, resized, rescaled, normalised)."""
        from PIL import Image

        height, width = self.resized_size(height=image.height, width=image.width)
        rgb = to_rgb(image)
        if (rgb.height, rgb.width) != (height, width):
            rgb = rgb.resize((width, height), Image.Resampling(self.config.resample))
        pixels = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1)
        if self.config.crop is not None:  # transformers' centre crop: offsets rounded down
            (ch, cw), (h, w) = self.config.crop, pixels.shape[1:]
            top, left = max(0, (h - ch) // 2), max(0, (w - cw) // 2)
            pixels = pixels[:, top : top + ch, left : left + cw]
        pixels = pixels * np.float32(self.config.rescale_factor)
        return np.ascontiguousarray((pixels - self._mean) / self._std, dtype=np.float32)
