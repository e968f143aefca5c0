"""DiT: a diffusion transformer over latent clips, conditioned by a text encoder, with the
flow-matching loss.

An instance is one latent clip [T, C, h, w] (h, w multiples of the patch size), one per sample:
clip i of a microbatch is conditioned on caption i. Tokens: T * (h / p) * (w / p), each with a
3-D rotary position (frame, row, column); self-attention within each clip, cross-attention of
every clip token to its own caption (`models.dit_layer.DitLayer`, adaLN-Zero). A sub-microbatch
needs every text sub-microbatch whose captions overlap its clips (`consumes`).

Messages: the conditioning travels with the activations. Chunk 0 computes "temb" [clips, hidden]
(timestep embedding) and "cond" [caption tokens, 1, hidden] (projected text encoding of its own
clips' captions, in clip order, padding removed: `SubMicrobatch.context_tokens` rows), with
"cond_index" int64 [clips] (microbatch caption index of each caption in "cond"), and every
chunk passes them on, so their gradients reach chunk 0's embedders and, through "cond", a
trainable text encoder. Under sequence parallelism only "hidden" is sharded. Loss: rectified
flow — the model predicts the velocity noise - x0 from x_t = (1-t) x0 + t noise; per latent
token the mean squared error over its p*p*C values, summed over real tokens. Noise and
timesteps come from a generator seeded by (seed, sample id), never from a rank's global RNG, so
every layout draws the same values.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch, TensorSpec, WorkId

from .base import (
    INDEX_DTYPE,
    Instance,
    InstanceCounts,
    Modality,
    SampleArrays,
    SampleInfo,
    SubLookup,
    instances_overlap,
)
from .costs import CostContext, Op, Work, cross_attention_ops, gemm, mem
from .registry import register
from .stored import (
    Stored,
    attention_core_stored,
    data_copy_bytes,
    mlp_stored,
    norm_stored,
    self_attention_stored,
)

TIMESTEP_FEATURES = 256  # sinusoidal timestep features (`ModelConfig.timestep_embed_dim`)


def clip_tokens(*, frames: int, height: int, width: int, dit: ModuleSpec) -> int:
    """DiT tokens of a latent clip of `frames` x `height` x `width` (latent units).

    Raises ValueError unless frames > 0 and both sides are positive multiples of the patch size.
    """
    p = dit.patch_size
    if frames <= 0 or height <= 0 or width <= 0 or height % p or width % p:
        raise ValueError(
            f"latent clip {frames}x{height}x{width} needs frames > 0 and sides that are "
            f"multiples of the DiT patch size {p}"
        )
    return frames * (height // p) * (width // p)


def condition_producers(
    model: MultimodalSpec, dit_sub: SubMicrobatch, sub_lookup: SubLookup
) -> list[SubMicrobatch]:
    """The text sub-microbatches whose captions condition `dit_sub` (in index order).

    Text sub-microbatches of the microbatch are looked up as index 0, 1, ... until
    `sub_lookup` raises KeyError (as `Plan.submicrobatch` does).
    """
    producers = model.producers_of(dit_sub.module)
    if len(producers) != 1:
        raise ValueError(
            f"model {model.name!r}: a DiT is conditioned by exactly one text encoder, "
            f"{dit_sub.module!r} has {[p.name for p in producers]}"
        )
    text = producers[0]
    found = []
    for k in itertools.count():
        try:
            sub = sub_lookup(WorkId(text.name, dit_sub.microbatch, k))
        except KeyError:
            break
        if instances_overlap(sub, dit_sub):
            found.append(sub)
    covered = sum(
        min(s.instance_end, dit_sub.instance_end) - max(s.instance_start, dit_sub.instance_start)
        for s in found
    )
    if covered != dit_sub.num_instances:
        raise ValueError(f"captions of {dit_sub.work} are not all produced by {text.name!r}")
    return found


def patchify_clip(clip, *, patch: int):
    """Latent clip tensor [T, C, h, w] -> tokens [T*(h/p)*(w/p), p*p*C] (frame, row, col)."""
    t, c, h, w = clip.shape
    if h % patch or w % patch:
        raise ValueError(f"latent {h}x{w} is not a multiple of the DiT patch size {patch}")
    x = clip.reshape(t, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(t * (h // patch) * (w // patch), -1)


def unpatchify_clip(tokens, *, shape: Sequence[int], patch: int):
    """Inverse of `patchify_clip`: tokens [N, p*p*C] -> clip of `shape` [T, C, h, w]."""
    t, c, h, w = shape
    x = tokens.reshape(t, h // patch, w // patch, patch, patch, c)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(t, c, h, w)


class DitModality(Modality):
    """Diffusion transformer (module docstring)."""

    kind = "dit"
    instance = "clip"
    rotary_axes = 3
    tp_blocks = 3
    cross_attends = True
    message_names = ("hidden", "temb", "cond", "cond_index")

    def check_spec(self, spec: ModuleSpec, model: MultimodalSpec) -> None:
        if spec.cond_hidden <= 0:
            raise ValueError(f"module {spec.name!r}: a dit needs cond_hidden")

    # -- metadata -----------------------------------------------------------------------------

    def check_microbatch(
        self,
        spec: ModuleSpec,
        model: MultimodalSpec,
        samples: Sequence[SampleInfo],
        *,
        index: int,
        seq_length: int,
        pad: int,
    ) -> None:
        # Clip i is conditioned on caption i, so one clip per sample.
        bad = [s.sample_id for s in samples if len(self.sample_instances(spec, s)) != 1]
        if bad:
            raise ValueError(
                f"microbatch {index}: text-to-video samples {bad} do not hold exactly one clip"
            )

    def consumes(self, producer: SubMicrobatch, consumer: SubMicrobatch) -> bool:
        return instances_overlap(producer, consumer)  # clip i belongs to caption i

    def instance_counts(
        self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays
    ) -> InstanceCounts:
        clips = list(sample.media.get(spec.name, ()))
        if len(clips) != 1:
            raise ValueError(f"a text-to-video sample has one latent clip, got {len(clips)}")
        clip = clips[0]
        if clip.ndim != 4 or clip.shape[1] != spec.in_channels:
            raise ValueError(
                f"latent clip must be [T, {spec.in_channels}, h, w], got shape {tuple(clip.shape)}"
            )
        t, _, h, w = clip.shape
        return InstanceCounts((clip_tokens(frames=t, height=h, width=w, dit=spec),), (), (int(t),))

    # -- messages and loss ------------------------------------------------------------------------

    def chunk_message(self, spec, model, sub, sub_lookup, *, dtype, seq) -> list[TensorSpec]:
        condition_producers(model, sub, sub_lookup)  # raises unless its captions are produced
        if sub.num_instances and sub.context_tokens < sub.num_instances:
            raise ValueError(
                f"{sub.work}: context_tokens {sub.context_tokens} for {sub.num_instances} clips: "
                "the DiT's messages carry its clips' caption tokens (batching.split fills them)"
            )
        hidden = spec.layer.hidden
        return [
            TensorSpec("hidden", (seq(sub.padded_tokens), 1, hidden), dtype),
            TensorSpec("temb", (sub.num_instances, hidden), dtype),
            TensorSpec("cond", (sub.context_tokens, 1, hidden), dtype),
            TensorSpec("cond_index", (sub.num_instances,), INDEX_DTYPE),
        ]

    def packing_caps(self, spec: ModuleSpec, *, seq_length: int) -> dict[str, int | None]:
        # The paper's text-to-video microbatches: <= 8 clips of <= 16 s together (64 latent
        # frames at 16 FPS through a 4x causal VAE); all captions within --seq-length tokens.
        return {"seq_length": seq_length, "max_instances": 8, "max_frames": 64}

    def sample_loss_tokens(
        self, spec: ModuleSpec, model: MultimodalSpec, sample: SampleArrays
    ) -> int:
        return sum(self.instance_counts(spec, model, sample).tokens)

    # -- costs ----------------------------------------------------------------------------------

    def context(
        self, spec: ModuleSpec, samples: Sequence[SampleInfo], items: Sequence[Instance]
    ) -> tuple[int, int]:
        # Clip i is conditioned on caption i: the caption of the clip's own sample.
        del spec
        captions = [samples[i.sample_index].text_tokens for i in items]
        return sum(captions), sum(i.tokens * n for i, n in zip(items, captions))

    norms_per_layer = 3  # norm1, the cross-attention norm, norm2

    def layer_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        h = spec.layer.hidden
        return [
            *super().layer_ops(spec, w, c),
            gemm(w.instances, h, 6 * h, c, shard_in=False),  # adaLN modulation
            mem(w.tokens * h / c.rep, 8, c),  # shift/scale and gates of both blocks
            *cross_attention_ops(spec.layer, w, c),
        ]

    def layer_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> Stored:
        lay, h = spec.layer, spec.layer.hidden
        norm = norm_stored(h, c, rms=False)  # norm1, the cross-attention norm, norm2
        # Per token: the modulation gathered to the tokens (6 widths: shifts, scales, gates),
        # 1 + scale and the norm's output of both blocks, the biased outputs of self-attention
        # and MLP that the gates multiply, the cross-attention's Q input; Q and the
        # out-projection input of the cross-attention (split by heads).
        extra = Stored(replicated=6 + 2 + 2 + 2 + 1, sharded=2)
        kv = 2 * lay.kv_groups * lay.head_dim / c.tp
        fixed = c.dt * (w.instances * h + w.context_tokens * kv)  # SiLU(temb); cross K, V
        return (
            norm
            + self_attention_stored(lay, w, c, rotary=True)
            + norm
            + norm
            + mlp_stored(lay)
            + extra
            + attention_core_stored(lay, w.tokens, c)
            + Stored(fixed=fixed)
        )

    def chunk_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        # temb and the clips' caption encodings, which every layer reads; token -> clip index.
        h = spec.layer.hidden
        return c.dt * (w.instances + w.context_tokens) * h + 8 * w.tokens / c.rep

    def input_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        h, patch = spec.layer.hidden, spec.patch_size**2 * spec.in_channels
        return [
            gemm(w.tokens, patch, h, c, shard_in=False),
            gemm(w.instances, TIMESTEP_FEATURES, h, c, shard_in=False),  # timestep embedding
            gemm(w.instances, h, h, c, shard_in=True),
            gemm(w.context_tokens, spec.cond_hidden, h, c, shard_in=False),  # caption projection
            gemm(w.context_tokens, h, h, c, shard_in=False),
        ]

    def input_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        # Timestep MLP: sinusoidal features, fc1 output, SiLU output; caption MLP: its input
        # (the clips' rows of the text encoding), fc1 output, GELU output.
        h, patch = spec.layer.hidden, spec.patch_size**2 * spec.in_channels
        per_clip = TIMESTEP_FEATURES + 2 * h
        latents = data_copy_bytes(w.tokens * patch, c)  # the noised latents, x_embed's input
        return (
            c.dt * (w.instances * per_clip + w.context_tokens * (spec.cond_hidden + 2 * h))
            + latents
        )

    def output_ops(self, spec: ModuleSpec, w: Work, c: CostContext) -> list[Op]:
        h, out = spec.layer.hidden, spec.patch_size**2 * spec.in_channels
        return [
            mem(w.tokens * h / c.rep, 2, c),  # final norm
            gemm(w.instances, h, 2 * h, c, shard_in=False),
            gemm(w.tokens, h, out, c, shard_in=True),
        ]

    def output_stored(self, spec: ModuleSpec, w: Work, c: CostContext) -> float:
        # The final norm (on the shard), then on the gathered sequence: its output and 1 + scale
        # of the modulation, the projection's input; SiLU(temb); the fp32 prediction error.
        h, out = spec.layer.hidden, spec.patch_size**2 * spec.in_channels
        tokens = norm_stored(h, c, rms=False) + Stored(whole=3.0)
        loss = 4 * w.tokens * out + 8 * w.tokens
        return tokens.nbytes(h, w, c) + c.dt * w.instances * h + loss

    def received_bytes(self, spec: ModuleSpec, w: Work, c: CostContext, *, first: bool) -> float:
        if first:  # the text encoder's "cond" of every caption it encoded, and "cond_index"
            return c.dt * w.input_tokens * spec.cond_hidden + 8 * w.instances
        h = spec.layer.hidden
        carried = c.dt * (w.instances + w.context_tokens) * h + 8 * w.instances
        return c.dt * w.tokens * h / c.rep + carried

    def layer_params(self, spec: ModuleSpec) -> int:
        h = spec.layer.hidden
        return super().layer_params(spec) + 6 * h * h + 4 * h * h + h  # adaLN, cross-attn, norm

    def input_params(self, spec: ModuleSpec) -> int:
        h, patch = spec.layer.hidden, spec.patch_size**2 * spec.in_channels
        return patch * h + TIMESTEP_FEATURES * h + h * h + spec.cond_hidden * h

    def output_params(self, spec: ModuleSpec) -> int:
        h, patch = spec.layer.hidden, spec.patch_size**2 * spec.in_channels
        return 2 * h * h + h * patch + h

    # -- torch parts ----------------------------------------------------------------------------

    def zero_init_prefixes(self, chunk) -> tuple[str, ...]:
        if not chunk.model_config.adaln_zero:
            return ()
        layers = tuple(f"layers.{k}.modulation." for k in range(len(chunk.layers)))
        return (*layers, "post.final_modulation.", "post.final_linear.")

    def layer_stack(
        self, spec: ModuleSpec, *, tconfig, backend, groups, start: int, end: int, causal: bool
    ):
        import torch

        from megatron_dip.models.dit_layer import DitLayer, dit_layer_specs

        del causal  # self-attention within each clip, cross-attention to its caption
        specs = dit_layer_specs(backend, tp_group=groups.tp)
        return torch.nn.ModuleList(
            DitLayer(
                config=tconfig, backend=backend, specs=specs, layer_number=i + 1, groups=groups
            )
            for i in range(start, end)
        )

    def build_pre(self, chunk):
        import torch

        from megatron_dip.models.common import Parts

        m = chunk.module_spec
        hidden, temb_dim = m.layer.hidden, chunk.model_config.timestep_embed_dim
        linear = torch.nn.Linear
        return Parts(
            x_embed=linear(m.patch_size**2 * m.in_channels, hidden),
            t_fc1=linear(temb_dim, hidden),
            t_fc2=linear(hidden, hidden),
            cond_fc1=linear(m.cond_hidden, hidden),
            cond_fc2=linear(hidden, hidden),
        )

    def build_post(self, chunk):
        import torch

        from megatron_dip.models.common import Parts

        m = chunk.module_spec
        hidden = m.layer.hidden
        return Parts(
            final_norm=torch.nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6),
            final_modulation=torch.nn.Linear(hidden, 2 * hidden),
            final_linear=torch.nn.Linear(hidden, m.patch_size**2 * m.in_channels),
        )

    def _gather_cond(self, chunk, inputs: Sequence[Mapping[str, Any]], batch):
        """The rows of the clips' own captions (in clip order) from the producers' caption
        encodings (which may hold other clips' captions, and padding); their caption indices."""
        import torch

        from megatron_dip.models.attention import caption_rows

        if not inputs:
            raise ValueError(f"{batch.sub.work}: the DiT needs the text encoder's output")
        pieces, indices = [], []
        for message in inputs:
            index = message["cond_index"].to(chunk.device)
            real = int(batch.caption_lengths[index].sum())
            pieces.append(message["cond"][:real])
            indices.append(index)
        rows = caption_rows(torch.cat(indices), batch.caption_lengths, batch.clip_caption)
        cond = torch.cat(pieces).index_select(0, rows.to(chunk.device)).to(chunk.dtype)
        return cond, batch.clip_caption.clone()

    def embed(self, chunk, inputs: Sequence[Mapping[str, Any]], batch) -> dict:
        from torch.nn import functional

        from megatron_dip.models.common import sinusoidal_embedding

        pre = chunk.pre
        hidden = chunk.scatter_sequence(pre.x_embed(batch.noisy.to(chunk.dtype))[:, None, :])
        freq = sinusoidal_embedding(batch.timesteps * 1000.0, chunk.model_config.timestep_embed_dim)
        temb = pre.t_fc2(functional.silu(pre.t_fc1(freq.to(chunk.dtype))))
        cond, cond_index = self._gather_cond(chunk, inputs, batch)
        cond = pre.cond_fc2(functional.gelu(pre.cond_fc1(cond), approximate="tanh"))
        return {"hidden": hidden, "temb": temb, "cond": cond, "cond_index": cond_index}

    @staticmethod
    def cross_attention_inputs(state: dict, batch):
        """(caption rows in clip order, cross-attention keyword arguments): clip tokens attend to
        their own caption's rows of "cond" (`models.attention.cross_attention_inputs`)."""
        from megatron_dip.models import attention

        return attention.cross_attention_inputs(
            segments=batch.segments,
            clip_caption=batch.clip_caption,
            caption_lengths=batch.caption_lengths,
            cond_index=state["cond_index"],
            cond=state["cond"],
        )

    def run_stack(self, spec, layers, state: dict, batch, *, rotary_base: float, groups=None):
        from megatron_dip.models import attention
        from megatron_dip.models.common import cached, sequence_slice
        from megatron_dip.models.rope import rotary_table

        head_dim, dtype = spec.layer.head_dim, state["hidden"].dtype
        packed = cached(
            batch, ("attention",), lambda: attention.self_attention_kwargs(batch.segments)
        )
        rotary = cached(
            batch,
            ("rotary", head_dim, rotary_base, dtype),
            lambda: rotary_table(batch.positions, head_dim=head_dim, base=rotary_base, dtype=dtype),
        )
        # Once per chunk: "cond" in the cross-attention's kv segments (as sent, it already is).
        cond, cross = self.cross_attention_inputs(state, batch)
        token_clip = batch.segments.clamp(min=0)
        if groups is not None:  # under sequence parallelism: this rank's tokens' clips
            token_clip = sequence_slice(token_clip, layers[0].config, groups)
        hidden = state["hidden"]
        for layer in layers:
            hidden = layer(
                hidden,
                temb=state["temb"],
                token_clip=token_clip,
                cond=cond,
                self_attention=packed,
                cross_attention=cross,
                rotary=rotary,
            )
        return hidden

    def run_layers(self, chunk, state: dict, batch):
        return self.run_stack(
            chunk.module_spec,
            chunk.layers,
            state,
            batch,
            rotary_base=chunk.module_spec.arch.rotary_base,
            groups=chunk.groups,
        )

    def finish(self, chunk, state: dict, batch) -> dict:
        import torch
        from torch.nn import functional

        post = chunk.post
        token_clip = batch.segments.clamp(min=0)
        modulation = post.final_modulation(functional.silu(state["temb"]))[token_clip]
        shift, scale = modulation.chunk(2, dim=-1)
        # The final norm has no weights: gather the sequence, then finish on every TP rank.
        x = chunk.gather_sequence(post.final_norm(state["hidden"]))[:, 0, :] * (1 + scale) + shift
        prediction = post.final_linear(x)[: batch.num_real]
        # The loss is summed over many tokens: accumulate it in at least fp32.
        prediction = prediction.to(torch.promote_types(prediction.dtype, torch.float32))
        target = batch.target[: batch.num_real].to(prediction.dtype)
        per_token = (prediction - target).pow(2).mean(dim=-1)
        return {
            "loss": per_token.sum(),
            "num_tokens": torch.tensor(batch.num_real, dtype=torch.int64, device=chunk.device),
        }

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

        del seq_length
        counts = [self.sample_loss_tokens(spec, model, s) for s in samples]
        counts = counts[sub.instance_start : sub.instance_end]
        check_tokens(sub, counts, None)
        total, p = sub.padded_tokens, spec.patch_size
        chosen = samples[sub.instance_start : sub.instance_end]
        clips = [s.media[spec.name][0] for s in chosen]
        for clip in clips:
            if clip.shape[1] != spec.in_channels:
                raise ValueError(
                    f"{sub.work}: latent with {clip.shape[1]} channels, the DiT takes "
                    f"{spec.in_channels}"
                )
        drawn = [
            _noised_clip(clip, seed=seed, sample_id=s.sample_id, patch=p)
            for s, clip in zip(chosen, clips)
        ]
        width = p * p * spec.in_channels
        noisy, target = torch.zeros(total, width), torch.zeros(total, width)
        if drawn:
            noisy[: sub.tokens] = torch.cat([d[0] for d in drawn])
            target[: sub.tokens] = torch.cat([d[1] for d in drawn])
        positions = padded([_clip_positions(clip.shape, p) for clip in clips], total)
        return SubBatch(
            sub=sub,
            kind=self.kind,
            segments=torch.from_numpy(segment_ids(counts, total)),
            positions=torch.from_numpy(positions.astype(np.int64).reshape(total, 3)),
            tensors={
                "noisy": noisy,
                "target": target,
                "timesteps": torch.stack([d[2] for d in drawn]) if drawn else torch.zeros(0),
                "clip_caption": torch.arange(
                    sub.instance_start, sub.instance_end, dtype=torch.int64
                ),
                "caption_lengths": torch.tensor([len(s.text) for s in samples], dtype=torch.int64),
            },
        )

    def profile_batch(self, spec: ModuleSpec, *, tokens: int, instances: int, caption: int):
        import torch

        batch, _ = super().profile_batch(spec, tokens=tokens, instances=instances, caption=caption)
        batch.tensors["clip_caption"] = torch.arange(instances)
        batch.tensors["caption_lengths"] = torch.full((instances,), caption, dtype=torch.int64)
        gen = torch.Generator().manual_seed(0)
        hidden = spec.layer.hidden
        # Conditioning that comes from chunk 0's embedders: its gradient is computed, as in a chunk.
        state = {
            "temb": torch.randn(instances, hidden, generator=gen).requires_grad_(True),
            "cond": torch.randn(instances * caption, 1, hidden, generator=gen).requires_grad_(True),
            "cond_index": torch.arange(instances),
        }
        return batch, state


def _noised_clip(clip: np.ndarray, *, seed: int, sample_id: int, patch: int):
    import torch

    from megatron_dip.models.batch import mix_seed

    gen = torch.Generator().manual_seed(mix_seed("dit-noise", seed, sample_id, 0))
    x0 = torch.from_numpy(np.ascontiguousarray(clip, dtype=np.float32))
    t = torch.rand((), generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    # Rectified flow: x_t = (1 - t) x0 + t noise, the model predicts the velocity noise - x0.
    noisy = (1 - t) * x0 + t * noise
    return patchify_clip(noisy, patch=patch), patchify_clip(noise - x0, patch=patch), t


def _clip_positions(shape: Sequence[int], patch: int) -> np.ndarray:
    t, _, h, w = shape
    grid = np.meshgrid(np.arange(t), np.arange(h // patch), np.arange(w // patch), indexing="ij")
    return np.stack([g.reshape(-1) for g in grid], axis=1)


DIT = register(DitModality())
