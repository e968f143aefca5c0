"""Where a chunk's tensors lie in the global checkpoint tensors (`models.sharded`), in one process.

* The flat ranges of the distributed optimizer are cut into hyper-rectangles that cover exactly
  the range, in order.
* Built at TP=2 (both ranks' shards, in one process), every chunk's ShardedTensors put each
  element of the TP=1 weights exactly once where the TP=1 run has it, gated fc1 halves included;
  so do the distributed optimizer's flat ranges of any data-parallel split.
* The gated fc1 layout is Megatron-Core's own (`apply_swiglu_sharded_factory`), replicated
  parameters are main replicas on TP rank 0 only, and a tied embedding's second copy never.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_models import CFG, _TensorParallelRank

from megatron_dip.modalities import build_module_chunks
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.config import ModelConfig
from megatron_dip.models.init import global_param_name
from megatron_dip.models.sharded import chunk_layouts, flat_blocks
from megatron_dip.modelspec import tiny_omni, tiny_t2v, tiny_vlm


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    world = single_rank_world
    return ModelGroups(tp=world, cp=world, embedding=world)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_blocks_cover_a_range_exactly_and_in_order(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for end in range(start, numel + 1):
            blocks = flat_blocks(shape, start, end)
            assert len(blocks) <= max(1, 2 * len(shape) - 1)
            covered = []
            for offset, size, first in blocks:
                region = index[tuple(slice(o, o + s) for o, s in zip(offset, size))]
                assert region.flatten().tolist() == list(range(first, first + region.numel()))
                covered += region.flatten().tolist()
            assert covered == list(range(start, end)), (shape, start, end, blocks)


def _chunks(model, groups, tp, config=CFG):
    return [
        c
        for m in model.modules
        for c in build_module_chunks(
            model, m.name, [(0, 3), (3, m.num_layers)], config=config, groups=replace(groups, tp=tp)
        )
    ]


def _place(canvas: dict, counts: dict, tensors, *, main_only: bool = True) -> None:
    for t in tensors if isinstance(tensors, list) else [tensors]:
        if main_only and any(t.replica_id):
            continue
        where = tuple(slice(o, o + s) for o, s in zip(t.global_offset, t.local_shape))
        canvas.setdefault(t.key, torch.zeros(t.global_shape, dtype=t.dtype))[where] = t.data
        counts.setdefault(t.key, torch.zeros(t.global_shape, dtype=torch.int64))[where] += 1


@pytest.mark.parametrize("make_model", [tiny_vlm, tiny_t2v, tiny_omni], ids=["vlm", "t2v", "omni"])
def test_tp2_shards_assemble_the_tp1_weights_exactly_once(groups, make_model):
    model = make_model()
    full = {
        global_param_name(c, n): p
        for c in _chunks(model, groups, groups.tp)
        for n, p in c.named_parameters()
    }
    canvas, counts = {}, {}
    for rank in range(2):
        for chunk in _chunks(model, groups, _TensorParallelRank(rank, 2)):
            for tensors in chunk.sharded_state_dict().values():
                _place(canvas, counts, tensors)
    assert set(canvas) == set(full)
    for key, whole in full.items():
        assert torch.equal(counts[key], torch.ones_like(counts[key])), key
        torch.testing.assert_close(canvas[key], whole.detach(), rtol=0, atol=0, msg=key)


def test_distributed_optimizer_ranges_assemble_the_same_tensors(groups):
    """Any contiguous split of each TP shard's flattened elements over data-parallel ranks, cut
    into rectangles, lands exactly where the whole shard does."""
    model = tiny_vlm()
    gen = torch.Generator().manual_seed(0)
    for rank in range(2):
        for chunk in _chunks(model, groups, _TensorParallelRank(rank, 2)):
            params = dict(chunk.named_parameters())
            for name, layout in chunk_layouts(chunk).items():
                p = params[name].detach()
                whole, once = {}, {}
                _place(whole, once, layout.tensors("k", p, data_parallel=0))
                cuts = sorted(torch.randint(0, p.numel() + 1, (2,), generator=gen).tolist())
                pieces, counts = {}, {}
                flat = p.reshape(-1)
                for a, b in zip([0, *cuts], [*cuts, p.numel()]):
                    _place(pieces, counts, layout.flat_tensors("k", flat[a:b], start=a))
                if layout.alias or layout.tp_replica:
                    continue  # copies that are never written
                region = once["k"] > 0
                assert torch.equal(counts["k"], once["k"]), name
                assert torch.equal(pieces["k"][region], whole["k"][region]), name


def test_gated_fc1_layout_is_megatrons_swiglu_factory(groups):
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    model = tiny_vlm()
    for rank in range(2):
        llm = _chunks(model, groups, _TensorParallelRank(rank, 2))[2]
        ours = llm.sharded_state_dict()["layers.0.mlp.linear_fc1.weight"]
        fc1 = llm.layers[0].mlp.linear_fc1.weight.detach()
        plain = ShardedTensor.from_rank_offsets(ours[0].key, fc1, (0, rank, 2))
        megatron = apply_swiglu_sharded_factory(plain, ()).build()
        assert [(t.key, t.global_shape, t.global_offset, t.local_shape) for t in ours] == [
            (t.key, t.global_shape, t.global_offset, t.local_shape) for t in megatron
        ]
        assert all(torch.equal(a.data, b.data) for a, b in zip(ours, megatron))


def test_replica_ids_follow_megatrons_pp_tp_dp_convention(groups):
    model = tiny_vlm()
    dp = _TensorParallelRank(1, 2)  # any object with rank(): the data-parallel group
    chunk = _chunks(model, groups, _TensorParallelRank(1, 2))[2]  # llm layers 0-2, TP rank 1
    state = chunk.sharded_state_dict(metadata={"dp_cp_group": dp})
    assert state["layers.0.self_attention.linear_qkv.weight"].replica_id == (0, 0, 1)
    assert state["layers.0.input_layernorm.weight"].replica_id == (0, 1, 1)  # every TP rank
    with pytest.raises(ValueError, match="sharded_offsets"):
        chunk.sharded_state_dict(sharded_offsets=((0, 0, 1),))


def test_tied_embedding_copy_is_never_the_written_replica(groups):
    tied = ModelConfig(dtype="float64", seed=7)
    model = tiny_vlm().replace_module("llm", arch={"tie_embeddings": True})
    first, last = build_module_chunks(model, "llm", [(0, 4), (4, 8)], config=tied, groups=groups)
    embedding = first.sharded_state_dict()["pre.word_embeddings.weight"]
    copy = last.sharded_state_dict()["post.tied_weight"]
    assert copy.key == embedding.key == "llm.pre.word_embeddings.weight"
    assert embedding.replica_id == (0, 0, 0) and copy.replica_id == (1, 0, 0)
