"""Binary serialization (round trip, determinism, corruption) and the text printout."""

from __future__ import annotations

import json
import pickle
import struct
import zlib
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_dip.schedule import (
    Backward,
    BatchTotals,
    ChunkSpec,
    Dependency,
    Forward,
    MemoryPolicy,
    MessageKey,
    MessageKind,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Plan,
    PlanError,
    Program,
    Recompute,
    Recv,
    Send,
    StageId,
    SubMicrobatch,
    TensorSpec,
    Wait,
    WorkId,
    build_1f1b_plan,
    build_interleaved_plan,
    format_plan,
    plan_from_bytes,
    plan_to_bytes,
)
from megatron_dip.schedule.ir import FORMAT_VERSION, RECOMPUTE_MODULES, Channels
from megatron_dip.schedule.serialize import MAGIC

# ---------------------------------------------------------------------------------------------
# Arbitrary plans: serialization must round-trip any Plan, valid or not.

_names = st.text(min_size=1, max_size=6)
_small = st.integers(0, 5)


@st.composite
def _stage(draw, modules):
    return StageId(draw(st.sampled_from(modules)), draw(_small), draw(_small), draw(_small))


@st.composite
def _instruction(draw, modules):
    key = MessageKey(
        draw(st.sampled_from(list(MessageKind))), draw(_stage(modules)), draw(_stage(modules))
    )
    specs = tuple(
        TensorSpec(draw(_names), tuple(draw(st.lists(st.integers(0, 9999), max_size=3))), dt)
        for dt in draw(st.lists(st.sampled_from(["float32", "bfloat16", "int64"]), max_size=2))
    )
    kind = draw(st.integers(0, 4))
    if kind == 0:
        mode = draw(st.sampled_from(list(Recompute)))
        layers = draw(st.integers(1, 40)) if mode.takes_layers else 0
        offload = draw(st.integers(0, 40)) if mode in (Recompute.NONE, Recompute.BLOCK) else 0
        cheap = mode in (Recompute.NONE, Recompute.SELECTIVE, Recompute.BLOCK) and not offload
        names = draw(st.sampled_from([(), ("layernorm",), ("mlp_act",), RECOMPUTE_MODULES]))
        policy = MemoryPolicy(mode, layers, offload, names if cheap else ())
        return Forward(draw(_stage(modules)), policy)
    if kind == 1:
        return Backward(draw(_stage(modules)))
    if kind == 4:
        return Wait(tuple(draw(st.lists(st.just(key), max_size=3))))
    return (Send, Recv)[kind - 2](key, draw(st.integers(0, 7)), specs)


@st.composite
def arbitrary_plans(draw):
    p = draw(st.integers(1, 4))
    modules = draw(st.lists(_names, min_size=1, max_size=3, unique=True))
    layouts = []
    for name in modules:
        n = draw(st.integers(1, 3))
        chunks = tuple(ChunkSpec(name, c, draw(st.integers(0, p - 1)), c, c + 1) for c in range(n))
        layouts.append(ModuleLayout(name, n, draw(st.booleans()), chunks))
    subs = {
        (m, mb, i): SubMicrobatch(m, mb, i, i, i + 1, *(draw(_small) for _ in range(6)))
        for m, mb, i in draw(st.lists(st.tuples(st.sampled_from(modules), _small, _small)))
    }
    works = [WorkId(m, mb, i) for m, mb, i in subs]
    deps = (
        draw(st.lists(st.tuples(st.sampled_from(works), st.sampled_from(works)))) if works else []
    )
    programs = tuple(
        Program(r, tuple(draw(st.lists(_instruction(modules), max_size=8)))) for r in range(p)
    )
    return Plan(
        iteration=draw(st.integers(0, 10**9)),
        placement=Placement(p, tuple(layouts)),
        microbatches=tuple(
            MicrobatchInfo(i, tuple(draw(st.lists(_small, max_size=3))), draw(_small))
            for i in range(draw(st.integers(0, 3)))
        ),
        submicrobatches=tuple(subs.values()),
        dependencies=tuple(Dependency(a, b) for a, b in deps),
        totals=BatchTotals(*(draw(_small) for _ in range(4))),
        programs=programs,
        replica=draw(_small),
        forward_only=draw(st.booleans()),
        name=draw(st.text(max_size=10)),
    )


