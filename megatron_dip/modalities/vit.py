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


def patchify_image(image: np.ndarray, *, patch: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """[C, H, W] -> patches [N, p*p*C] in window order, and (row, col) of each patch [N, 2]."""
    c, h, w = image.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"image {h}x{w} is not a multiple of patch*merge = {patch * merge}")
    bh, bw = h // (patch * merge), w // (patch * merge)
    x = image.reshape(c, bh, merge, patch, bw, merge, patch)
    # (bh, bw, ih, iw, py, px, C): the merge x merge patches of one LLM token are contiguous.
    x = x.transpose(1, 4, 2, 5, 3, 6, 0).reshape(bh * bw * merge * merge, patch * patch * c)
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
        patch = spec.patch_size**2 * spec.in_channels
        return [
            gemm(w.tokens, patch, spec.layer.hidden, c, shard_in=False),
            mem(w.tokens * spec.layer.hidden, 3, c),
        ]

    def input_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        return data_copy_bytes(w.tokens * spec.patch_size**2 * spec.in_channels, c)

    def input_params(self, spec: ModuleSpec) -> int:
        return (spec.patch_size**2 * spec.in_channels + 1) * spec.layer.hidden

    # -- torch parts --------------------------------------------------------------------------

    def build_pre(self, chunk):
        import torch

        from megatron_dip.models.common import Parts

        m = chunk.module_spec
        # Replicated on every tensor-parallel rank: small, and its input is not sharded.
        return Parts(patch_embed=torch.nn.Linear(m.patch_size**2 * m.in_channels, m.layer.hidden))

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
        pieces = [patchify_image(img, patch=spec.patch_size, merge=spec.merge) for img in images]
        counts = [p.shape[0] for p, _ in pieces]
        check_tokens(sub, counts, None)
        total = sub.padded_tokens
        width = spec.patch_size**2 * spec.in_channels
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
