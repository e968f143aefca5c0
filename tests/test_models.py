"""Multimodal models from Megatron-Core layers: chunking invariance, masks, init, layout shapes.

One process, fp64, a world-size-1 gloo group created once for the session.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_dip.batching import (
    cross_module_dependencies,
    loss_tokens_of,
    message_tensors,
    split_samples,
)
from megatron_dip.data.packing import pack_microbatches
from megatron_dip.data.sample import IMAGE_TOKEN, Sample
from megatron_dip.data.synthetic import generate_meta, generate_samples, get_mixture
from megatron_dip.modalities import build_module_chunks, build_sub_batch
from megatron_dip.modalities.dit import patchify_clip, unpatchify_clip
from megatron_dip.models import ModelConfig
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.init import global_param_name
from megatron_dip.modelspec import tiny_t2v, tiny_vlm
from megatron_dip.parallel import ParallelShape
from megatron_dip.reference import (
    LocalPipeline,
    MessageMismatchError,
    check_message,
    reference_loss_and_grads,
)
from megatron_dip.schedule.ir import MessageKey, MessageKind, StageId, SubMicrobatch

SEQ = 64
CFG = ModelConfig(dtype="float64", adaln_zero=False, seed=7)
F64 = ParallelShape(dtype="float64")
VLM_RANGES = {"vit": [(0, 3), (3, 5), (5, 8)], "llm": [(0, 3), (3, 3), (3, 8)]}
T2V_RANGES = {"text": [(0, 3), (3, 8)], "dit": [(0, 3), (3, 5), (5, 8)]}


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    world = single_rank_world
    return ModelGroups(tp=world, cp=world, embedding=world)


def _vlm_sample(rng, sample_id: int, sizes: list[tuple[int, int]], tail: int = 5) -> Sample:
    parts, images = [], []
    for h, w in sizes:  # tiny ViT: 8-px patches, 2x2 merge -> (h/16)*(w/16) LLM tokens
        images.append(rng.standard_normal((3, h, w)).astype(np.float32))
        parts += [rng.integers(2, 128, size=3), np.full((h // 16) * (w // 16), IMAGE_TOKEN)]
    parts.append(rng.integers(2, 128, size=tail))
    return Sample(sample_id, np.concatenate(parts).astype(np.int64), {"vit": images})


def _vlm_batch(seed: int = 0) -> list[list[Sample]]:
    rng = np.random.default_rng(seed)
    return [
        [
            _vlm_sample(rng, 0, [(16, 16), (32, 16)]),
            _vlm_sample(rng, 1, []),
            _vlm_sample(rng, 2, [(16, 32)]),
        ],
        [_vlm_sample(rng, 3, [(16, 16), (16, 16), (32, 32)], tail=9)],
    ]


def _t2v_sample(rng, sample_id: int) -> Sample:
    caption = rng.integers(2, 128, size=int(rng.integers(3, 9)))
    frames = int(rng.integers(1, 3))
    clip = rng.standard_normal((frames, 4, 4, 4)).astype(np.float32)
    return Sample(sample_id, caption, {"dit": [clip]})


def _t2v_batch(seed: int = 0) -> list[list[Sample]]:
    rng = np.random.default_rng(seed)
    return [[_t2v_sample(rng, i) for i in range(3)], [_t2v_sample(rng, 3), _t2v_sample(rng, 4)]]


def _assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], rtol=1e-9, atol=1e-12, msg=name)


def test_models_and_modalities_packages_import_without_torch():
    for package in ("megatron_dip.models", "megatron_dip.modalities", "megatron_dip.batching"):
        code = f"import sys, {package}; assert 'torch' not in sys.modules, 'torch imported'"
        subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("make_model", "make_batch", "ranges", "sizes"),
    [
        (tiny_vlm, _vlm_batch, VLM_RANGES, {"vit": 2}),
        (tiny_t2v, _t2v_batch, T2V_RANGES, {"text": 2, "dit": 2}),
    ],
    ids=["vlm", "t2v"],
)
def test_chunking_invariance(groups, make_model, make_batch, ranges, sizes):
    """One chunk per module vs. several chunks and unequal sub-microbatches: same everything."""
    model, batch = make_model(), make_batch()
    loss_a, grads_a = reference_loss_and_grads(
        model, batch, seed=3, seq_length=SEQ, groups=groups, config=CFG
    )
    loss_b, grads_b = reference_loss_and_grads(
        model, batch, seed=3, seq_length=SEQ, groups=groups, config=CFG, ranges=ranges, sizes=sizes
    )
    assert loss_a == pytest.approx(loss_b, rel=1e-12)
    _assert_same_grads(grads_a, grads_b)
    # Every parameter of every module is reached (messages carry all gradients).
    assert all(g.abs().sum() > 0 for g in grads_a.values())
    assert {n.split(".")[0] for n in grads_a} == {m.name for m in model.modules}


def test_deterministic_init_is_layout_independent(groups):
    one = LocalPipeline.build(tiny_t2v(), config=CFG, groups=groups, seq_length=SEQ, seed=0)
    split = LocalPipeline.build(
        tiny_t2v(), config=CFG, groups=groups, seq_length=SEQ, seed=0, ranges=T2V_RANGES
    )
    a, b = one.params(), split.params()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    other = LocalPipeline.build(
        tiny_t2v(),
        config=ModelConfig(dtype="float64", seed=8),
        groups=groups,
        seq_length=SEQ,
        seed=0,
    ).params()
    assert not torch.equal(
        a["dit.layers.4.mlp.linear_fc1.weight"], other["dit.layers.4.mlp.linear_fc1.weight"]
    )


def test_global_param_name_maps_local_layers(groups):
    chunk = build_module_chunks(
        tiny_vlm(), "llm", [(0, 3), (3, 5), (5, 8)], config=CFG, groups=groups
    )[1]
    assert (
        global_param_name(chunk, "layers.1.mlp.linear_fc2.weight")
        == "llm.layers.4.mlp.linear_fc2.weight"
    )
    assert global_param_name(chunk, "module.layers.0.input_layernorm.weight") == (
        "llm.layers.3.input_layernorm.weight"
    )
    assert chunk.pre is None and chunk.post is None and len(chunk.layers) == 2
    # Megatron sets these only in its own init (skipped): DDP and TP-sharded init need them.
    fc1, proj = (
        chunk.layers[0].mlp.linear_fc1.weight,
        chunk.layers[0].self_attention.linear_proj.weight,
    )
    assert (fc1.tensor_model_parallel, fc1.partition_dim) == (True, 0)
    assert (proj.tensor_model_parallel, proj.partition_dim) == (True, 1)


class _TensorParallelRank:
    """Rank `rank` of a tensor-parallel group of `size` as the layers see it when built (they
    only ask for size and rank then): shards are built without starting `size` processes."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _params(model, groups, tp):
    chunks = [
        c
        for m in model.modules
        for c in build_module_chunks(
            model, m.name, [(0, 3), (3, m.num_layers)], config=CFG, groups=replace(groups, tp=tp)
        )
    ]
    return {global_param_name(c, n): p for c in chunks for n, p in c.named_parameters()}


