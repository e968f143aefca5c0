"""ViT: a vision encoder whose merged, projected patch embeddings replace the LLM's image
placeholders.

An instance is one image [C, H, W] (H, W multiples of patch * merge): (H / patch) * (W / patch)
patches, each merge x merge window of patches one LLM token (52 x 52 patches -> 13 x 13 = 169).
Images of a sub-microbatch are packed along the sequence; each patch attends to every patch of its
own image only and carries a 2-D rotary position (row, column). Chunk 0 embeds the patches with a
linear layer; the last chunk normalises, merges each window (contiguous by construction of
`patchify_image`) and projects it with a two-layer MLP into the LLM's hidden size: one row per
LLM image token (`scatter.scatter_name`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_dip.modelspec import IMAGE_TOKEN, ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch

from .base import SampleArrays
from .costs import CostContext, Op, Work, gemm, mem
from .registry import register
from .scatter import ScatterProducer
from .stored import data_copy_bytes


def image_tokens(*, height: int, width: int, vit: ModuleSpec) -> tuple[int, int]:
    """(ViT patches, LLM tokens) of an image of `height` x `width` pixels.

    Raises ValueError unless both sides are positive multiples of patch_size * merge.
    """
    unit = vit.patch_size * vit.merge
    if height <= 0 or width <= 0 or height % unit or width % unit:
        raise ValueError(
            f"image {height}x{width} is not a multiple of patch*merge = {unit} pixels per side"
        )
    patches = (height // vit.patch_size) * (width // vit.patch_size)
    return patches, patches // (vit.merge * vit.merge)


TEMPORAL_PATCH = 2  # frames per Conv3d patch ("conv3d" patch embedding; an image is repeated)


def patch_width(spec: ModuleSpec) -> int:
    """Values of one flattened patch: p*p*C, or C*2*p*p for the "conv3d" patch embedding."""
    frames = TEMPORAL_PATCH if spec.arch.patch_embedding == "conv3d" else 1
    return spec.patch_size**2 * spec.in_channels * frames


def patchify_image(
    image: np.ndarray, *, patch: int, merge: int, frames: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """[C, H, W] -> patches [N, p*p*C] in window order, and (row, col) of each patch [N, 2].

    `frames` > 0: each patch flattened as (C, frames, p, p) with the image repeated over the
    frames (the layout of Qwen2-VL's image processor and Conv3d patch embedding)."""
    c, h, w = image.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"image {h}x{w} is not a multiple of patch*merge = {patch * merge}")
    bh, bw = h // (patch * merge), w // (patch * merge)
    x = image.reshape(c, bh, merge, patch, bw, merge, patch)
    n = bh * bw * merge * merge
    if frames:
        # (bh, bw, ih, iw, C, py, px), then the frame axis after C
        x = x.transpose(1, 4, 2, 5, 0, 3, 6).reshape(n, c, 1, patch, patch)
        x = np.repeat(x, frames, axis=2).reshape(n, c * frames * patch * patch)
    else:
        # (bh, bw, ih, iw, py, px, C): the merge x merge patches of one LLM token are contiguous.
        x = x.transpose(1, 4, 2, 5, 3, 6, 0).reshape(n, patch * patch * c)
    r = np.arange(bh)[:, None, None, None] * merge + np.arange(merge)[None, None, :, None]
    col = np.arange(bw)[None, :, None, None] * merge + np.arange(merge)[None, None, None, :]
    rows, cols = np.broadcast_arrays(r, col)
    return x, np.stack([rows.reshape(-1), cols.reshape(-1)], axis=1)


