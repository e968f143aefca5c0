"""Audio encoder (Whisper-style): log-mel frames -> convolutional subsampling -> Megatron-Core
transformer layers -> a projector into the LLM, whose outputs replace the LLM's audio
placeholders, like images do.

An instance is one audio segment: a log-mel spectrogram [mel bins, frames] (`in_channels` mel
bins, 100 frames per second, frames a multiple of stride * pool). Chunk 0 runs Whisper's two
convolutions on each segment on its own (kernel 3, padding 1, GELU; the second with stride
`patch_size` = 2: 3000 frames of 30 s -> 1500 tokens) and adds sinusoidal positions that restart
at every segment. The layers are pre-LayerNorm with biases and a GELU MLP; each token attends to
its own segment only. The last chunk normalises, merges every `merge` consecutive tokens into
one vector (Qwen2-Audio pools 1500 -> 750) and projects it with a two-layer MLP into the LLM's
hidden size: one row per LLM audio token (`scatter.scatter_name`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch

from .base import SampleArrays
from .costs import CostContext, Op, Work, gemm, mem
from .registry import register
from .scatter import ScatterProducer
from .stored import data_copy_bytes

MEL_FRAMES_PER_SECOND = 100  # Whisper's 10 ms hop
KERNEL = 3


def frames_for_seconds(spec: ModuleSpec, seconds: float) -> int:
    """Mel frames of a segment of about `seconds`, rounded to whole LLM tokens (>= one)."""
    unit = spec.patch_size * spec.merge
    return max(1, round(seconds * MEL_FRAMES_PER_SECOND / unit)) * unit


class AudioModality(ScatterProducer):
    """Audio encoder (module docstring)."""

    kind = "audio"
    instance = "audio segment"
    placeholder_role = "audio"
    rotary = False  # sinusoidal positions, added in chunk 0

    def pool(self, spec: ModuleSpec) -> int:
        return spec.merge

    def check_spec(self, spec: ModuleSpec, model: MultimodalSpec) -> None:
        if spec.patch_size < 1 or spec.merge < 1 or spec.in_channels < 1:
            raise ValueError(
                f"module {spec.name!r}: an audio encoder needs patch_size (conv stride), merge "
                "(tokens pooled per LLM token) and in_channels (mel bins) >= 1"
            )
        super().check_spec(spec, model)

    def counts_of(self, spec: ModuleSpec, arrays: Sequence[np.ndarray]) -> list[int]:
        unit = spec.patch_size * spec.merge
        tokens = []
        for i, mel in enumerate(arrays):
            if mel.ndim != 2 or mel.shape[0] != spec.in_channels:
                raise ValueError(
                    f"audio segment {i} must be [{spec.in_channels} mel bins, frames], got shape "
                    f"{tuple(mel.shape)}"
                )
            if mel.shape[1] <= 0 or mel.shape[1] % unit:
                raise ValueError(
                    f"audio segment {i}: {mel.shape[1]} frames is not a positive multiple of "
                    f"stride x pool = {unit}"
                )
            tokens.append(mel.shape[1] // spec.patch_size)
        return tokens

    # -- costs --------------------------------------------------------------------------------

    def input_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        h, frames = spec.layer.hidden, w.tokens * spec.patch_size
        return [
            gemm(frames, KERNEL * spec.in_channels, h, c, shard_in=False),  # conv 1
            mem(frames * h, 2, c),  # GELU
            gemm(w.tokens, KERNEL * h, h, c, shard_in=False),  # conv 2 (strided)
            mem(w.tokens * h, 3, c),  # GELU, positions
        ]

    def input_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        # conv1's output and GELU (the frames, stride x tokens), conv2's output: replicated on
        # every tensor-parallel rank and before the sequence is split.
        frames = w.tokens * spec.patch_size
        mel = data_copy_bytes(frames * spec.in_channels, c)
        return c.dt * w.tokens * spec.layer.hidden * (2 * spec.patch_size + 1) + mel

    def input_params(self, spec: ModuleSpec) -> int:
        h = spec.layer.hidden
        return KERNEL * spec.in_channels * h + h + KERNEL * h * h + h

    def profile_grid(self, spec: ModuleSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (250, 750, 1500), (1, 2, 4, 8)  # 5 s to 30 s segments

    # -- torch parts --------------------------------------------------------------------------

    def build_pre(self, chunk):
        import torch

        from megatron_dip.models.common import Parts

        m, h = chunk.module_spec, chunk.module_spec.layer.hidden
        # Replicated on every tensor-parallel rank: small, and its input is not sharded.
        return Parts(
            conv1=torch.nn.Conv1d(m.in_channels, h, KERNEL, padding=1),
            conv2=torch.nn.Conv1d(h, h, KERNEL, stride=m.patch_size, padding=1),
        )

    def embed_media(self, chunk, batch):
        import torch
        from torch.nn import functional

        from megatron_dip.models.common import sinusoidal_embedding

        pre, hidden = chunk.pre, chunk.module_spec.layer.hidden
        mel = batch.mel.to(chunk.dtype)
        pieces = []
        # Each segment on its own: the convolutions pad at segment edges, as Whisper does.
        for segment in torch.split(mel, batch.frame_counts.tolist(), dim=1):
            x = functional.gelu(pre.conv1(segment[None]))
            pieces.append(functional.gelu(pre.conv2(x))[0].transpose(0, 1))
        width = (batch.sub.padded_tokens, hidden)
        x = torch.cat(pieces) if pieces else torch.zeros(0, hidden, dtype=chunk.dtype)
        x = functional.pad(x, (0, 0, 0, width[0] - x.shape[0]))
        positions = sinusoidal_embedding(batch.positions[:, 0].to(torch.float64), hidden)
        return x + positions.to(x.dtype)

    def run_stack(self, spec, layers, state: dict, batch, *, rotary_base: float):
        from megatron_dip.models import attention
        from megatron_dip.models.common import cached

        del spec, rotary_base  # absolute positions, added in chunk 0
        packed = cached(
            batch, ("attention",), lambda: attention.self_attention_kwargs(batch.segments)
        )
        hidden = state["hidden"]
        for layer in layers:
            hidden, _ = layer(hidden, **packed)
        return hidden

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
        mels = [m for s in samples for m in self.media(spec, s)]
        mels = mels[sub.instance_start : sub.instance_end]
        counts = self.counts_of(spec, mels)
        check_tokens(sub, counts, None)
        total = sub.padded_tokens
        frames = np.concatenate(mels, axis=1) if mels else np.zeros((spec.in_channels, 0))
        positions = padded([np.arange(n) for n in counts], total, 0)
        return SubBatch(
            sub=sub,
            kind=self.kind,
            segments=torch.from_numpy(segment_ids(counts, total)),
            positions=torch.from_numpy(positions[:, None].astype(np.int64)),
            tensors={
                "mel": torch.from_numpy(np.ascontiguousarray(frames, dtype=np.float32)),
                "frame_counts": torch.tensor([m.shape[1] for m in mels], dtype=torch.int64),
            },
        )


AUDIO = register(AudioModality())