@pytest.mark.parametrize("make_model", [tiny_vlm, tiny_t2v], ids=["vlm", "t2v"])
def test_tensor_parallel_shards_are_cut_from_the_tp1_weights(groups, make_model):
    """TP=2 starts from the TP=1 weights: every Column/RowParallelLinear and VocabParallel-
    Embedding parameter is marked tensor-parallel and holds its slice of the full draw."""
    model = make_model()
    full = _params(model, groups, groups.tp)
    shards = [_params(model, groups, _TensorParallelRank(r, 2)) for r in range(2)]
    split = 0
    for name, whole in full.items():
        parts = [s[name] for s in shards]
        if parts[0].shape == whole.shape:
            assert all(torch.equal(p, whole) for p in parts), name
            continue
        split += 1
        dim = parts[0].partition_dim
        assert all(p.tensor_model_parallel and p.partition_dim == dim for p in parts), name
        if model.module(name.split(".")[0]).layer.gated_mlp and "linear_fc1." in name:
            # Megatron's gated fc1 holds [gate shard; up shard] on each rank.
            halves = [torch.chunk(p, 2, dim=dim) for p in parts]
            rebuilt = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], dim)
        else:
            rebuilt = torch.cat(parts, dim=dim)
        torch.testing.assert_close(rebuilt, whole, rtol=0, atol=0, msg=name)
    assert split > 20


def _vlm_chunks(groups):
    model = tiny_vlm()
    vit = build_module_chunks(model, "vit", [(0, 8)], config=CFG, groups=groups)[0]
    llm = build_module_chunks(model, "llm", [(0, 4), (4, 8)], config=CFG, groups=groups)[0]
    return model, vit, llm


