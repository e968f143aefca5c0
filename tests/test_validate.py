"""validate_plan and check_plan_matches: every error path, with the message it must give."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from megatron_dip.schedule import (
    FORMAT_VERSION,
    Backward,
    BatchTotals,
    Channels,
    ChunkSpec,
    DeadlockError,
    Dependency,
    Forward,
    MessageKey,
    MessageKind,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    PlanError,
    Program,
    Recv,
    Send,
    StageId,
    SubMicrobatch,
    TensorSpec,
    Wait,
    WorkId,
    build_1f1b_plan,
    build_segment_plan,
    check_channel_order,
    check_plan_matches,
    execute_programs,
    validate_plan,
)
from megatron_dip.schedule.engine import per_peer_channel

HIDDEN = (TensorSpec("hidden", (1,)),)


def st(chunk, mb, module="model"):
    return StageId(module, chunk, mb)


def act(mb):
    return MessageKey(MessageKind.ACTIVATION, st(0, mb), st(1, mb))


def grad(mb):
    return MessageKey(MessageKind.GRADIENT, st(0, mb), st(1, mb))


def base():
    """1F1B, P=2, M=2. Rank 0: F0 S(act0) W F1 S(act1) R(grad0) W B0 R(grad1) W B1.
    Rank 1: R(act0) W F0 R(act1) B0 S(grad0) W F1 B1 S(grad1) W."""
    plan = build_1f1b_plan(num_ranks=2, num_microbatches=2)
    assert plan.programs[0].instructions[1] == Send(act(0), 1, HIDDEN)
    assert plan.programs[1].instructions[4] == Backward(st(1, 0))
    return plan


def edit(plan, rank, fn):
    ins = list(plan.programs[rank].instructions)
    out = fn(ins)
    programs = list(plan.programs)
    programs[rank] = Program(rank, tuple(ins if out is None else out))
    return replace(plan, programs=tuple(programs))


def two_modules(p=2, *, vit_trainable=True, forward_only=False):
    """ViT (2 chunks) -> LLM (2 chunks), chunk c on rank c mod p, two microbatches."""
    layouts = tuple(
        ModuleLayout(
            m,
            2,
            m != "vit" or vit_trainable,
            tuple(ChunkSpec(m, c, c % p, c, c + 1) for c in range(2)),
        )
        for m in ("vit", "llm")
    )
    subs = [SubMicrobatch(m, mb, 0, 0, 1, 4, 4) for mb in range(2) for m in ("vit", "llm")]
    deps = [Dependency(WorkId("vit", mb), WorkId("llm", mb)) for mb in range(2)]
    return build_segment_plan(
        placement=Placement(p, layouts),
        microbatches=[MicrobatchInfo(i, (i,), 4) for i in range(2)],
        submicrobatches=subs,
        dependencies=deps,
        totals=BatchTotals(2, 2, 8),
        tensors=lambda key: HIDDEN,
        forward_only=forward_only,
    )


def test_valid_plans_pass():
    validate_plan(base())
    validate_plan(two_modules())
    validate_plan(two_modules(1))
    validate_plan(two_modules(vit_trainable=False))
    validate_plan(two_modules(forward_only=True))


def _subs(plan, *extra, drop=0):
    return replace(plan, submicrobatches=plan.submicrobatches[drop:] + tuple(extra))


def _insert(rank, index, ins):
    return lambda plan: edit(plan, rank, lambda x: x.insert(index, ins))


def _set(rank, index, ins):
    return lambda plan: edit(plan, rank, lambda x: x.__setitem__(index, ins))


def _delete(rank, *indices):
    return lambda plan: edit(plan, rank, lambda x: [i for k, i in enumerate(x) if k not in indices])


def _swap(rank, a, b):
    def fn(x):
        x[a], x[b] = x[b], x[a]

    return lambda plan: edit(plan, rank, fn)


SUB0 = SubMicrobatch("model", 0, 0, 0, 1, 1, 1)
FLAT = Placement(
    2,
    (ModuleLayout("model", 2, False, tuple(ChunkSpec("model", c, c, c, c + 1) for c in range(2))),),
)

BASE_ERRORS = [
    (
        "version",
        lambda p: replace(p, version=FORMAT_VERSION + 1),
        f"plan format version {FORMAT_VERSION + 1}, this code understands version {FORMAT_VERSION}",
    ),
    (
        "duplicate microbatch",
        lambda p: replace(p, microbatches=(p.microbatches[0],) * 2),
        "microbatch table has duplicate indices",
    ),
    (
        "unknown module",
        lambda p: _subs(p, replace(SUB0, module="ghost")),
        "module 'ghost' is not in the placement",
    ),
    (
        "unknown microbatch",
        lambda p: _subs(p, replace(SUB0, microbatch=9)),
        "microbatch 9 is not in the microbatch table",
    ),
    (
        "padding",
        lambda p: _subs(p, replace(SUB0, padded_tokens=0), drop=1),
        "needs 0 <= tokens <= padded_tokens",
    ),
    (
        "reversed",
        lambda p: _subs(p, replace(SUB0, instance_start=3), drop=1),
        "instances [3, 1) reversed",
    ),
    (
        "numbering",
        lambda p: _subs(p, replace(SUB0, index=1), drop=1),
        "are numbered [1], expected 0..0",
    ),
    (
        "gap",
        lambda p: _subs(p, replace(SUB0, index=1, instance_start=2, instance_end=3)),
        "instances start at 2, expected 1",
    ),
    (
        "offset",
        lambda p: _subs(p, replace(SUB0, instance_start=1, instance_end=2), drop=1),
        "start at 1, expected 0",
    ),
    (
        "wrong rank",
        _insert(0, 0, Forward(st(1, 0))),
        "rank 0: instruction 0 (F model1[mb0.0]): chunk model1 lives on rank 1",
    ),
    (
        "unknown stage",
        _insert(0, 0, Forward(st(0, 5))),
        "rank 0: instruction 0 (F model0[mb5.0]): sub-microbatch model[mb5.0] is not in the table",
    ),
    ("unknown chunk", _insert(0, 0, Forward(st(7, 0))), "module model has no chunk 7"),
    (
        "forward-only",
        lambda p: replace(p, forward_only=True),
        "rank 0: instruction 7 (B model0[mb0.0]): a forward-only plan has a Backward",
    ),
    (
        "frozen",
        lambda p: replace(p, placement=FLAT),
        "rank 0: instruction 5 (recv grad:model0[mb0.0]->model1[mb0.0] from 1): grad:model0[mb0.0]->model1[mb0.0] is not an edge",
    ),
    (
        "backward first",
        _swap(1, 2, 4),
        "rank 1: instruction 2 (B model1[mb0.0]): Backward before its Forward",
    ),
    (
        "not waited",
        _delete(1, 1),
        "rank 1: instruction 1 (F model1[mb0.0]): input act:model0[mb0.0]->model1[mb0.0] from rank 0 is not received",
    ),
    (
        "not received",
        lambda p: edit(p, 1, lambda x: x[2:]),
        "rank 1: instruction 0 (F model1[mb0.0]): input act:",
    ),
    (
        "grad not received",
        _set(0, 6, Wait((act(1),))),
        "rank 0: instruction 7 (B model0[mb0.0]): input grad:model0[mb0.0]->model1[mb0.0] from rank 1",
    ),
    (
        "wrong sender",
        _insert(1, 0, Send(act(0), 0, HIDDEN)),
        "rank 1: instruction 0 (send act:model0[mb0.0]->model1[mb0.0] to 0): the sender of",
    ),
    (
        "wrong receiver",
        _insert(0, 0, Recv(act(0), 1, HIDDEN)),
        "the receiver of act:model0[mb0.0]->model1[mb0.0] is rank 1",
    ),
    (
        "wrong peer",
        _set(0, 1, Send(act(0), 0, HIDDEN)),
        "rank 0: instruction 1 (send act:model0[mb0.0]->model1[mb0.0] to 0): peer should be rank 1, not 0",
    ),
    (
        "posted twice",
        _insert(0, 2, Send(act(0), 1, HIDDEN)),
        "rank 0: instruction 2 (send act:model0[mb0.0]->model1[mb0.0] to 1): act:model0[mb0.0]->model1[mb0.0] already posted at instruction 1",
    ),
    (
        "send early",
        _swap(0, 0, 1),
        "rank 0: instruction 0 (send act:model0[mb0.0]->model1[mb0.0] to 1): send before its producing compute",
    ),
    (
        "not an edge",
        _insert(0, 1, Send(MessageKey(MessageKind.ACTIVATION, st(0, 0), st(1, 1)), 1, HIDDEN)),
        "act:model0[mb0.0]->model1[mb1.0] is not an edge of the data flow",
    ),
    (
        "wait unposted",
        _insert(0, 0, Wait((grad(0),))),
        "rank 0: instruction 0 (wait grad:model0[mb0.0]->model1[mb0.0]): waits for grad:model0[mb0.0]->model1[mb0.0], which this rank has not posted",
    ),
    (
        "unknown type",
        _insert(0, 0, "nop"),
        "rank 0: instruction 0 ('nop'): unknown instruction type str",
    ),
    (
        "two forwards",
        lambda p: edit(p, 0, lambda x: [*x, Forward(st(0, 0))]),
        "stage model0[mb0.0] needs 1 Forward, found 2 (rank 0 instruction 0, rank 0 instruction 11)",
    ),
    (
        "no backward",
        _delete(0, 10),
        "stage model0[mb1.0] needs 1 Backward, found 0 (nowhere); rank 0 owns its chunk",
    ),
    (
        "no send",
        _delete(0, 1, 2),
        "rank 1: instruction 0 (recv act:model0[mb0.0]->model1[mb0.0] from 0): no matching Send on any rank",
    ),
    (
        "no recv",
        lambda p: _set(1, 0, Wait(()))(_delete(1, 1)(_set(1, 5, Send(grad(0), 0, HIDDEN))(p))),
        "input act:model0[mb0.0]",
    ),
    (
        "shapes",
        _set(1, 0, Recv(act(0), 0, (TensorSpec("hidden", (2,)),))),
        "rank 0: instruction 1 (send act:model0[mb0.0]->model1[mb0.0] to 1): sends tensors",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "fragment"), [c[1:] for c in BASE_ERRORS], ids=[c[0] for c in BASE_ERRORS]
)
def test_error_paths_on_1f1b(mutate, fragment):
    plan = mutate(base())
    with pytest.raises(PlanError) as err:
        validate_plan(plan)
    assert fragment in str(err.value)


def test_local_edge_message_rejected():
    plan = two_modules(p=1)
    key = MessageKey(MessageKind.ACTIVATION, st(0, 0, "vit"), st(1, 0, "vit"))
    plan = _insert(0, 1, Send(key, 0, HIDDEN))(plan)
    with pytest.raises(PlanError, match=r"is a local hand-over on rank 0, not a message"):
        validate_plan(plan)


def test_forward_only_with_a_gradient_receive():
    plan = two_modules(forward_only=True)
    key = MessageKey(MessageKind.GRADIENT, st(1, 0, "vit"), st(0, 0, "llm"))
    plan = edit(plan, 1, lambda x: [Recv(key, 0, HIDDEN), *x])
    with pytest.raises(
        PlanError,
        match=r"rank 1: instruction 0 \(recv grad:vit1\[mb0.0\]->llm0\[mb0.0\] from 0\): no rank computes B vit1\[mb0.0\]",
    ):
        validate_plan(plan)


def test_missing_forward_in_forward_only_plan():
    plan = two_modules(p=1, forward_only=True)
    last = plan.programs[0].instructions[-1]
    assert isinstance(last, Forward)
    plan = edit(plan, 0, lambda x: x[:-1])
    with pytest.raises(
        PlanError, match=re.escape(f"stage {last.stage} needs 1 Forward, found 0 (nowhere)")
    ):
        validate_plan(plan)


def test_local_input_must_come_first():
    plan = two_modules(p=1)  # every edge is local: ViT -> LLM hand-over on rank 0
    fwd = [i for i, x in enumerate(plan.programs[0].instructions) if isinstance(x, Forward)]
    plan = _swap(0, fwd[1], fwd[2])(plan)  # LLM chunk 0 before ViT chunk 1 of microbatch 0
    with pytest.raises(
        PlanError,
        match=r"rank 0: instruction 1 \(F llm0\[mb0.0\]\): needs F vit1\[mb0.0\] earlier on this rank",
    ):
        validate_plan(plan)


@pytest.mark.parametrize(
    ("deps", "fragment"),
    [
        (lambda d: d + d[:1], "lists a dependency twice"),
        (lambda d: [Dependency(WorkId("vit", 0), WorkId("llm", 1))], "crosses microbatches"),
        (
            lambda d: [Dependency(WorkId("vit", 0, 7), WorkId("llm", 0))],
            "inconsistent dependencies: dependency",
        ),
        (lambda d: [Dependency(WorkId("vit", 0), WorkId("vit", 0))], "connects a module to itself"),
    ],
)
def test_dependency_table_errors(deps, fragment):
    plan = two_modules()
    plan = replace(plan, dependencies=tuple(deps(list(plan.dependencies))))
    with pytest.raises(PlanError, match="dependenc") as err:
        validate_plan(plan)
    assert fragment in str(err.value)


def test_frozen_vit_backward_rejected():
    plan = two_modules(vit_trainable=False)
    plan = edit(plan, 0, lambda x: [*x, Backward(st(0, 0, "vit"))])
    with pytest.raises(PlanError, match="module vit is frozen with nothing trainable upstream"):
        validate_plan(plan)


def test_hand_built_deadlock_names_ranks_and_instructions():
    """Rank 0 waits for its send of act 1 before posting act 0; rank 1 waits for act 0 first."""
    r0 = [
        Forward(st(0, 0)),
        Forward(st(0, 1)),
        Send(act(1), 1, HIDDEN),
        Wait((act(1),)),
        Send(act(0), 1, HIDDEN),
        Recv(grad(0), 1, HIDDEN),
        Recv(grad(1), 1, HIDDEN),
        Wait((act(0), grad(0), grad(1))),
        Backward(st(0, 0)),
        Backward(st(0, 1)),
    ]
    r1 = [
        Recv(act(0), 0, HIDDEN),
        Wait((act(0),)),
        Forward(st(1, 0)),
        Backward(st(1, 0)),
        Send(grad(0), 0, HIDDEN),
        Recv(act(1), 0, HIDDEN),
        Wait((act(1), grad(0))),
        Forward(st(1, 1)),
        Backward(st(1, 1)),
        Send(grad(1), 0, HIDDEN),
    ]
    plan = replace(base(), programs=(Program(0, tuple(r0)), Program(1, tuple(r1))))
    with pytest.raises(DeadlockError) as err:
        validate_plan(plan)
    text = str(err.value)
    assert "rank 0 blocked at instruction 3 (wait act:model0[mb1.0]->model1[mb1.0])" in text
    assert "rank 1 blocked at instruction 1 (wait act:model0[mb0.0]->model1[mb0.0])" in text
    # Rank 1's batch at instruction 4 (send grad 0, receive act 1) cannot start either.
    assert "waits for rank 1's batch at instruction 4" in text
    assert "waits for rank 0's batch at instruction 4" in text


def crossed_sends_plan(*, crossed: bool = True):
    """1F1B-like P=2, M=2 by hand: rank 0 posts act 0 then act 1 to rank 1 in one batch; rank 1
    receives them in the opposite order (`crossed`) or in the same order. The engine matches by
    message, so it runs either way; NCCL and gloo match by order and would swap the tensors."""
    r0 = [
        Forward(st(0, 0)),
        Forward(st(0, 1)),
        Send(act(0), 1, HIDDEN),
        Send(act(1), 1, HIDDEN),
        Recv(grad(0), 1, HIDDEN),
        Recv(grad(1), 1, HIDDEN),
        Wait((act(0), act(1), grad(0), grad(1))),
        Backward(st(0, 0)),
        Backward(st(0, 1)),
    ]
    first, second = (act(1), act(0)) if crossed else (act(0), act(1))
    r1 = [
        Recv(first, 0, HIDDEN),
        Recv(second, 0, HIDDEN),
        Wait((act(0), act(1))),
        Forward(st(1, 0)),
        Backward(st(1, 0)),
        Forward(st(1, 1)),
        Backward(st(1, 1)),
        Send(grad(0), 0, HIDDEN),
        Send(grad(1), 0, HIDDEN),
        Wait((grad(0), grad(1))),
    ]
    return replace(base(), programs=(Program(0, tuple(r0)), Program(1, tuple(r1))))


def test_channel_order_must_agree_on_both_ends():
    validate_plan(crossed_sends_plan(crossed=False))
    plan = crossed_sends_plan()
    execute_programs(plan.programs)  # no deadlock: only the order check can catch it
    expected = (
        "channel rank 0 -> rank 1: message 0 that rank 0 sends is "
        "act:model0[mb0.0]->model1[mb0.0] (rank 0 instruction 2), but message 0 that rank 1 "
        "receives is act:model0[mb1.0]->model1[mb1.0] (rank 1 instruction 0)"
    )
    with pytest.raises(PlanError, match=re.escape(expected)):
        validate_plan(plan)
    with pytest.raises(PlanError, match=re.escape(expected)):
        check_channel_order(plan.programs)
    # A channel whose receiving end lacks messages names "nothing" on that side.
    short = (plan.programs[0], Program(1, ()))
    with pytest.raises(PlanError, match="message 0 that rank 1 receives is nothing"):
        check_channel_order(short)


def test_check_plan_matches():
    plan = base()
    check_plan_matches(plan, placement=plan.placement, num_ranks=2, iteration=0)
    check_plan_matches(plan, placement=plan.placement, num_ranks=2)
    with pytest.raises(PlanError, match="is for 2 pipeline ranks, this job has 4"):
        check_plan_matches(plan, placement=plan.placement, num_ranks=4)
    with pytest.raises(
        PlanError, match=r"plan 'megatron-1f1b' \(iteration 0\) arrived for iteration 3"
    ):
        check_plan_matches(plan, placement=plan.placement, num_ranks=2, iteration=3)
    with pytest.raises(
        PlanError,
        match=r"module model: chunks \(layers, rank\) \[\(0, 1, 0\), \(1, 2, 1\)\], trainable=True",
    ):
        check_plan_matches(plan, placement=FLAT, num_ranks=2)
    other = two_modules().placement
    with pytest.raises(PlanError, match=r"modules \['model'\], expected \['vit', 'llm'\]"):
        check_plan_matches(plan, placement=other, num_ranks=2)


def test_a_wait_waits_for_its_whole_batch_as_the_runtime_does():
    """Rank 1 posts both activations in one batch and waits for the first only; the second is
    made after rank 0 has the first gradient. Operation by operation that runs, but the runtime
    waits for a named message's whole batch (NCCL completes a batch_isend_irecv together), so
    the plan hangs there: validation refuses it."""
    r0 = [
        Forward(st(0, 0)),
        Send(act(0), 1, HIDDEN),
        Recv(grad(0), 1, HIDDEN),
        Wait((grad(0),)),
        Backward(st(0, 0)),
        Forward(st(0, 1)),
        Send(act(1), 1, HIDDEN),
        Recv(grad(1), 1, HIDDEN),
        Wait((act(0), act(1), grad(1))),
        Backward(st(0, 1)),
    ]
    r1 = [
        Recv(act(0), 0, HIDDEN),
        Recv(act(1), 0, HIDDEN),
        Wait((act(0),)),
        Forward(st(1, 0)),
        Backward(st(1, 0)),
        Send(grad(0), 0, HIDDEN),
        Wait((act(1),)),
        Forward(st(1, 1)),
        Backward(st(1, 1)),
        Send(grad(1), 0, HIDDEN),
        Wait((grad(0), grad(1))),
    ]
    programs = (Program(0, tuple(r0)), Program(1, tuple(r1)))
    plan = replace(base(), programs=programs, channels=Channels.PER_PEER)
    # each wait for its own operation, on per-pair streams: it runs to the end
    execute_programs(programs, channel=per_peer_channel)
    with pytest.raises(DeadlockError, match="rank 1 blocked at instruction 2"):
        execute_programs(programs, channel=per_peer_channel, whole_batches=True)
    with pytest.raises(DeadlockError, match="rank 1 blocked at instruction 2"):
        validate_plan(plan)
