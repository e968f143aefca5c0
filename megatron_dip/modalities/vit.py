"""ViT: a vision encoder whose merged, projected patch embeddings replace the LLM's image
placeholders.

An instance is one image [C, H, W] (H, W multiples of patch * merge): (H / patch) * (W / patch)
patches, each merge x merge window of patches one LLM token (52 x 52 patches -> 13 x 13 = 169).
Images of a sub-microbatch are packed along the sequence; each patch attends to every patch of its
own image only and carries a 2-D rotary position (row, column). Chunk 0 embeds the patches with a
linear layer; the last chunk normalises, merges each window (contiguous by construction of
`patchify_image`) and projects it with a two-layer MLP into the LLM's hidden size: one row per
LLM image token (`scatter.scatter_name`).

Window attention (Qwen2.5-VL, `Architecture.window_size`): each image's merge windows are
reordered window by window (`window_order`) when the sub-batch is built, positions with them;
the layers in `Architecture.full_attention_layers` attend over the whole image, the others
within their window only (`layer_attention`), and the last chunk restores the raster order of
the merged tokens before the merger. The cost model prices the window layers' cheaper
attention (`layer_ops`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from megatron_dip.modelspec import IMAGE_TOKEN, ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch

from .base import SampleArrays
from .costs import CostContext, Op, Work, gemm, mem
from .registry import register
from .scatter import ScatterProducer
from .stored import data_copy_bytes


def image_tokens(*, height: int, width: int, vit: ModuleSpec) -> tuple[int, int]:
    """(ViT tokens, LLM tokens) of an image of `height` x `width` pixels: its patches (and a
    class token, CLIP), and the merged patches (and the class token where it is kept).

    Raises ValueError unless both sides are positive multiples of patch_size * merge, and, for
    a ViT with learned positions, unless the image is at its base resolution.
    """
    unit = vit.patch_size * vit.merge
    if height <= 0 or width <= 0 or height % unit or width % unit:
        raise ValueError(
            f"image {height}x{width} is not a multiple of patch*merge = {unit} pixels per side"
        )
    patches = (height // vit.patch_size) * (width // vit.patch_size)
    extra = int(vit.arch.class_token)
    if vit.arch.learned_positions and patches + extra != vit.arch.learned_positions:
        side = math.isqrt(vit.arch.learned_positions - extra) * vit.patch_size
        raise ValueError(
            f"image {height}x{width}: the ViT's learned positions cover {side}x{side} pixels (its "
            "base resolution; anyres tiling is not supported): resize the images to it "
            "(--dip-image-processor with the model's preprocessor_config.json)"
        )
    kept = extra if vit.arch.keep_class_token else 0
    return patches + extra, patches // (vit.merge * vit.merge) + kept


TEMPORAL_PATCH = 2  # frames per Conv3d patch ("conv3d" patch embedding; an image is repeated)


def patch_frames(spec: ModuleSpec) -> int:
    """Frames per flattened patch in `patchify_image`'s channel-first layout: 2 for "conv3d",
    1 for "conv2d" (a Conv2d kernel [C, p, p]), 0 for "linear" (channels last)."""
    return {"conv3d": TEMPORAL_PATCH, "conv2d": 1}.get(spec.arch.patch_embedding, 0)


def patch_width(spec: ModuleSpec) -> int:
    """Values of one flattened patch: p*p*C, or C*2*p*p for the "conv3d" patch embedding."""
    return spec.patch_size**2 * spec.in_channels * max(1, patch_frames(spec))


def patch_bias(spec: ModuleSpec) -> bool:
    """Whether the patch embedding has a bias (linear; conv2d with `patch_bias`, SigLIP)."""
    return spec.arch.patch_embedding == "linear" or spec.arch.patch_bias


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


def window_units(spec: ModuleSpec) -> int:
    """Merged tokens per side of an attention window (`Architecture.window_size` pixels)."""
    return spec.arch.window_size // (spec.patch_size * spec.merge)


def window_order(rows: int, cols: int, *, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The merged tokens of a `rows` x `cols` grid (raster order) window by window: (their
    raster indices in window order, tokens per window). Windows of `window` x `window` tokens
    tile the grid from its top-left corner (those at the right and bottom edges are cut), in
    raster order, each read in raster order (Qwen2.5-VL's `get_vision_window_index`)."""
    index = np.arange(rows * cols).reshape(rows, cols)
    blocks = [
        index[a : a + window, b : b + window].reshape(-1)
        for a in range(0, rows, window)
        for b in range(0, cols, window)
    ]
    return np.concatenate(blocks), np.array([b.size for b in blocks], dtype=np.int64)