def _run_vit(model, vit, samples):
    sub = [
        s for s in split_samples(model, samples, microbatch=0, seq_length=SEQ) if s.module == "vit"
    ][0]
    return vit(inputs=[], batch=build_sub_batch(model, samples, sub, seq_length=SEQ, seed=0))


def test_image_embeddings_replace_placeholders(groups):
    model, vit, llm = _vlm_chunks(groups)
    samples = _vlm_batch()[0]
    embeddings = _run_vit(model, vit, samples)["vit.embeddings"]
    sub = [
        s for s in split_samples(model, samples, microbatch=0, seq_length=SEQ) if s.module == "llm"
    ][0]
    batch = build_sub_batch(model, samples, sub, seq_length=SEQ, seed=0)
    hidden = llm.parts.embed(llm, [{"vit.embeddings": embeddings}], batch)["hidden"][:, 0]
    where = batch.tensors["vit.positions"]
    assert where.numel() == embeddings.shape[0] == 5
    torch.testing.assert_close(hidden[where], embeddings)
    text = torch.ones(SEQ, dtype=torch.bool)
    text[where] = False
    torch.testing.assert_close(hidden[text], llm.pre.word_embeddings.weight[batch.token_ids[text]])
    with pytest.raises(ValueError, match="vit embeddings for 5 placeholder positions"):
        llm.parts.embed(llm, [{"vit.embeddings": embeddings[:-1]}], batch)


def test_vit_attends_within_each_image_only(groups):
    model, vit, _ = _vlm_chunks(groups)
    samples = _vlm_batch()[0]
    base = _run_vit(model, vit, samples)["vit.embeddings"]
    samples[2].media["vit"][0] = (
        samples[2].media["vit"][0] + 1.0
    )  # the third image: LLM rows 3 and 4
    changed = _run_vit(model, vit, samples)["vit.embeddings"]
    torch.testing.assert_close(changed[:3], base[:3], rtol=0, atol=0)
    assert not torch.allclose(changed[3:], base[3:])


def test_documents_and_causality_mask_llm_attention(groups):
    model, _, llm = _vlm_chunks(groups)
    rng = np.random.default_rng(1)
    samples = [_vlm_sample(rng, 0, []), _vlm_sample(rng, 1, [], tail=10)]  # 5 + 10 tokens
    sub = [
        s for s in split_samples(model, samples, microbatch=0, seq_length=SEQ) if s.module == "llm"
    ][0]

    def hidden():
        batch = build_sub_batch(model, samples, sub, seq_length=SEQ, seed=0)
        return llm(inputs=[], batch=batch)["hidden"][:, 0]

    base = hidden()
    samples[1].text[4] = (samples[1].text[4] + 1) % 126 + 2  # token 5 + 4 of the packed sequence
    changed = hidden()
    torch.testing.assert_close(changed[:9], base[:9], rtol=0, atol=0)  # doc 1, and doc 2 before
    for position in range(9, 15):
        assert not torch.allclose(changed[position], base[position])


def test_dit_noise_is_drawn_from_sample_ids_not_global_rng():
    model, samples = tiny_t2v(), _t2v_batch()[0]
    subs = split_samples(model, samples, microbatch=0, seq_length=SEQ, sizes={"dit": 2})
    whole = split_samples(model, samples, microbatch=0, seq_length=SEQ)
    dit_whole = [s for s in whole if s.module == "dit"][0]
    torch.manual_seed(0)
    a = build_sub_batch(model, samples, dit_whole, seq_length=SEQ, seed=5)
    torch.manual_seed(99)
    b = build_sub_batch(model, samples, dit_whole, seq_length=SEQ, seed=5)
    assert torch.equal(a.noisy, b.noisy) and torch.equal(a.timesteps, b.timesteps)
    second = [s for s in subs if s.module == "dit" and s.index == 1][0]
    part = build_sub_batch(model, samples, second, seq_length=SEQ, seed=5)
    offset = dit_whole.tokens - second.tokens
    assert torch.equal(part.noisy[: second.tokens], a.noisy[offset : dit_whole.tokens])
    assert torch.equal(part.timesteps, a.timesteps[2:])
    c = build_sub_batch(model, samples, dit_whole, seq_length=SEQ, seed=6)
    assert not torch.equal(a.noisy, c.noisy)


def test_patchify_clip_roundtrip():
    clip = torch.randn(2, 4, 6, 8)
    tokens = patchify_clip(clip, patch=2)
    assert tokens.shape == (2 * 3 * 4, 16)
    assert torch.equal(unpatchify_clip(tokens, shape=clip.shape, patch=2), clip)


