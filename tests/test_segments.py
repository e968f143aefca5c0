"""The fixed-order multi-module segment plan builder."""

from __future__ import annotations

import random

import pytest

from megatron_dip.schedule import (
    Backward,
    BatchTotals,
    ChunkSpec,
    Dependency,
    Forward,
    MessageKind,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Recv,
    Send,
    SubMicrobatch,
    TensorSpec,
    WorkId,
    build_segment_plan,
    execute_programs,
    format_plan,
    plan_from_bytes,
    plan_to_bytes,
    validate_plan,
)
from megatron_dip.schedule.segments import module_order


def spread(name: str, chunks: int, p: int, trainable: bool = True) -> ModuleLayout:
    """`chunks` one-layer chunks, chunk c on rank c mod p."""
    return ModuleLayout(
        name, chunks, trainable, tuple(ChunkSpec(name, c, c % p, c, c + 1) for c in range(chunks))
    )


def subs_of(module: str, counts: list[int]) -> list[SubMicrobatch]:
    """counts[mb] sub-microbatches of two instances each in microbatch mb."""
    return [
        SubMicrobatch(module, mb, i, 2 * i, 2 * i + 2, 10 * (i + 1), 16 * (i + 1))
        for mb, n in enumerate(counts)
        for i in range(n)
    ]


def tensors(key):
    # Gradients mirror activations; the shape depends on the producing module.
    return (TensorSpec("h", (4, 8 if key.producer.module == "vit" else 16), "bfloat16"),)


def vlm_case(p: int = 3, vit_subs=(2, 0, 3), *, vit_trainable=True, llm_trainable=True):
    """ViT of 2P chunks feeding an LLM of P chunks; uneven ViT sub-microbatches."""
    placement = Placement(
        p, (spread("vit", 2 * p, p, vit_trainable), spread("llm", p, p, llm_trainable))
    )
    m = len(vit_subs)
    subs = subs_of("vit", list(vit_subs)) + subs_of("llm", [1] * m)
    deps = [Dependency(s.work, WorkId("llm", s.microbatch)) for s in subs if s.module == "vit"]
    return dict(
        placement=placement,
        microbatches=[MicrobatchInfo(i, (i,), 64) for i in range(m)],
        submicrobatches=subs,
        dependencies=deps,
        totals=BatchTotals(m, m, 64 * m),
        tensors=tensors,
    )


def t2v_case(p: int = 2, text_subs=(1, 2, 1), dit_subs=(2, 1, 3)):
    """Frozen text encoder (P chunks) conditioning a DiT (2P chunks)."""
    placement = Placement(p, (spread("text", p, p, False), spread("dit", 2 * p, p)))
    subs = subs_of("text", list(text_subs)) + subs_of("dit", list(dit_subs))
    deps = [
        Dependency(t.work, d.work)
        for t in subs
        for d in subs
        if t.module == "text" and d.module == "dit" and t.microbatch == d.microbatch
    ]
    m = len(text_subs)
    return dict(
        placement=placement,
        microbatches=[MicrobatchInfo(i, (2 * i, 2 * i + 1), 32) for i in range(m)],
        submicrobatches=subs,
        dependencies=deps,
        totals=BatchTotals(m, 2 * m, 100),
        tensors=tensors,
    )


def computes(plan, cls):
    return [i for prog in plan.programs for i in prog.instructions if isinstance(i, cls)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_vlm_segments_validate_roundtrip_and_run(p):
    plan = build_segment_plan(**vlm_case(p), iteration=5)
    validate_plan(plan)
    assert plan_to_bytes(plan_from_bytes(plan_to_bytes(plan))) == plan_to_bytes(plan)
    assert plan_from_bytes(plan_to_bytes(plan)) == plan
    # 5 ViT subs * 2P chunks + 3 LLM subs * P chunks, forward and backward.
    assert len(computes(plan, Forward)) == len(computes(plan, Backward)) == 13 * p
    rng = random.Random(p)
    times = {}
    result = execute_programs(
        plan.programs, compute_time=lambda r, i: times.setdefault(i, rng.uniform(0.1, 2.0))
    )
    assert result.makespan > 0
    # Every chunk of every module runs on every rank: the segments are spread.
    for prog in plan.programs:
        assert {i.stage.module for i in prog.compute()} == {"vit", "llm"}


def test_vlm_order_is_forwards_then_reversed_backwards():
    plan = build_segment_plan(**vlm_case(2))
    order = plan.programs[0].compute()
    n_fwd = len([i for i in order if isinstance(i, Forward)])
    assert all(isinstance(i, Forward) for i in order[:n_fwd])
    assert [i.stage for i in order[n_fwd:]] == [i.stage for i in reversed(order[:n_fwd])]
    # Microbatch by microbatch; within one, the ViT before the LLM.
    stages = [i.stage for i in order[:n_fwd]]
    assert [s.microbatch for s in stages] == sorted(s.microbatch for s in stages)
    mb0 = [s.module for s in stages if s.microbatch == 0]
    assert mb0 == sorted(mb0, key=["vit", "llm"].index)


def test_t2v_frozen_text_encoder_has_no_backward():
    plan = build_segment_plan(**t2v_case())
    validate_plan(plan)
    assert plan_from_bytes(plan_to_bytes(plan)) == plan
    assert computes(plan, Backward)
    assert not [b for b in computes(plan, Backward) if b.stage.module == "text"]
    for op in computes(plan, Send) + computes(plan, Recv):
        if op.key.kind is MessageKind.GRADIENT:
            assert op.key.producer.module != "text"
    # Conditioning crosses ranks (text chunk P-1 on rank P-1, DiT chunk 0 on rank 0).
    assert any(
        op.key.producer.module == "text" and op.key.consumer.module == "dit"
        for op in computes(plan, Send)
    )


def test_frozen_llm_still_backpropagates_to_trainable_vit():
    plan = build_segment_plan(**vlm_case(2, llm_trainable=False))
    validate_plan(plan)
    assert {b.stage.module for b in computes(plan, Backward)} == {"vit", "llm"}
    frozen_vit = build_segment_plan(**vlm_case(2, vit_trainable=False))
    validate_plan(frozen_vit)
    assert {b.stage.module for b in computes(frozen_vit, Backward)} == {"llm"}


def test_forward_only_segments():
    plan = build_segment_plan(**vlm_case(3), forward_only=True)
    validate_plan(plan)
    assert plan.forward_only and not computes(plan, Backward)
    assert all(op.key.kind is MessageKind.ACTIVATION for op in computes(plan, Send))
    assert "forward only" in format_plan(plan).splitlines()[0]


def test_module_order_and_cycles():
    case = vlm_case(2)
    # Placement lists vit first, but order follows the dependencies even if listed reversed.
    reversed_placement = Placement(2, tuple(reversed(case["placement"].modules)))
    assert module_order(reversed_placement, case["dependencies"]) == ["vit", "llm"]
    cyc = case["dependencies"] + [Dependency(WorkId("llm", 0), WorkId("vit", 0, 0))]
    with pytest.raises(ValueError, match="cycle"):
        module_order(case["placement"], cyc)


def test_dependency_across_microbatches_backwards_rejected():
    case = vlm_case(2)
    case["dependencies"] = [
        *case["dependencies"],
        Dependency(WorkId("vit", 2, 0), WorkId("llm", 0)),
    ]
    with pytest.raises(ValueError, match="points backwards"):
        build_segment_plan(**case)