@given(arbitrary_plans())
def test_any_plan_roundtrips_byte_identically(plan):
    data = plan_to_bytes(plan)
    again = plan_from_bytes(data)
    assert again == plan
    assert plan_to_bytes(again) == data


def test_equal_plans_give_identical_bytes():
    a = build_interleaved_plan(num_ranks=4, num_model_chunks=2, num_microbatches=8, iteration=3)
    b = build_interleaved_plan(num_ranks=4, num_model_chunks=2, num_microbatches=8, iteration=3)
    assert a is not b and plan_to_bytes(a) == plan_to_bytes(b)
    assert plan_to_bytes(replace(a, iteration=4)) != plan_to_bytes(a)


def test_compact():
    plan = build_interleaved_plan(num_ranks=8, num_model_chunks=4, num_microbatches=16)
    data = plan_to_bytes(plan)
    instructions = sum(len(p) for p in plan.programs)
    assert len(data) < len(pickle.dumps(plan)) / 10
    assert len(data) < 8 * instructions  # a few bytes per instruction


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture(scope="module")
def data():
    return plan_to_bytes(build_1f1b_plan(num_ranks=3, num_microbatches=4))


def test_every_truncation_is_a_plan_error(data):
    for n in range(len(data)):
        with pytest.raises(PlanError, match="truncated"):
            plan_from_bytes(data[:n])


def test_corruption_is_caught_by_crc(data):
    for i in range(17, len(data), 7):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(PlanError, match="CRC32 mismatch"):
            plan_from_bytes(bytes(bad))


def test_bad_magic(data):
    with pytest.raises(PlanError, match=r"not a serialized plan: starts with b'XIPPLAN'"):
        plan_from_bytes(b"X" + data[1:])
    with pytest.raises(PlanError, match="not a serialized plan"):
        plan_from_bytes(b"\x00" * 40)


def test_version_mismatch_names_both_versions(data):
    newer = data[:7] + struct.pack(">H", FORMAT_VERSION + 1) + data[9:]
    ours = f"this code reads version {FORMAT_VERSION}"
    with pytest.raises(PlanError, match=f"plan format version {FORMAT_VERSION + 1}, {ours}"):
        plan_from_bytes(newer)
    plan = replace(build_1f1b_plan(num_ranks=2, num_microbatches=2), version=7)
    with pytest.raises(PlanError, match=f"version 7, {ours}"):
        plan_from_bytes(plan_to_bytes(plan))


def _framed(payload: bytes) -> bytes:
    return struct.pack(">7sHII", MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload)) + payload


def test_malformed_payload_with_valid_crc(data):
    with pytest.raises(PlanError, match="malformed plan payload: KeyError"):
        plan_from_bytes(_framed(zlib.compress(b"{}")))
    with pytest.raises(PlanError, match="malformed plan payload: error"):
        plan_from_bytes(_framed(b"not zlib at all"))
    body = json.loads(zlib.decompress(data[17:]))
    body["programs"][0][0] = 9
    with pytest.raises(PlanError, match="unknown opcode 9 in program of rank 0"):
        plan_from_bytes(_framed(zlib.compress(json.dumps(body).encode())))
    body["programs"][0][0] = 0
    body["msgs"] = []  # instructions now name messages that do not exist
    with pytest.raises(PlanError, match="malformed plan payload: IndexError"):
        plan_from_bytes(_framed(zlib.compress(json.dumps(body).encode())))


