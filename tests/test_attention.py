"""Packed-sequence attention (`models.attention`) against the dense-mask attention it replaces.

* the segmentation: segment ids -> lengths, and the mask the packed parameters describe equals
  the dense masks the modalities used to build, for every modality's sub-batches (padding,
  one-token segments, DiT clips -> their captions);
* the kernel: `PackedAttention` == Megatron's unfused `DotProductAttention` on the dense mask,
  causal or not, grouped-query, cross-attention with other kv segments, fp32 and fp64;
* whole models: loss and every gradient of tiny-vlm, tiny-t2v and tiny-omni on the packed path
  == the dense-mask path (`attention_reference.dense_reference`), padded sub-microbatches too;
  the PP / TP2 / sequence-parallel runs are compared with the dense reference in
  `test_runtime_dist.py`;
* no tensor of [.., S, S] (or [.., Sq, Skv] for cross-attention) is allocated by a forward.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_reference import (
    DenseMaskAttention,
    causal_mask,
    dense_cross_mask,
    dense_reference,
    dense_self_mask,
    implied_mask,
)
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dip.batching import split_samples
from megatron_dip.data.sample import Sample
from megatron_dip.modalities import build_sub_batch
from megatron_dip.models import ModelConfig, attention
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.common import transformer_config
from megatron_dip.modelspec import (
    IMAGE_TOKEN,
    LayerShape,
    ModuleSpec,
    tiny_omni,
    tiny_t2v,
    tiny_vlm,
)
from megatron_dip.parallel import ONE_PROCESS
from megatron_dip.reference import LocalPipeline, reference_loss_and_grads

SEQ = 48
F64 = ModelConfig(dtype="float64", adaln_zero=False, seed=7)
F32 = ModelConfig(dtype="float32", adaln_zero=False, seed=7)


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    from megatron_dip import megatron_compat
    from megatron_dip.cpu_support import seed_model_parallel_rng

    seed_model_parallel_rng(0)  # CPU fixes and the RNG tracker Megatron's attention enters
    megatron_compat.ensure_global_memory_buffer()
    return ModelGroups(tp=single_rank_world, cp=single_rank_world)


# -- batches with padding and one-token segments ---------------------------------------------


def _vlm_sample(rng, sample_id: int, sizes, text: int = 3) -> Sample:
    parts, images = [], []
    for h, w in sizes:  # 8-px patches, 2x2 merge
        images.append(rng.standard_normal((3, h, w)).astype(np.float32))
        parts += [rng.integers(2, 120, size=2), np.full((h // 16) * (w // 16), IMAGE_TOKEN)]
    parts.append(rng.integers(2, 120, size=text))
    return Sample(sample_id, np.concatenate(parts).astype(np.int64), {"vit": images})


def vlm_batch() -> list[list[Sample]]:
    rng = np.random.default_rng(0)
    one_token = Sample(2, np.array([5], dtype=np.int64), {"vit": []})  # a one-token document
    return [
        [_vlm_sample(rng, 0, [(16, 16), (32, 16), (16, 16)]), _vlm_sample(rng, 1, []), one_token],
        [_vlm_sample(rng, 3, [(16, 32), (16, 16)], text=9)],
    ]


def t2v_batch() -> list[list[Sample]]:
    rng = np.random.default_rng(1)

    def sample(i: int, caption: int, frames: int, side: int) -> Sample:
        clip = rng.standard_normal((frames, 4, side, side)).astype(np.float32)
        return Sample(i, rng.integers(2, 120, size=caption), {"dit": [clip]})

    # one-token caption, one-token clip (1 frame of 2x2 latents = 1 DiT token)
    return [[sample(0, 1, 1, 2), sample(1, 6, 2, 4), sample(2, 3, 1, 2)], [sample(3, 4, 2, 2)]]


def omni_batch() -> list[list[Sample]]:
    from test_runtime_setups import group_samples, samples

    return group_samples(samples("omni", 5), [3, 2])


MODELS = {
    "vlm": (tiny_vlm, vlm_batch, {"vit": 2}),
    "t2v": (tiny_t2v, t2v_batch, {"text": 2, "dit": 2}),
    "omni": (tiny_omni, omni_batch, {"vit": 1, "audio": 1}),
}


def _sub_batches(kind: str, *, pad: int):
    make_model, make_batch, sizes = MODELS[kind]
    model = make_model()
    for i, samples in enumerate(make_batch()):
        subs = split_samples(
            model, samples, microbatch=i, seq_length=SEQ, sizes=sizes, pad_multiple=pad
        )
        for sub in subs:
            yield model, sub, build_sub_batch(model, samples, sub, seq_length=SEQ, seed=0)


# -- segmentation ---------------------------------------------------------------------------


def test_segment_lengths_of_instances_and_padding():
    ids = torch.tensor
    assert attention.segment_lengths(ids([0, 0, 1, 1, 1, -1, -1])) == [2, 3, 2]
    assert attention.segment_lengths(ids([0, 1, 2])) == [1, 1, 1]
    assert attention.segment_lengths(ids([-1, -1])) == [2]
    assert attention.segment_lengths(ids([0, 0, 2])) == [2, 1]  # an empty instance 1
    assert attention.segment_lengths(ids([], dtype=torch.int64)) == []
    for bad in ([0, -1, 1], [1, 0], [0, 1, 0], [-1, 0]):
        with pytest.raises(ValueError, match="segment|padding"):
            attention.segment_lengths(ids(bad))


def test_packed_params_cover_the_pack():
    p = attention.packed_params([3, 1, 4], [2, 5, 1], device="cpu")
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 3, 4, 8] and p.cu_seqlens_kv.tolist() == [0, 2, 7, 8]
    assert p.cu_seqlens_q.dtype == torch.int32
    assert (p.max_seqlen_q, p.max_seqlen_kv) == (4, 5)
    with pytest.raises(ValueError, match="3 query segments but 2"):
        attention.packed_params([3, 1, 4], [2, 5], device="cpu")


def _varlen_of(keywords):
    """A CPU stand-in for torch's `varlen_attn` of a release taking `keywords`: SDPA per segment
    with what that release does by default (scale 1/sqrt(head dim), no causality, no GQA)."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **options):
        assert set(options) <= keywords, f"{sorted(options)} passed, {sorted(keywords)} taken"
        causal = options.get("is_causal", False) or options.get("window_size") == (-1, 0)
        if q.shape[1] != k.shape[1]:
            assert options.get("enable_gqa"), "grouped heads without enable_gqa"
        params = attention.PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
            max_seqlen_q=max_q, max_seqlen_kv=max_k,
        )  # fmt: skip
        scale = options.get("scale", 1 / math.sqrt(q.shape[-1]))
        return attention._run_segments(q, k, v, params, causal, scale)

    return kernel