def test_frozen_text_encoder_gets_no_grads(groups):
    model = tiny_t2v(train_text=False)
    pipe = LocalPipeline.build(
        model, config=CFG, groups=groups, seq_length=SEQ, seed=0, ranges=T2V_RANGES
    )
    pipe.forward_backward(_t2v_batch(), sizes={"text": 2})
    text = [p for c in pipe.chunks["text"] for p in c.parameters()]
    assert text and all(not p.requires_grad and p.grad is None for p in text)
    grads = pipe.grads()
    assert grads and all(name.startswith("dit.") for name in grads)
    assert all(g.abs().sum() > 0 for g in grads.values())


def test_chunks_take_tensor_and_sequence_parallelism_from_the_shape(groups):
    """The run's shape sets Megatron's TransformerConfig (no second flag on ModelConfig); a
    shape whose TP size is not the tensor-parallel group's is refused before any layer."""
    model = tiny_vlm()
    (chunk,) = build_module_chunks(model, "llm", [(0, 8)], config=CFG, groups=groups)
    assert chunk.config.tensor_model_parallel_size == 1 and not chunk.sequence_parallel
    with pytest.raises(ValueError, match="TP=2"):
        build_module_chunks(
            model, "llm", [(0, 8)], config=CFG, groups=groups, shape=ParallelShape(tp=2, sp=True)
        )


def test_tied_embeddings_across_chunks(groups):
    tied = ModelConfig(dtype="float64", seed=7)
    model = tiny_vlm().replace_module("llm", arch={"tie_embeddings": True})
    batch = _vlm_batch()
    no_group = ModelGroups(tp=groups.tp, cp=groups.cp)
    with pytest.raises(ValueError, match="ModelGroups.embedding"):
        build_module_chunks(model, "llm", [(0, 4), (4, 8)], config=tied, groups=no_group)
    one = reference_loss_and_grads(
        model, batch, seed=1, seq_length=SEQ, groups=no_group, config=tied
    )
    split = reference_loss_and_grads(
        model, batch, seed=1, seq_length=SEQ, groups=groups, config=tied, ranges=VLM_RANGES
    )
    assert "llm.post.output_layer.weight" not in one[1]
    assert one[0] == pytest.approx(split[0], rel=1e-12)
    _assert_same_grads(one[1], split[1])


def test_loss_normalisation_modes(groups):
    model, batch = tiny_vlm(), _vlm_batch()
    pipe = LocalPipeline.build(model, config=CFG, groups=groups, seq_length=SEQ, seed=0)
    sums = [
        tuple(float(t.detach()) for t in pipe.forward(mb, microbatch=i, sizes=None)[1:])
        for i, mb in enumerate(batch)
    ]
    per_mb = pipe.forward_backward(batch)
    per_token = pipe.forward_backward(batch, per_token_loss=True)
    assert float(per_mb) == pytest.approx(sum(s / n for s, n in sums) / len(sums), rel=1e-12)
    assert float(per_token) == pytest.approx(
        sum(s for s, _ in sums) / sum(n for _, n in sums), rel=1e-12
    )


def test_message_tensors_match_chunk_outputs_and_reject_others(groups):
    model, samples = tiny_t2v(), _t2v_batch()[0]
    sizes = {"text": 2, "dit": 1}
    subs = split_samples(model, samples, microbatch=0, seq_length=SEQ, sizes=sizes)
    lookup = {s.work: s for s in subs}.__getitem__
    deps = cross_module_dependencies(model, subs)
    assert [(d.producer.sub, d.consumer.sub) for d in deps] == [(0, 0), (0, 1), (1, 2)]
    # LocalPipeline checks every message it passes against message_tensors.
    pipe = LocalPipeline.build(
        model, config=CFG, groups=groups, seq_length=SEQ, seed=0, ranges=T2V_RANGES
    )
    stages, _, _ = pipe.forward(samples, microbatch=0, sizes=sizes)
    out = next(s for s in stages if s.stage == StageId("dit", 0, 0, 1)).outputs
    key = MessageKey(MessageKind.ACTIVATION, StageId("dit", 0, 0, 1), StageId("dit", 1, 0, 1))
    specs = message_tensors(model, key=key, sub_lookup=lookup, shape=F64)
    # Text sub 0 (captions 0 and 1) conditions dit sub 1 (clip 1), which carries caption 1 only.
    assert specs[2].shape == (len(samples[1].text), 1, 32) and specs[3].shape == (1,)
    assert torch.equal(out["cond_index"], torch.tensor([1]))
    assert [(s.name, s.shape) for s in specs] == [(n, tuple(out[n].shape)) for n in out]
    grad_key = MessageKey(MessageKind.GRADIENT, key.producer, key.consumer)
    grads = message_tensors(model, key=grad_key, sub_lookup=lookup, shape=F64)
    assert [s.name for s in grads] == ["hidden", "temb", "cond"]
    bad = dict(out, hidden=out["hidden"][:-1])
    with pytest.raises(MessageMismatchError):
        check_message(model, key=key, tensors=bad, lookup=lookup, dtype="float64")


