"""Turning raw `Sample`s into the tensors one chunk needs for one sub-microbatch.

Every rank can build the `SubBatch` of any sub-microbatch from the microbatch's samples alone
(no communication): data tensors never travel between pipeline ranks, only activations do.
Layouts follow `layout.py`; all sequences are packed (micro batch size 1) and padded to the
sub-microbatch's `padded_tokens`. Padding tokens form their own attention segment (id -1).

Diffusion noise and timesteps come from a `torch.Generator` seeded by (seed, sample id, clip),
never from a rank's global RNG, so every layout and every rank draws the same values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from megatron_dip.data.sample import IMAGE_TOKEN, PAD_TOKEN, Sample, loss_targets
from megatron_dip.modelspec import ModuleKind, ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch

from .layout import instance_tokens


@dataclass
class SubBatch:
    """Inputs of one module's chunks for one sub-microbatch (tensors on one device).

    Common: `segments` [P] int64 attention segment per token (image, document, caption or clip
    index local to the sub-microbatch; -1 for padding); `positions` [P, A] int64 rotary
    positions (A = 2 (row, col) for the ViT, 1 for text, 3 (frame, row, col) for the DiT).
    ViT: `patches` [P, p*p*C] (each merge x merge window of patches is contiguous).
    LLM: `token_ids`, `labels` [P] int64, `loss_mask` [P] float, `image_positions` [n] int64
    (positions of IMAGE_TOKEN placeholders, in order). The LLM sub-microbatch's `tokens` may be
    the real token count or the whole padded sequence (`padded_tokens`).
    Text encoder: `token_ids` [P], `caption_index` [n] int64 (microbatch caption indices).
    DiT: `noisy` [P, p*p*C] the noised latent tokens x_t, `target` [P, p*p*C] the velocity
    (noise - x0), `timesteps` [clips] in [0, 1), `clip_caption` [clips] caption index of each
    clip. Text encoder and DiT: `caption_lengths` [captions of the microbatch] int64.
    `cache` holds masks and rotary tables computed once by the first chunk that needs them.
    """

    sub: SubMicrobatch
    kind: ModuleKind
    segments: torch.Tensor
    positions: torch.Tensor
    patches: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    image_positions: torch.Tensor | None = None
    caption_index: torch.Tensor | None = None
    caption_lengths: torch.Tensor | None = None
    noisy: torch.Tensor | None = None
    target: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    clip_caption: torch.Tensor | None = None
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_real(self) -> int:
        """Real (unpadded) tokens."""
        return self.sub.tokens

    def to(self, device: torch.device | str) -> SubBatch:
        """This batch on `device` (self when already there); the cache is kept only then.

        Move a batch once, before the first chunk runs on it, so that all chunks share the
        masks and rotary tables it caches.
        """
        target, here = torch.device(device), self.segments.device
        if here.type == target.type and target.index in (None, here.index):
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, cache={}, **moved)


def mix_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes, unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


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


def patchify_clip(clip: torch.Tensor, *, patch: int) -> torch.Tensor:
    """Latent clip [T, C, h, w] -> tokens [T*(h/p)*(w/p), p*p*C] (frame, row, col order)."""
    t, c, h, w = clip.shape
    if h % patch or w % patch:
        raise ValueError(f"latent {h}x{w} is not a multiple of the DiT patch size {patch}")
    x = clip.reshape(t, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(t * (h // patch) * (w // patch), -1)


def unpatchify_clip(tokens: torch.Tensor, *, shape: Sequence[int], patch: int) -> torch.Tensor:
    """Inverse of `patchify_clip`: tokens [N, p*p*C] -> clip of `shape` [T, C, h, w]."""
    t, c, h, w = shape
    x = tokens.reshape(t, h // patch, w // patch, patch, patch, c)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(t, c, h, w)


def _clip_positions(shape: Sequence[int], patch: int) -> np.ndarray:
    t, _, h, w = shape
    grid = np.meshgrid(np.arange(t), np.arange(h // patch), np.arange(w // patch), indexing="ij")
    return np.stack([g.reshape(-1) for g in grid], axis=1)


def _padded(arrays: list[np.ndarray], total: int, fill: float | int = 0) -> np.ndarray:
    data = np.concatenate(arrays, axis=0) if arrays else np.zeros((0,), dtype=np.int64)
    pad_shape = (total - data.shape[0], *data.shape[1:])
    return np.concatenate([data, np.full(pad_shape, fill, dtype=data.dtype)], axis=0)


def _segments(lengths: Sequence[int], total: int) -> np.ndarray:
    ids = [np.full(n, i, dtype=np.int64) for i, n in enumerate(lengths)]
    return _padded(ids, total, -1)


def _check_tokens(sub: SubMicrobatch, counts: Sequence[int], seq_limit: int | None) -> None:
    real = sum(counts)
    if real != sub.tokens:
        raise ValueError(f"{sub.work}: the samples give {real} tokens, the plan says {sub.tokens}")
    if sub.padded_tokens < real:
        raise ValueError(f"{sub.work}: padded_tokens {sub.padded_tokens} < {real} real tokens")
    if seq_limit is not None and sub.padded_tokens > seq_limit:
        raise ValueError(f"{sub.work}: {sub.padded_tokens} tokens exceed seq_length {seq_limit}")


def _vit_batch(module: ModuleSpec, samples: Sequence[Sample], sub: SubMicrobatch) -> SubBatch:
    images = [img for s in samples for img in s.images][sub.instance_start : sub.instance_end]
    for img in images:
        if img.shape[0] != module.in_channels:
            raise ValueError(
                f"{sub.work}: image with {img.shape[0]} channels, the ViT takes {module.in_channels}"
            )
    pieces = [patchify_image(img, patch=module.patch_size, merge=module.merge) for img in images]
    counts = [p.shape[0] for p, _ in pieces]
    _check_tokens(sub, counts, None)
    total = sub.padded_tokens
    patch_dim = module.patch_size**2 * module.in_channels
    patches = _padded(
        [p.astype(np.float32) for p, _ in pieces] or [np.zeros((0, patch_dim))], total
    )
    positions = _padded([pos for _, pos in pieces] or [np.zeros((0, 2), np.int64)], total)
    return SubBatch(
        sub=sub,
        kind=module.kind,
        segments=torch.from_numpy(_segments(counts, total)),
        positions=torch.from_numpy(positions.astype(np.int64)),
        patches=torch.from_numpy(patches.astype(np.float32)),
    )


def _loss_mask(sample: Sample) -> np.ndarray:
    """Loss of position j (predicting token j+1): whether token j+1 is a target.

    `data.sample.loss_targets` decides; the mask's sum is `layout.loss_tokens_of` of the sample.
    """
    targets = loss_targets(sample.text, sample.labels_mask).astype(np.float32)
    return np.concatenate([targets[1:], np.zeros(min(1, len(targets)), dtype=np.float32)])


def _llm_batch(
    model: MultimodalSpec,
    module: ModuleSpec,
    samples: Sequence[Sample],
    sub: SubMicrobatch,
    seq: int,
) -> SubBatch:
    if (sub.index, sub.instance_start, sub.instance_end) != (0, 0, 1):
        raise ValueError(f"{sub.work}: an LLM microbatch is one sub-microbatch of instance [0, 1)")
    texts = [np.asarray(s.text, dtype=np.int64) for s in samples]
    real = sum(len(t) for t in texts)
    # A plan may count the LLM's whole padded sequence as its tokens (it computes on all).
    _check_tokens(sub, [sub.tokens if sub.tokens == sub.padded_tokens >= real else real], seq)
    total = sub.padded_tokens
    tokens = _padded(texts, total, PAD_TOKEN)
    labels = _padded([np.append(t[1:], PAD_TOKEN) for t in texts if len(t)], total, PAD_TOKEN)
    mask = _padded([_loss_mask(s) for s in samples], total, 0.0)
    positions = _padded([np.arange(len(t)) for t in texts], total, 0)
    image_positions = np.nonzero(tokens == IMAGE_TOKEN)[0]
    vit = [p for p in model.producers_of(module.name) if p.kind is ModuleKind.VIT]
    if vit:
        expected = sum(n // vit[0].merge ** 2 for n in instance_tokens(vit[0], samples))
        if expected != len(image_positions):
            raise ValueError(
                f"{sub.work}: {len(image_positions)} IMAGE_TOKEN placeholders, the images give "
                f"{expected} LLM tokens"
            )
    return SubBatch(
        sub=sub,
        kind=module.kind,
        segments=torch.from_numpy(_segments([len(t) for t in texts], total)),
        positions=torch.from_numpy(positions[:, None].astype(np.int64)),
        token_ids=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(mask.astype(np.float32)),
        image_positions=torch.from_numpy(image_positions.astype(np.int64)),
    )


def _text_batch(module: ModuleSpec, samples: Sequence[Sample], sub: SubMicrobatch) -> SubBatch:
    all_lengths = [len(s.text) for s in samples]
    if any(n == 0 for n in all_lengths):
        raise ValueError(f"{sub.work}: every caption needs at least one token")
    chosen = samples[sub.instance_start : sub.instance_end]
    texts = [np.asarray(s.text, dtype=np.int64) for s in chosen]
    _check_tokens(sub, [len(t) for t in texts], None)
    total = sub.padded_tokens
    return SubBatch(
        sub=sub,
        kind=module.kind,
        segments=torch.from_numpy(_segments([len(t) for t in texts], total)),
        positions=torch.from_numpy(_padded([np.arange(len(t)) for t in texts], total)[:, None]),
        token_ids=torch.from_numpy(_padded(texts, total, PAD_TOKEN)),
        caption_index=torch.arange(sub.instance_start, sub.instance_end, dtype=torch.int64),
        caption_lengths=torch.tensor(all_lengths, dtype=torch.int64),
    )


def _noised_clip(clip: np.ndarray, *, seed: int, sample_id: int, patch: int):
    gen = torch.Generator().manual_seed(mix_seed("dit-noise", seed, sample_id, 0))
    x0 = torch.from_numpy(np.ascontiguousarray(clip, dtype=np.float32))
    t = torch.rand((), generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    # Rectified flow: x_t = (1 - t) x0 + t noise, the model predicts the velocity noise - x0.
    noisy = (1 - t) * x0 + t * noise
    return patchify_clip(noisy, patch=patch), patchify_clip(noise - x0, patch=patch), t


def _dit_batch(
    module: ModuleSpec, samples: Sequence[Sample], sub: SubMicrobatch, seed: int
) -> SubBatch:
    counts = instance_tokens(module, samples)[sub.instance_start : sub.instance_end]
    _check_tokens(sub, counts, None)
    total, p = sub.padded_tokens, module.patch_size
    chosen = samples[sub.instance_start : sub.instance_end]
    for s in chosen:
        if s.images[0].shape[1] != module.in_channels:
            raise ValueError(
                f"{sub.work}: latent with {s.images[0].shape[1]} channels, the DiT takes {module.in_channels}"
            )
    drawn = [_noised_clip(s.images[0], seed=seed, sample_id=s.sample_id, patch=p) for s in chosen]
    width = p * p * module.in_channels
    noisy = torch.zeros(total, width)
    target = torch.zeros(total, width)
    if drawn:
        noisy[: sub.tokens] = torch.cat([d[0] for d in drawn])
        target[: sub.tokens] = torch.cat([d[1] for d in drawn])
    positions = _padded([_clip_positions(s.images[0].shape, p) for s in chosen], total)
    return SubBatch(
        sub=sub,
        kind=module.kind,
        segments=torch.from_numpy(_segments(counts, total)),
        positions=torch.from_numpy(positions.astype(np.int64).reshape(total, 3)),
        noisy=noisy,
        target=target,
        timesteps=torch.stack([d[2] for d in drawn]) if drawn else torch.zeros(0),
        clip_caption=torch.arange(sub.instance_start, sub.instance_end, dtype=torch.int64),
        caption_lengths=torch.tensor([len(s.text) for s in samples], dtype=torch.int64),
    )


def build_sub_batch(
    model: MultimodalSpec,
    samples: Sequence[Sample],
    sub: SubMicrobatch,
    *,
    seq_length: int,
    seed: int,
) -> SubBatch:
    """The `SubBatch` of sub-microbatch `sub`, given all samples of its microbatch in order.

    The token counts of `sub` must match the samples (a plan made for other data is refused).
    The LLM sequence is padded to `sub.padded_tokens`, which may not exceed `seq_length`;
    `seed` seeds the diffusion noise and timesteps together with each sample's id.
    """
    module = model.module(sub.module)
    if module.kind is ModuleKind.VIT:
        return _vit_batch(module, samples, sub)
    if module.kind is ModuleKind.LLM:
        return _llm_batch(model, module, samples, sub, seq_length)
    if module.kind is ModuleKind.TEXT_ENCODER:
        return _text_batch(module, samples, sub)
    return _dit_batch(module, samples, sub, seed)