# The varlen kernel's keywords in torch 2.9 (`is_causal`), 2.11 (no `enable_gqa`) and 2.13.
VARLEN_RELEASES = {
    "2.9": frozenset({"is_causal", "return_aux"}),
    "2.11": frozenset({"return_aux", "scale", "window_size"}),
    "2.13": frozenset({"return_aux", "scale", "window_size", "enable_gqa", "seqused_k"}),
}


@pytest.mark.parametrize("release", sorted(VARLEN_RELEASES))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kernel_of_every_torch_release_computes_the_packed_attention(
    monkeypatch, release, causal
):
    """The varlen kernel's keywords differ by torch release (on a GPU, torch 2.11 refused
    `enable_gqa`): what a release lacks is done before the call, with the same result as the
    per-segment kernel for grouped heads and a scale that is not the default."""
    keywords = VARLEN_RELEASES[release]
    monkeypatch.setattr(attention, "_varlen", lambda: _varlen_of(keywords))
    monkeypatch.setattr(attention, "_keywords", lambda kernel: keywords)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    params = attention.packed_params([4, 3, 2], device="cpu")
    want = attention._run_segments(q, k, v, params, causal, 0.3)
    got = attention._run_varlen(q, k, v, params, causal, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["vlm", "t2v", "omni"])
@pytest.mark.parametrize("pad", [1, 3])
def test_packed_params_mask_exactly_what_the_dense_masks_did(kind, pad):
    """Self-attention: identical everywhere; DiT cross-attention: identical on real tokens
    (padding rows now see the last clip's caption instead of row 0)."""
    seen = set()
    for model, sub, batch in _sub_batches(kind, pad=pad):
        modality = model.module(sub.module)
        causal = modality.kind in ("llm", "text_encoder")
        params = attention.self_attention_kwargs(batch.segments)["packed_seq_params"]
        want = dense_self_mask(batch.segments)[0, 0] | (
            causal and causal_mask(len(batch.segments), "cpu")
        )
        assert torch.equal(implied_mask(params, causal=causal), want), sub.work
        seen.add((modality.kind, sub.padded_tokens > sub.tokens))
        if modality.kind == "dit":
            _check_cross(batch)
    if pad > 1:
        assert all((k, True) in seen for k, _ in seen), f"padding not exercised: {seen}"