def test_sequence_parallel_message_shapes():
    model = tiny_vlm()
    sub = SubMicrobatch("llm", 0, 0, 0, 1, 50, 64)
    key = MessageKey(MessageKind.ACTIVATION, StageId("llm", 0, 0), StageId("llm", 1, 0))
    specs = message_tensors(
        model, key=key, sub_lookup=lambda w: sub, shape=ParallelShape(tp=4, sp=True)
    )
    assert specs[0].shape == (16, 1, 32)
    with pytest.raises(ValueError, match="sequence parallelism"):
        message_tensors(
            model, key=key, sub_lookup=lambda w: sub, shape=ParallelShape(tp=3, sp=True)
        )


def test_sub_batch_refuses_token_counts_of_other_data():
    model, samples = tiny_vlm(), _vlm_batch()[0]
    real = sum(len(s.text) for s in samples)
    for tokens in (real, SEQ):  # an LLM sub may count real tokens or the whole padded sequence
        llm = SubMicrobatch("llm", 0, 0, 0, 1, tokens, SEQ)
        assert build_sub_batch(model, samples, llm, seq_length=SEQ, seed=0).token_ids.shape == (
            SEQ,
        )
    with pytest.raises(ValueError, match="the plan says"):
        build_sub_batch(
            model, samples, SubMicrobatch("llm", 0, 0, 0, 1, real + 1, SEQ), seq_length=SEQ, seed=0
        )
    with pytest.raises(ValueError, match="exceed seq_length"):
        build_sub_batch(
            model, samples, SubMicrobatch("llm", 0, 0, 0, 1, real, 2 * SEQ), seq_length=SEQ, seed=0
        )
    with pytest.raises(ValueError, match="the plan says"):
        build_sub_batch(
            model, samples, SubMicrobatch("vit", 0, 0, 0, 3, 99, 99), seq_length=SEQ, seed=0
        )


def test_tests_run_on_one_torch_thread():
    """conftest.py pins one intra-op thread (contention on shared cores made tests 30x slower)."""
    assert torch.get_num_threads() == 1


_T2V = get_mixture("t2v")
SHORT_T2V = replace(_T2V, sources=tuple(replace(s, seconds=(0.2, 0.6)) for s in _T2V.sources))


@pytest.mark.parametrize(
    ("make_model", "mixture", "sizes"),
    [(tiny_vlm, "mixed", {"vit": 2}), (tiny_t2v, SHORT_T2V, {"text": 2, "dit": 2})],
    ids=["vlm", "t2v"],
)
def test_metadata_loss_tokens_are_what_the_loss_chunk_counts(groups, make_model, mixture, sizes):
    """SampleMeta.loss_tokens summed over a microbatch == the loss chunk's "num_tokens"."""
    model, seq = make_model(), 256
    kwargs = {"model": model, "num_samples": 12, "seed": 4, "scale": 1 / 32}
    samples = {s.sample_id: s for s in generate_samples(mixture, **kwargs)}
    metas = generate_meta(mixture, **kwargs)
    packing = pack_microbatches(metas, seq_length=seq, max_instances_per_microbatch=8)
    pipe = LocalPipeline.build(model, config=CFG, groups=groups, seq_length=seq, seed=0)
    lost = 0
    with torch.no_grad():
        for i, mb in enumerate(packing):
            batch = [samples[m.sample_id] for m in mb.samples]
            _, _, num_tokens = pipe.forward(batch, microbatch=i, sizes=sizes)
            assert int(num_tokens) == sum(m.loss_tokens for m in mb.samples)
            assert int(num_tokens) == loss_tokens_of(model, batch)
            lost += sum(m.text_tokens - m.placeholder_tokens - m.loss_tokens for m in mb.samples)
    if mixture == "mixed":  # the old estimate (text minus placeholders) was off
        assert lost > 0
