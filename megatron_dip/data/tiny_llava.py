"""A tiny LLaVA-Pretrain-style dataset, generated (never downloaded) for tests and the quick start.

Each image is a small PNG of a coloured shape on a coloured background, of varied size and aspect
ratio; its caption names the colours and the shape, so a tiny model has something learnable.
Written as `<directory>/data.json` and `<directory>/images/NNNN.png`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from PIL import Image

logger = logging.getLogger(__name__)

_COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
    "white": (240, 240, 240),
    "black": (15, 15, 15),
}
_PROMPTS = (
    "<image>\nWrite a short caption.",
    "Describe the picture briefly.\n<image>",
    "<image>\nWhat is shown here?",
)


def _draw(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, str]:
    """One RGB picture and its caption."""
    names = list(_COLOURS)
    back, front = rng.choice(len(names), size=2, replace=False)
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:] = _COLOURS[names[back]]
    ys, xs = np.mgrid[0:height, 0:width]
    cy, cx = height / 2, width / 2
    r = min(height, width) / 3
    shape = ("square", "circle")[int(rng.integers(2))]
    if shape == "circle":
        inside = (ys - cy) ** 2 + (xs - cx) ** 2 <= r * r
    else:
        inside = (abs(ys - cy) <= r) & (abs(xs - cx) <= r)
    pixels[inside] = _COLOURS[names[front]]
    noise = rng.integers(-8, 9, size=pixels.shape)
    pixels = np.clip(pixels.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return pixels, f"a {names[front]} {shape} on a {names[back]} background"


def make_tiny_llava_sample(directory: str | Path, *, num_samples: int = 16, seed: int = 0) -> Path:
    """Write the tiny dataset into `directory` (created if needed); returns the JSON path.

    Deterministic in `seed`: the same call writes byte-identical files.
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    root = Path(directory)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(num_samples):
        height, width = (int(x) for x in rng.integers(20, 97, size=2))
        pixels, caption = _draw(rng, height, width)
        name = f"images/{i:04d}.png"
        Image.fromarray(pixels).save(root / name, format="PNG")
        records.append(
            {
                "id": f"tiny{i:05d}",
                "image": name,
                "conversations": [
                    {"from": "human", "value": _PROMPTS[i % len(_PROMPTS)]},
                    {"from": "gpt", "value": caption},
                ],
            }
        )
    path = root / "data.json"
    path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    logger.info("wrote %d samples to %s", num_samples, path)
    return path