class VitModality(ScatterProducer):
    """Vision encoder (module docstring)."""

    kind = "vit"
    instance = "image"
    rotary_axes = 2
    default_placeholder = IMAGE_TOKEN
    placeholder_role = "image"

    def pool(self, spec: ModuleSpec) -> int:
        return spec.merge * spec.merge

    def check_spec(self, spec: ModuleSpec, model: MultimodalSpec) -> None:
        if spec.out_hidden <= 0:
            raise ValueError(f"module {spec.name!r}: a vit needs out_hidden (the LLM's hidden)")
        super().check_spec(spec, model)

    def counts_of(self, spec: ModuleSpec, arrays: Sequence[np.ndarray]) -> list[int]:
        patches = []
        for i, image in enumerate(arrays):
            if image.ndim != 3 or image.shape[0] != spec.in_channels:
                raise ValueError(
                    f"image {i} must be [{spec.in_channels}, H, W], got shape {tuple(image.shape)}"
                )
            try:
                p, _ = image_tokens(height=image.shape[1], width=image.shape[2], vit=spec)
            except ValueError as err:
                raise ValueError(f"image {i}: {err}") from None
            patches.append(p)
        return patches

    # -- costs --------------------------------------------------------------------------------

    def input_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        return [
            gemm(w.tokens, patch_width(spec), spec.layer.hidden, c, shard_in=False),
            mem(w.tokens * spec.layer.hidden, 3, c),
        ]

    def input_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        return data_copy_bytes(w.tokens * spec.patch_size**2 * spec.in_channels, c)

    def input_params(self, spec: ModuleSpec) -> int:
        bias = spec.arch.patch_embedding == "linear"
        return (patch_width(spec) + bias) * spec.layer.hidden

    def consumer_grid(self, spec: ModuleSpec, array: np.ndarray) -> tuple[int, int, int]:
        """(frames, rows, columns) of an image's tokens in the LLM (M-RoPE positions)."""
        unit = spec.patch_size * spec.merge
        return 1, array.shape[1] // unit, array.shape[2] // unit

    # -- torch parts --------------------------------------------------------------------------

    def build_pre(self, chunk):
        import torch

        from megatron_dip.models.common import Parts

        m = chunk.module_spec
        # Replicated on every tensor-parallel rank: small, and its input is not sharded. A
        # Conv3d with kernel = stride = (frames, p, p) is this linear map on flattened patches.
        bias = m.arch.patch_embedding == "linear"
        return Parts(patch_embed=torch.nn.Linear(patch_width(m), m.layer.hidden, bias=bias))

    def embed_media(self, chunk, batch):
        return chunk.pre.patch_embed(batch.patches.to(chunk.dtype))

    def build_sub_batch(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleArrays],
        sub: SubMicrobatch,
        *,
        seq_length: int,
        seed: int,
    ):
        import torch

        from megatron_dip.models.batch import SubBatch, check_tokens, padded, segment_ids

        del model, seq_length, seed
        images = [img for s in samples for img in self.media(spec, s)]
        images = images[sub.instance_start : sub.instance_end]
        for img in images:
            if img.shape[0] != spec.in_channels:
                raise ValueError(
                    f"{sub.work}: image with {img.shape[0]} channels, the ViT takes {spec.in_channels}"
                )
        frames = TEMPORAL_PATCH if spec.arch.patch_embedding == "conv3d" else 0
        pieces = [
            patchify_image(img, patch=spec.patch_size, merge=spec.merge, frames=frames)
            for img in images
        ]
        counts = [p.shape[0] for p, _ in pieces]
        check_tokens(sub, counts, None)
        total = sub.padded_tokens
        width = patch_width(spec)
        patches = padded([p.astype(np.float32) for p, _ in pieces] or [np.zeros((0, width))], total)
        positions = padded([pos for _, pos in pieces] or [np.zeros((0, 2), np.int64)], total)
        return SubBatch(
            sub=sub,
            kind=self.kind,
            segments=torch.from_numpy(segment_ids(counts, total)),
            positions=torch.from_numpy(positions.astype(np.int64)),
            tensors={"patches": torch.from_numpy(patches.astype(np.float32))},
        )


VIT = register(VitModality())