def _check_cross(batch) -> None:
    lengths = batch.caption_lengths
    # Conditioning of more captions than the clips need, in caption order.
    cond_index = torch.arange(len(lengths))
    rows = int(lengths.sum())
    cond = torch.arange(rows, dtype=torch.float64)[:, None, None]
    picked, kwargs = attention.cross_attention_inputs(
        segments=batch.segments,
        clip_caption=batch.clip_caption,
        caption_lengths=lengths,
        cond_index=cond_index,
        cond=cond,
    )
    gathered = implied_mask(kwargs["packed_seq_params"], causal=False)
    # Back to the rows of "cond": query t attends to row r iff it attends to a gathered copy of r.
    original = torch.ones(len(batch.segments), rows, dtype=torch.bool)
    for g, r in enumerate(picked[:, 0, 0].long().tolist()):
        original[:, r] &= gathered[:, g]
    real = batch.segments >= 0
    want = dense_cross_mask(cond_index, batch)[0, 0]
    assert torch.equal(original[real], want[real])
    assert (~original).any(dim=1).all(), "a fully masked cross-attention row"


# -- the kernel -------------------------------------------------------------------------------


def _attention_pair(groups, *, heads: int, kv_groups: int, dtype: str, causal: bool):
    shape = LayerShape(32, 64, heads, kv_groups)
    spec = ModuleSpec("m", "vit", 1, shape)
    tconfig = transformer_config(spec, ModelConfig(dtype=dtype), shape=ONE_PROCESS, style=_style())
    kind = attention.mask_type(causal=causal)
    args = {"config": tconfig, "layer_number": 1, "attn_mask_type": kind, "attention_type": "self"}
    collection = groups.collection()
    packed = attention.PackedAttention(**args, kernel="segments", pg_collection=collection)
    dense = DenseMaskAttention(**args, pg_collection=collection)
    return packed, dense


def _style():
    from megatron_dip.models.common import LayerStyle

    return LayerStyle()


CASES = {
    "one-token segments": ([1, 1, 1, 5, 1], None),
    "with padding": ([4, 7, 3], None),
    "one segment": ([9], None),
    "cross": ([3, 1, 4], [2, 5, 1]),
}
CAUSAL = [(c, False) for c in CASES] + [(c, True) for c in CASES if CASES[c][1] is None]


