"""The inputs one chunk needs for one sub-microbatch (`SubBatch`), and helpers to build them.

Every rank can build the `SubBatch` of any sub-microbatch from the microbatch's samples alone (no
communication): data tensors never travel between pipeline ranks, only activations do. Each
modality builds its own (`Modality.build_sub_batch`); all sequences are packed (micro batch size
1) and padded to the sub-microbatch's `padded_tokens`. Padding tokens form their own attention
segment (id -1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from megatron_dip.schedule.ir import SubMicrobatch


@dataclass
class SubBatch:
    """Inputs of one module's chunks for one sub-microbatch (tensors on one device).

    Common: `segments` [P] int64 attention segment per token (instance index local to the
    sub-microbatch; -1 for padding); `positions` [P, A] int64 rotary positions (A = the
    modality's rotary axes). `tensors`: the modality's own inputs by name (e.g. "patches",
    "token_ids", "noisy"), also readable as attributes (`batch.patches`). `cache` holds masks and
    rotary tables computed once by the first chunk that needs them.
    """

    sub: SubMicrobatch
    kind: str
    segments: torch.Tensor
    positions: torch.Tensor
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    cache: dict = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors") or {}
        if name in tensors:
            return tensors[name]
        raise AttributeError(f"{type(self).__name__} of {self.kind!r} has no input {name!r}")

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
        return replace(
            self,
            segments=self.segments.to(device),
            positions=self.positions.to(device),
            tensors={k: v.to(device) for k, v in self.tensors.items()},
            cache={},
        )


def mix_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes, unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def padded(arrays: list[np.ndarray], total: int, fill: float | int = 0) -> np.ndarray:
    """`arrays` concatenated along dim 0 and padded with `fill` to `total` rows."""
    data = np.concatenate(arrays, axis=0) if arrays else np.zeros((0,), dtype=np.int64)
    pad_shape = (total - data.shape[0], *data.shape[1:])
    return np.concatenate([data, np.full(pad_shape, fill, dtype=data.dtype)], axis=0)


def segment_ids(lengths: Sequence[int], total: int) -> np.ndarray:
    """Segment id of every token: instance i's tokens are i, padding is -1."""
    ids = [np.full(n, i, dtype=np.int64) for i, n in enumerate(lengths)]
    return padded(ids, total, -1)


def check_tokens(sub: SubMicrobatch, counts: Sequence[int], seq_limit: int | None) -> None:
    """Refuse a sub-microbatch whose token counts differ from the samples' (a plan made for
    other data) or exceed `seq_limit`."""
    real = sum(counts)
    if real != sub.tokens:
        raise ValueError(f"{sub.work}: the samples give {real} tokens, the plan says {sub.tokens}")
    if sub.padded_tokens < real:
        raise ValueError(f"{sub.work}: padded_tokens {sub.padded_tokens} < {real} real tokens")
    if seq_limit is not None and sub.padded_tokens > seq_limit:
        raise ValueError(f"{sub.work}: {sub.padded_tokens} tokens exceed seq_length {seq_limit}")