def test_optional_sub_microbatch_fields_default_when_absent():
    """Rows written before input/context tokens existed decode with their defaults (0)."""
    sub = SubMicrobatch("dit", 0, 0, 0, 2, 40, 40, 800, 12, 9, 180)
    plan = replace(build_1f1b_plan(num_ranks=1, num_microbatches=1), submicrobatches=(sub,))
    data = plan_to_bytes(plan)
    assert plan_from_bytes(data).submicrobatches == (sub,)
    body = json.loads(zlib.decompress(data[17:]))
    body["subs"] = [row[:6] for row in body["subs"]]
    old = plan_from_bytes(_framed(zlib.compress(json.dumps(body).encode())))
    assert old.submicrobatches == (replace(sub, input_tokens=0, context_tokens=0, context_pairs=0),)


def test_unknown_instruction_cannot_be_serialized():
    plan = build_1f1b_plan(num_ranks=1, num_microbatches=1)
    bad = replace(plan, programs=(Program(0, ("nop",)),))
    with pytest.raises(PlanError, match="rank 0: cannot serialize instruction 'nop'"):
        plan_to_bytes(bad)


# ---------------------------------------------------------------------------------------------
# Text printout


def test_format_1f1b():
    text = format_plan(build_1f1b_plan(num_ranks=2, num_microbatches=2, iteration=9))
    assert text.splitlines() == [
        "plan 'megatron-1f1b' iteration 9 replica 0: 2 ranks, 2 microbatches, "
        "2 sub-microbatches, forward+backward",
        "r0: F model0.0 [>act(r1)] W1 F model0.1 [>act(r1) <grad(r1)] W2 B model0.0 "
        "[<grad(r1)] W1 B model0.1",
        "r1: [<act(r0)] W1 F model1.0 [<act(r0)] B model1.0 [>grad(r0)] W2 F model1.1 "
        "B model1.1 [>grad(r0)] W1",
    ]


def test_format_subs_and_recompute():
    chunks = (ChunkSpec("vit", 0, 0, 0, 1),)
    placement = Placement(1, (ModuleLayout("vit", 1, True, chunks),))
    subs = (SubMicrobatch("vit", 3, 0, 0, 1, 1, 1), SubMicrobatch("vit", 3, 1, 1, 2, 1, 1))
    s0, s1 = StageId("vit", 0, 3, 0), StageId("vit", 0, 3, 1)
    cheap = Forward(s1, MemoryPolicy(Recompute.SELECTIVE, 0, 0, RECOMPUTE_MODULES))
    program = (Forward(s0, MemoryPolicy(Recompute.FULL)), cheap, Backward(s1))
    plan = Plan(
        iteration=0,
        placement=placement,
        microbatches=(MicrobatchInfo(3, (0,), 4),),
        submicrobatches=subs,
        dependencies=(),
        totals=BatchTotals(1, 1, 1),
        programs=(Program(0, program),),
        name="x",
    )
    assert (
        format_plan(plan).splitlines()[1]
        == "r0: F vit0.3.0:full F vit0.3.1:sel:layernorm:mlp_act B vit0.3.1"
    )
    program = (
        Forward(s0, MemoryPolicy(Recompute.NONE, 0, 1)),
        Forward(s1, MemoryPolicy(Recompute.BLOCK, 1, 2)),
        Backward(s1),
    )
    plan = replace(plan, programs=(Program(0, program),))
    assert (
        format_plan(plan).splitlines()[1] == "r0: F vit0.3.0:off1 F vit0.3.1:block1:off2 B vit0.3.1"
    )
    assert plan_from_bytes(plan_to_bytes(plan)) == plan


def test_the_streams_a_plan_was_posted_for_survive_the_round_trip():
    plan = build_1f1b_plan(num_ranks=2, num_microbatches=2)
    assert plan.channels is Channels.SINGLE
    per_peer = replace(plan, channels=Channels.PER_PEER)
    assert plan_from_bytes(plan_to_bytes(per_peer)) == per_peer
    assert plan_to_bytes(per_peer) != plan_to_bytes(plan)