@pytest.mark.parametrize(("case", "causal"), CAUSAL)
@pytest.mark.parametrize(("heads", "kv_groups"), [(4, 4), (4, 2)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_packed_kernel_equals_megatron_dense_attention(
    groups, case, causal, heads, kv_groups, dtype
):
    q_lengths, kv_lengths = CASES[case]
    packed, dense = _attention_pair(
        groups, heads=heads, kv_groups=kv_groups, dtype=dtype, causal=causal
    )
    params = attention.packed_params(q_lengths, kv_lengths, device="cpu")
    sq, sk = sum(q_lengths), sum(kv_lengths or q_lengths)
    gen = torch.Generator().manual_seed(3)
    torch_dtype = getattr(torch, dtype)
    q = torch.randn(sq, heads, 8, generator=gen, dtype=torch_dtype, requires_grad=True)
    k, v = (
        torch.randn(sk, kv_groups, 8, generator=gen, dtype=torch_dtype, requires_grad=True)
        for _ in range(2)
    )
    out = packed(q, k, v, None, packed_seq_params=params)
    mask = implied_mask(params, causal=False)[None, None]  # DenseMaskAttention adds causality
    ref = dense(q[:, None], k[:, None], v[:, None], mask)[:, 0]
    tol = {"rtol": 1e-12, "atol": 1e-13} if dtype == "float64" else {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(out, ref, **tol)
    grad = torch.randn(out.shape, generator=gen, dtype=torch_dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_packed_attention_refuses_masks_and_missing_params(groups):
    packed, _ = _attention_pair(groups, heads=4, kv_groups=4, dtype="float32", causal=False)
    q = torch.randn(4, 4, 8)
    with pytest.raises(ValueError, match="no attention mask"):
        packed(q, q, q, torch.zeros(1, 1, 4, 4, dtype=torch.bool), packed_seq_params=None)
    with pytest.raises(ValueError, match="PackedSeqParams"):
        packed(q, q, q, None)
    with pytest.raises(ValueError, match="cover 5 query"):
        packed(q, q, q, None, packed_seq_params=attention.packed_params([5], device="cpu"))
    with pytest.raises(ValueError, match="kernel"):
        attention.PackedAttention(packed.config, 1, packed.attn_mask_type, "self", kernel="x")


# -- whole models -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vlm", "t2v", "omni"])
@pytest.mark.parametrize(
    ("config", "pad"), [(F64, 1), (F64, 3), (F32, 1)], ids=["f64", "f64-padded", "f32"]
)
def test_whole_model_packed_equals_dense_masks(groups, kind, config, pad):
    make_model, make_batch, sizes = MODELS[kind]
    model, batch = make_model(), make_batch()
    kwargs = dict(
        seed=3, seq_length=SEQ, groups=groups, config=config, sizes=sizes, pad_multiple=pad
    )
    loss, grads = reference_loss_and_grads(model, batch, **kwargs)
    with dense_reference():
        ref_loss, ref_grads = reference_loss_and_grads(model, batch, **kwargs)
    f64 = config.dtype == "float64"
    assert loss == pytest.approx(ref_loss, rel=1e-12 if f64 else 1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = float(ref_grads[name].abs().max())
        atol = (1e-12 if f64 else 1e-5) * max(scale, 1e-30)
        torch.testing.assert_close(
            g, ref_grads[name], rtol=1e-9 if f64 else 1e-3, atol=atol, msg=name
        )
    assert all(g.abs().sum() > 0 for g in ref_grads.values())


# -- no [S, S] tensor ---------------------------------------------------------------------------


class SquareWatch(TorchDispatchMode):
    """Records every tensor an op creates that has two adjacent dimensions (Sq, Sk) for one of
    the `squares` pairs: an attention mask, scores or probabilities over a whole pack."""

    def __init__(self, squares: set[tuple[int, int]]) -> None:
        super().__init__()
        self.squares, self.found = squares, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                dims = tuple(t.shape)
                if any(pair in self.squares for pair in zip(dims, dims[1:])):
                    self.found.append((str(func), dims))
        return out


def _watched_forward(model, batch, groups, config) -> list:
    """Forward of every microbatch; the [.., S, S] tensors any sub-microbatch's module made."""
    pipe = LocalPipeline.build(model, config=config, groups=groups, seq_length=SEQ, seed=0)
    found = []
    for i, samples in enumerate(batch):
        subs = split_samples(model, samples, microbatch=i, seq_length=SEQ)
        squares = {(s.padded_tokens, s.padded_tokens) for s in subs}
        # DiT cross-attention: clip tokens x caption tokens of the microbatch.
        captions = sum(len(s.text) for s in samples)
        squares |= {(s.padded_tokens, captions) for s in subs if s.module == "dit"}
        squares = {p for p in squares if min(p) > 16}  # larger than any segment and head dim
        watch = SquareWatch(squares)
        with watch:
            pipe.forward(samples, microbatch=i, sizes=None)
        found += watch.found
    return found


def _big_batch(kind: str) -> tuple:
    """Microbatches whose packs are long (every instance of a microbatch in one sub-microbatch)."""
    from test_runtime_setups import group_samples, model_of, samples

    if kind == "t2v":
        rng = np.random.default_rng(2)
        clips = [rng.standard_normal((2, 4, 4, 4)).astype(np.float32) for _ in range(6)]
        captions = [rng.integers(2, 120, size=n) for n in (5, 8, 3, 7, 6, 4)]
        items = [Sample(i, c, {"dit": [x]}) for i, (c, x) in enumerate(zip(captions, clips))]
        return tiny_t2v(), [items]
    items = samples(kind, 8)
    return model_of(kind), group_samples(items, [4, 4])


@pytest.mark.parametrize("kind", ["vlm", "t2v", "omni"])
def test_forward_allocates_no_sequence_square(groups, kind):
    model, batch = _big_batch(kind)
    assert _watched_forward(model, batch, groups, F32) == []
    with dense_reference():  # the watch does see the dense masks and scores
        assert _watched_forward(model, batch, groups, F32)