def _windowed(
    patches: np.ndarray, positions: np.ndarray, image: np.ndarray, spec: ModuleSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(patches, positions) of one image reordered window by window (`window_order` of its
    merged tokens, each token's merge x merge patches kept together), the patches per window,
    and the merged tokens' window-order indices (raster index of each row)."""
    unit = spec.patch_size * spec.merge
    order, sizes = window_order(
        image.shape[1] // unit, image.shape[2] // unit, window=window_units(spec)
    )
    pool = spec.merge * spec.merge
    rows = (order[:, None] * pool + np.arange(pool)[None, :]).reshape(-1)
    return patches[rows], positions[rows], sizes * pool, order


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
        if spec.arch.class_token and (spec.merge != 1 or not spec.arch.learned_positions):
            raise ValueError(
                f"module {spec.name!r}: a class token needs merge 1 and learned positions"
            )
        self.check_windows(spec)
        super().check_spec(spec, model)

    def check_windows(self, spec: ModuleSpec) -> None:
        """Window attention needs whole merged tokens per window and rotary positions."""
        a, unit = spec.arch, spec.patch_size * spec.merge
        if a.window_size and (a.window_size % unit or a.learned_positions):
            raise ValueError(
                f"module {spec.name!r}: window_size {a.window_size} must be a multiple of "
                f"patch*merge = {unit} pixels, on a ViT with rotary positions"
            )
        outside = [i for i in a.full_attention_layers if not 0 <= i < spec.num_layers]
        if outside:
            raise ValueError(
                f"module {spec.name!r}: full_attention_layers {outside} outside its "
                f"{spec.num_layers} layers"
            )

    def layer_attention(self, spec: ModuleSpec, layer: int, batch) -> dict:
        """A window layer attends within each window (`batch.windows`), the others over the
        whole image."""
        if not spec.arch.window_size or layer in spec.arch.full_attention_layers:
            return super().layer_attention(spec, layer, batch)
        from megatron_dip.models import attention
        from megatron_dip.models.common import cached

        return cached(
            batch, ("window attention",), lambda: attention.self_attention_kwargs(batch.windows)
        )

    def layer_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        """One layer's operators at the module's mean attention pairs per layer: a window
        layer's instances are its windows (at most window^2 patches each, an image's
        `w.seg` patches at most), a full layer's its images."""
        a = spec.arch
        if not a.window_size:
            return super().layer_ops(spec, w, c)
        window = (a.window_size // spec.patch_size) ** 2
        windowed = w.tokens * min(w.seg, window)
        full = len(a.full_attention_layers) / spec.num_layers
        return super().layer_ops(spec, replace(w, pairs=full * w.pairs + (1 - full) * windowed), c)

    def consumer_rows(self, spec: ModuleSpec, tokens: int) -> int:
        if spec.arch.class_token and not spec.arch.keep_class_token:
            return tokens - tokens // spec.arch.learned_positions  # one class token per image
        return super().consumer_rows(spec, tokens)

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
        a, h = spec.arch, spec.layer.hidden
        positions = (a.learned_positions + a.class_token + 2 * a.pre_norm) * h
        return (patch_width(spec) + patch_bias(spec)) * h + positions

    def consumer_grid(self, spec: ModuleSpec, array: np.ndarray) -> tuple[int, int, int]:
        """(frames, rows, columns) of an image's tokens in the LLM (M-RoPE positions)."""
        unit = spec.patch_size * spec.merge
        return 1, array.shape[1] // unit, array.shape[2] // unit

    def profile_batch(self, spec: ModuleSpec, *, tokens: int, instances: int, caption: int):
        """The base synthetic sub-microbatch, with windows of window^2 patches for the
        profiled stack's window layers (its first layers: mostly window layers, where
        `layer_ops` prices the module's mean layer)."""
        import torch

        from megatron_dip.models.batch import segment_ids

        batch, extras = super().profile_batch(
            spec, tokens=tokens, instances=instances, caption=caption
        )
        if spec.arch.window_size:
            size = (spec.arch.window_size // spec.patch_size) ** 2
            per_image = [min(size, tokens - k) for k in range(0, tokens, size)]
            windows = segment_ids(per_image * instances, tokens * instances)
            batch.tensors["windows"] = torch.from_numpy(windows)
        return batch, extras

    # -- torch parts --------------------------------------------------------------------------

    def build_pre(self, chunk):
        import torch

        from megatron_dip.models.common import LearnedPositions, Parts

        m, a = chunk.module_spec, chunk.module_spec.arch
        # Replicated on every tensor-parallel rank: small, and its input is not sharded. A
        # Conv2d / Conv3d with kernel = stride is this linear map on flattened patches.
        embed = torch.nn.Linear(patch_width(m), m.layer.hidden, bias=patch_bias(m))
        positions = pre_norm = None
        if a.learned_positions:
            positions = LearnedPositions(
                a.learned_positions, m.layer.hidden, class_token=a.class_token, dtype=chunk.dtype
            )
        if a.pre_norm:  # on the whole sequence, before sequence parallelism: a plain LayerNorm
            pre_norm = torch.nn.LayerNorm(m.layer.hidden, eps=a.norm_eps, dtype=chunk.dtype)
        return Parts(patch_embed=embed, positions=positions, pre_norm=pre_norm)

    def build_post(self, chunk):
        """The merger (and norm), and the frozen carried tensors (`Architecture.carried`)."""
        from megatron_dip.models.common import carried_parameters

        parts = super().build_post(chunk)
        carried = chunk.module_spec.arch.carried
        if carried:
            parts.add_module("carried", carried_parameters(carried, dtype=chunk.dtype))
        return parts

    def embed_media(self, chunk, batch):
        hidden = chunk.pre.patch_embed(batch.patches.to(chunk.dtype))
        if chunk.module_spec.arch.learned_positions:
            hidden = chunk.pre.positions(hidden, batch.positions[:, 0], batch.class_rows)
        if chunk.module_spec.arch.pre_norm:
            hidden = chunk.pre.pre_norm(hidden)
        return hidden

    def handed_rows(self, chunk, hidden, batch):
        a = chunk.module_spec.arch
        if a.window_size:  # the merged tokens back in raster order (rows of `pool` patches)
            units = hidden.reshape(-1, self.pool(chunk.module_spec), *hidden.shape[1:])
            return units[batch.restore].reshape(hidden.shape)
        if not a.class_token or a.keep_class_token:
            return hidden
        return hidden[~batch.class_rows[: hidden.shape[0]]]  # LLaVA's "default": no class rows

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
        pieces, windows = _image_pieces(spec, images)
        counts = [p.shape[0] for p, _ in pieces]
        check_tokens(sub, counts, None)
        total = sub.padded_tokens
        width = patch_width(spec)
        patches = padded([p.astype(np.float32) for p, _ in pieces] or [np.zeros((0, width))], total)
        axes = 1 if spec.arch.learned_positions else 2
        positions = padded([pos for _, pos in pieces] or [np.zeros((0, axes), np.int64)], total)
        tensors = {"patches": torch.from_numpy(patches.astype(np.float32))}
        if spec.arch.learned_positions:
            tensors["class_rows"] = torch.from_numpy(
                padded(
                    [
                        pos[:, 0] == 0 if spec.arch.class_token else pos[:, 0] < 0
                        for _, pos in pieces
                    ]
                    or [np.zeros(0, bool)],
                    total,
                    False,
                )
            )
        if windows is not None:
            tensors.update(_window_tensors(windows, total))
        return SubBatch(
            sub=sub,
            kind=self.kind,
            segments=torch.from_numpy(segment_ids(counts, total)),
            positions=torch.from_numpy(positions.astype(np.int64)),
            tensors=tensors,
        )


def _image_pieces(spec: ModuleSpec, images: Sequence[np.ndarray]) -> tuple[list, list | None]:
    """([(patches, positions)] of each image as the ViT reads them, and with window attention
    each image's (patches per window, merged tokens' raster indices) (None without)."""
    frames = patch_frames(spec)
    pieces = [
        patchify_image(img, patch=spec.patch_size, merge=spec.merge, frames=frames)
        for img in images
    ]
    if spec.arch.learned_positions:
        return [_with_learned_positions(p, spec) for p, _ in pieces], None
    if not spec.arch.window_size:
        return pieces, None
    done = [_windowed(p, pos, img, spec) for (p, pos), img in zip(pieces, images, strict=True)]
    return [(p, pos) for p, pos, _, _ in done], [(sizes, order) for _, _, sizes, order in done]


def _window_tensors(windows: list, total: int) -> dict:
    """The sub-batch's "windows" (attention segment of every token: its window, padding -1)
    and "restore" (the merged rows in window order -> raster order, image after image)."""
    import torch

    from megatron_dip.models.batch import segment_ids

    sizes = [int(n) for per_image, _ in windows for n in per_image]
    restore, offset = [], 0
    for _, order in windows:
        restore.append(offset + np.argsort(order))
        offset += order.size
    restore = np.concatenate(restore) if restore else np.zeros(0, np.int64)
    return {
        "windows": torch.from_numpy(segment_ids(sizes, total)),
        "restore": torch.from_numpy(restore.astype(np.int64)),
    }


def _with_learned_positions(patches: np.ndarray, spec: ModuleSpec) -> tuple[np.ndarray, np.ndarray]:
    """(patches with a zero row first for the class token (CLIP), [N, 1] indices into the
    learned position table: 0 the class token's, then the patches row by row)."""
    if spec.arch.class_token:
        patches = np.concatenate([np.zeros((1, patches.shape[1]), patches.dtype), patches])
    return patches, np.arange(patches.shape[0], dtype=np.int64)[:, None]


VIT = register(VitModality())
