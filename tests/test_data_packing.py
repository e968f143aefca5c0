"""pack_microbatches (the one packing of data side and planner) and split_replicas."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_dip.data.packing import (
    FirstFitPacker,
    PackingLimits,
    pack_microbatches,
    split_replicas,
)
from megatron_dip.data.sample import InstanceCounts, SampleMeta


def _vlm(sid, text, images=0, llm=10):
    return SampleMeta(sid, text, {"vit": InstanceCounts((4 * llm,) * images, (llm,) * images)})


def _clip(sid, frames, per_frame=16):
    return SampleMeta(sid, 20, {"dit": InstanceCounts((frames * per_frame,), (), (frames,))})


def test_first_fit_hand_case_keeps_data_order_inside_microbatches():
    metas = [_vlm(0, 6), _vlm(1, 6), _vlm(2, 3, 1), _vlm(3, 4), _vlm(4, 1)]
    packing = pack_microbatches(metas, seq_length=10)
    # 0 -> mb0 (6), 1 -> mb1 (6), 2 -> mb0 (9), 3 -> mb1 (10), 4 -> mb0 (10)
    assert [mb.sample_ids for mb in packing] == [(0, 2, 4), (1, 3)]
    assert [mb.text_tokens for mb in packing] == [10, 10]
    assert packing[0].instances_of("vit") == InstanceCounts((40,), (10,))
    assert packing[0].instances_per_sample == (0, 1, 0)
    assert packing[0].sample_text_tokens == (6, 3, 1)
    assert [mb.index for mb in packing] == [0, 1]
    assert packing.skipped == ()


def test_first_fit_decreasing_packs_tighter_and_stays_deterministic():
    sizes = [3, 3, 3, 7, 7, 7]
    metas = [_vlm(i, t) for i, t in enumerate(sizes)]
    ff = pack_microbatches(metas, seq_length=10)
    ffd = pack_microbatches(metas, seq_length=10, policy="first_fit_decreasing")
    assert len(ff) == 4 and len(ffd) == 3
    assert [mb.sample_ids for mb in ffd] == [(0, 3), (1, 4), (2, 5)]
    assert [mb.sample_ids for mb in ffd] == [
        mb.sample_ids
        for mb in pack_microbatches(metas, seq_length=10, policy="first_fit_decreasing")
    ]


def test_instance_cap_and_t2v_frame_budget():
    metas = [_vlm(i, 1, images=1) for i in range(5)]
    assert [
        len(mb.sample_ids)
        for mb in pack_microbatches(metas, seq_length=100, max_instances_per_microbatch=2)
    ] == [2, 2, 1]
    clips = [_clip(0, 64), _clip(1, 8), _clip(2, 40), _clip(3, 24)] + [
        _clip(4 + i, 1) for i in range(9)
    ]
    packing = pack_microbatches(clips, limits=PackingLimits.t2v())
    for mb in packing:
        assert mb.num_instances <= 8 and mb.frames <= 64
    assert packing[0].sample_ids == (0,)
    assert packing[1].sample_ids == (1, 2, 4, 5, 6, 7, 8, 9)  # clip cap reached at 8
    assert packing[2].sample_ids == (3, 10, 11, 12)


def test_oversize_error_names_sample_and_skip_reports_it(caplog):
    metas = [_vlm(0, 5), _vlm(17, 50), _vlm(2, 5)]
    with pytest.raises(ValueError, match="sample 17 has 50 text tokens"):
        pack_microbatches(metas, seq_length=10)
    packing = pack_microbatches(metas, seq_length=10, on_oversize="skip")
    assert packing.skipped == (17,)
    assert [mb.sample_ids for mb in packing] == [(0, 2)]
    assert "sample 17" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_length": 10}, "no samples"),
        ({}, "needs limits or seq_length"),
        ({"seq_length": 10, "limits": PackingLimits(max_instances=2)}, "either limits"),
        ({"seq_length": 10, "policy": "best_fit"}, "unknown packing policy"),
    ],
)
def test_bad_calls(kwargs, message):
    samples = [] if message == "no samples" else [_vlm(0, 1)]
    with pytest.raises(ValueError, match=message):
        pack_microbatches(samples, **kwargs)


def test_duplicate_ids_and_all_oversize_are_errors():
    with pytest.raises(ValueError, match="duplicate"):
        pack_microbatches([_vlm(1, 1), _vlm(1, 2)], seq_length=10)
    with pytest.raises(ValueError, match="all 1 samples are oversize"):
        pack_microbatches([_vlm(1, 20)], seq_length=10, on_oversize="skip")
    with pytest.raises(ValueError, match="at least one limit"):
        PackingLimits()


metas_strategy = st.lists(
    st.tuples(st.integers(1, 40), st.integers(0, 4), st.integers(0, 20)), min_size=1, max_size=60
)


@given(metas_strategy, st.sampled_from(["first_fit", "first_fit_decreasing"]))
def test_packing_properties(rows, policy):
    metas = [
        SampleMeta(i, t + 9 * k, {"dit": InstanceCounts((f * 3,) * k, (9,) * k, (f,) * k)})
        for i, (t, k, f) in enumerate(rows)
    ]
    limits = PackingLimits(seq_length=80, max_instances=6, max_frames=50)
    if all(m.frames > 50 for m in metas):
        with pytest.raises(ValueError, match="oversize"):
            pack_microbatches(metas, limits=limits, on_oversize="skip")
        return
    packing = pack_microbatches(metas, limits=limits, policy=policy, on_oversize="skip")
    placed = [sid for mb in packing for sid in mb.sample_ids]
    assert sorted(placed + list(packing.skipped)) == list(range(len(metas)))
    for mb in packing:
        assert list(mb.sample_ids) == sorted(mb.sample_ids)  # data order inside
        assert mb.text_tokens <= 80 and mb.num_instances <= 6 and mb.frames <= 50
    firsts = [mb.sample_ids[0] for mb in packing]
    assert firsts == sorted(firsts)
    if policy == "first_fit":  # the batch packing equals the online packer sample by sample
        packer = FirstFitPacker(limits)
        for m in metas:
            if m.sample_id not in packing.skipped:
                packer.add(m)
        assert [tuple(x.sample_id for x in b) for b in packer.bins()] == [
            mb.sample_ids for mb in packing
        ]


def test_split_replicas_lpt_balances_and_keeps_data_order():
    metas = [_vlm(i, t) for i, t in enumerate([8, 7, 6, 5, 4])]
    split = split_replicas(metas, num_replicas=2, cost=lambda m: m.text_tokens)
    # LPT: 8->r0, 7->r1, 6->r1 (7<8), 5->r0 (8<13), 4->r0 (13=13, r0 has fewer... tie on count)
    assert [[m.sample_id for m in r] for r in split] == [[0, 3, 4], [1, 2]]
    assert [sum(m.text_tokens for m in r) for r in split] == [17, 13]


def test_split_replicas_gives_every_replica_data_even_at_zero_cost():
    metas = [_vlm(i, 1) for i in range(6)]
    split = split_replicas(metas, num_replicas=3, cost=lambda m: 0.0)
    assert [[m.sample_id for m in r] for r in split] == [[0, 3], [1, 4], [2, 5]]


def test_split_replicas_rejects_bad_input():
    metas = [_vlm(i, 1) for i in range(2)]
    with pytest.raises(ValueError, match="cannot feed 3 replicas"):
        split_replicas(metas, num_replicas=3, cost=lambda m: 1.0)
    with pytest.raises(ValueError, match="sample 0: cost nan"):
        split_replicas(metas, num_replicas=1, cost=lambda m: float("nan"))


@given(st.lists(st.floats(0, 100), min_size=4, max_size=40), st.integers(1, 4))
def test_split_replicas_within_lpt_bound(costs, replicas):
    metas = [_vlm(i, 1) for i in range(len(costs))]
    split = split_replicas(metas, num_replicas=replicas, cost=lambda m: costs[m.sample_id])
    assert sorted(m.sample_id for r in split for m in r) == list(range(len(costs)))
    loads = [sum(costs[m.sample_id] for m in r) for r in split]
    # Graham's bound for greedy list scheduling (LPT is one).
    assert max(loads) <= sum(costs) / replicas + max(costs) + 1e-9
    assert all(r for r in split)
    for r in split:
        assert [m.sample_id for m in r] == sorted(m.sample_id for m in r)
