"""add_communication: deadlock freedom on many compute orders, and its error paths."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_dip.schedule import (
    Backward,
    BatchTotals,
    Channels,
    ChunkSpec,
    Dataflow,
    DeadlockError,
    Dependency,
    Forward,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Plan,
    PlanError,
    Recv,
    Send,
    StageId,
    SubMicrobatch,
    TensorSpec,
    Wait,
    WorkId,
    add_communication,
    execute_programs,
    ideal_timing,
    validate_plan,
)
from megatron_dip.schedule.engine import per_peer_channel, single_channel
from megatron_dip.schedule.passes import compute_id, compute_inputs


def tensors(key):
    return (TensorSpec(f"{key.kind.value}", (2, key.producer.chunk + 1)),)


def random_case(rng: random.Random, p: int, num_modules: int, m: int):
    """Modules in a chain m0 -> m1 -> ..., chunks on random ranks, random sub counts."""
    layouts, subs, deps = [], [], []
    for k in range(num_modules):
        n = rng.randint(1, 2 * p)
        chunks = tuple(ChunkSpec(f"m{k}", c, rng.randrange(p), c, c + 1) for c in range(n))
        layouts.append(ModuleLayout(f"m{k}", n, rng.random() < 0.7, chunks))
    for mb in range(m):
        prev: list[SubMicrobatch] = []
        for k in range(num_modules):
            count = 1 if k == num_modules - 1 else rng.randint(0, 3)
            cur = [SubMicrobatch(f"m{k}", mb, i, i, i + 1, 5, 8) for i in range(count)]
            deps += [Dependency(a.work, b.work) for a in prev for b in cur]
            subs += cur
            prev = cur or prev
    placement = Placement(p, tuple(layouts))
    return placement, subs, deps


def all_computes(df: Dataflow, forward_only: bool) -> list[Forward | Backward]:
    out: list[Forward | Backward] = [Forward(s) for s in df.stages()]
    if not forward_only:
        out += [Backward(s) for s in df.stages() if df.needs_backward(s.module)]
    return out


def random_orders(rng: random.Random, df: Dataflow, p: int, forward_only: bool):
    """Project a random linear extension of the compute graph onto the ranks: any acyclic
    set of per-rank orders arises this way."""
    pending = all_computes(df, forward_only)
    done: set = set()
    orders: list[list[Forward | Backward]] = [[] for _ in range(p)]
    while pending:
        ready = [c for c in pending if all(d in done for d in compute_inputs(c, df))]
        pick = rng.choice(ready)
        pending.remove(pick)
        done.add(compute_id(pick))
        orders[df.rank_of(pick.stage)].append(pick)
    return orders


def make_plan(placement, subs, deps, programs, forward_only=False) -> Plan:
    mbs = sorted({s.microbatch for s in subs})
    return Plan(
        iteration=0,
        placement=placement,
        microbatches=tuple(MicrobatchInfo(i, (i,), 8) for i in mbs),
        submicrobatches=tuple(subs),
        dependencies=tuple(deps),
        totals=BatchTotals(len(mbs), len(mbs), 8 * len(mbs)),
        programs=tuple(programs),
        forward_only=forward_only,
    )


def expected_messages(df: Dataflow, forward_only: bool) -> int:
    n = 0
    for s in df.stages():
        for c in df.consumers(s):
            if df.rank_of(s) != df.rank_of(c):
                n += 1
                both = df.needs_backward(s.module) and df.needs_backward(c.module)
                n += both and not forward_only
    return n


@given(
    seed=st.integers(0, 2**32 - 1),
    p=st.integers(1, 6),
    num_modules=st.integers(1, 3),
    m=st.integers(1, 4),
    forward_only=st.booleans(),
    timed=st.booleans(),
)
def test_random_orders_never_deadlock(seed, p, num_modules, m, forward_only, timed):
    rng = random.Random(seed)
    placement, subs, deps = random_case(rng, p, num_modules, m)
    df = Dataflow(placement, subs, deps)
    orders = random_orders(rng, df, p, forward_only)
    cost = {c: rng.uniform(0.1, 3.0) for order in orders for c in order}
    compute_time = (lambda r, i: cost[i]) if timed else None
    programs = add_communication(orders, df, tensors=tensors, compute_time=compute_time)
    plan = make_plan(placement, subs, deps, programs, forward_only)
    validate_plan(plan)  # structure, pairing, and the zero-duration deadlock check
    assert [prog.compute() for prog in programs] == orders
    sends = [i for prog in programs for i in prog.instructions if isinstance(i, Send)]
    assert len(sends) == expected_messages(df, forward_only)
    assert all(s.tensors == tensors(s.key) for s in sends)
    # Timed execution with transfer costs: still finishes, never beats the comm-free timing.
    result = execute_programs(
        programs, compute_time=lambda r, i: cost[i], transfer_time=lambda s: rng.uniform(0, 0.5)
    )
    ideal = ideal_timing(orders, df, compute_time=lambda r, i: cost[i])
    ideal_makespan = max((f[-1] for f in ideal.finish if f), default=0.0)
    assert result.makespan >= ideal_makespan - 1e-9


@given(
    seed=st.integers(0, 2**32 - 1),
    p=st.integers(1, 6),
    num_modules=st.integers(1, 3),
    m=st.integers(1, 4),
)
def test_receives_posted_ahead_never_deadlock_on_per_peer_streams(seed, p, num_modules, m):
    rng = random.Random(seed)
    placement, subs, deps = random_case(rng, p, num_modules, m)
    df = Dataflow(placement, subs, deps)
    orders = random_orders(rng, df, p, False)
    cost = {c: rng.uniform(0.1, 3.0) for order in orders for c in order}
    timed = lambda r, i: cost[i]  # noqa: E731
    programs = add_communication(
        orders, df, tensors=tensors, compute_time=timed, channels=Channels.PER_PEER
    )
    plan = replace(make_plan(placement, subs, deps, programs), channels=Channels.PER_PEER)
    validate_plan(plan)  # the zero-duration deadlock check on per-peer streams, channel order
    assert [prog.compute() for prog in programs] == orders
    plain = add_communication(orders, df, tensors=tensors, compute_time=timed)
    assert _posts(programs) == _posts(plain)  # the same messages
    for early, late in zip(map(_receive_steps, programs), map(_receive_steps, plain)):
        # every receive posted as before or one compute earlier
        assert all(late[key] - early[key] in (0, 1) for key in late)
    result = execute_programs(
        programs,
        compute_time=timed,
        transfer_time=lambda s: rng.uniform(0, 0.5),
        channel=per_peer_channel,
    )
    ideal = ideal_timing(orders, df, compute_time=timed)
    assert result.makespan >= max((f[-1] for f in ideal.finish if f), default=0.0) - 1e-9


def _posts(programs) -> list[set]:
    return [
        {(type(i), i.key) for i in p.instructions if isinstance(i, Send | Recv)} for p in programs
    ]


def _receive_steps(program) -> dict:
    """Per received message: how many computes precede its post."""
    steps, computes = {}, 0
    for ins in program.instructions:
        if isinstance(ins, Recv):
            steps[ins.key] = computes
        elif isinstance(ins, Forward | Backward):
            computes += 1
    return steps


def test_receives_posted_ahead_can_deadlock_on_one_stream():
    # Why a plan declares its streams: on one stream per rank an early receive holds back the
    # rank's later sends until its own sender delivers, and that sender may wait for them.
    found = None
    for seed in range(400):
        rng = random.Random(seed)
        placement, subs, deps = random_case(rng, 3, 2, 3)
        df = Dataflow(placement, subs, deps)
        orders = random_orders(rng, df, 3, False)
        programs = add_communication(orders, df, tensors=tensors, channels=Channels.PER_PEER)
        try:
            execute_programs(programs, channel=single_channel)
        except DeadlockError:
            found = programs
            break
    assert found is not None
    execute_programs(found, channel=per_peer_channel)  # the same programs on per-peer streams
    plan = make_plan(placement, subs, deps, found)
    with pytest.raises(DeadlockError):
        validate_plan(plan)  # declared for one stream (the default): refused
    validate_plan(replace(plan, channels=Channels.PER_PEER))


def test_a_receive_posted_ahead_travels_while_the_rank_computes():
    chunks = (ChunkSpec("m", 0, 0, 0, 1), ChunkSpec("m", 1, 1, 1, 2))
    placement = Placement(2, (ModuleLayout("m", 2, True, chunks),))
    subs = [SubMicrobatch("m", i, 0, 0, 1, 1, 1) for i in range(3)]
    df = Dataflow(placement, subs, ())
    orders = [
        [F(0, 0), F(0, 1), F(0, 2), B(0, 0), B(0, 1), B(0, 2)],
        [F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2)],
    ]
    # Rank 0's forwards are slower: mb 0's gradient reaches it while it still computes F mb 2,
    # so a receive posted after that forward starts its transfer only then, and B mb 0 waits
    # for the whole transfer; posted one compute ahead, the gradient travels meanwhile.
    time = lambda r, i: 2.0 if isinstance(i, Backward) else (1.6 if r == 0 else 1.0)  # noqa: E731

    def timed(channels: Channels) -> tuple[float, float]:
        programs = add_communication(
            orders, df, tensors=tensors, compute_time=time, channels=channels
        )
        result = execute_programs(
            programs, compute_time=time, transfer_time=lambda s: 0.25, channel=per_peer_channel
        )
        b0 = programs[0].instructions.index(B(0, 0))
        return result.makespan, next(start for i, start, _ in result.spans[0] if i == b0)

    (makespan, b0_start) = timed(Channels.SINGLE)
    (ahead, b0_ahead) = timed(Channels.PER_PEER)
    assert b0_start == pytest.approx(5.3) and b0_ahead == pytest.approx(5.1)
    assert ahead == pytest.approx(makespan - 0.25)


@given(seed=st.integers(0, 2**32 - 1), p=st.integers(2, 5))
def test_program_shape_batches_waits_and_buffers(seed, p):
    rng = random.Random(seed)
    placement, subs, deps = random_case(rng, p, 2, 3)
    df = Dataflow(placement, subs, deps)
    programs = add_communication(random_orders(rng, df, p, False), df, tensors=tensors)
    for prog in programs:
        ins = prog.instructions
        posted = {i.key for i in ins if isinstance(i, (Send, Recv))}
        waited = [k for i in ins if isinstance(i, Wait) for k in i.keys]
        # Every op is waited for exactly once, sends included (buffers are released).
        assert sorted(waited) == sorted(posted)
        for a, b in zip(ins, ins[1:]):
            # One batch, then one wait, then the compute: a wait never precedes a post.
            assert not (isinstance(a, Wait) and isinstance(b, (Send, Recv, Wait)))


def _two_rank_pipeline():
    chunks = (ChunkSpec("m", 0, 0, 0, 1), ChunkSpec("m", 1, 1, 1, 2))
    placement = Placement(2, (ModuleLayout("m", 2, True, chunks),))
    subs = [SubMicrobatch("m", i, 0, 0, 1, 1, 1) for i in range(2)]
    return placement, subs, Dataflow(placement, subs, ())


def F(c, mb):
    return Forward(StageId("m", c, mb))


def B(c, mb):
    return Backward(StageId("m", c, mb))


def test_cyclic_orders_name_ranks_and_computes():
    _, _, df = _two_rank_pipeline()
    # Rank 0 wants mb 0's gradient before sending mb 1; rank 1 wants mb 1 before mb 0.
    orders = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), F(1, 0), B(1, 0), B(1, 1)]]
    with pytest.raises(DeadlockError) as err:
        add_communication(orders, df, tensors=tensors)
    text = str(err.value)
    assert "rank 0 blocked at compute 1 (B m0[mb0.0])" in text
    assert "rank 1 blocked at compute 0 (F m1[mb1.0])" in text
    assert "F m0[mb1.0] (rank 0, compute 2)" in text
    assert len(err.value.blocked) == 2


def test_backward_before_forward_on_one_rank_is_a_cycle():
    _, _, df = _two_rank_pipeline()
    orders = [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [B(1, 0), F(1, 0), F(1, 1), B(1, 1)]]
    with pytest.raises(DeadlockError, match=r"rank 1 blocked at compute 0 \(B m1\[mb0.0\]\)"):
        ideal_timing(orders, df)


def test_order_errors():
    _, _, df = _two_rank_pipeline()
    full = [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]]
    with pytest.raises(PlanError, match="lives on rank 1"):
        add_communication([full[0] + [F(1, 0)], full[1]], df, tensors=tensors)
    with pytest.raises(PlanError, match=r"already appears on rank 0 as compute 0"):
        add_communication([[F(0, 0), *full[0]], full[1]], df, tensors=tensors)
    with pytest.raises(PlanError, match=r"needs F m1\[mb1.0\], which no rank computes"):
        add_communication([full[0], [F(1, 0), B(1, 0), B(1, 1)]], df, tensors=tensors)
    with pytest.raises(PlanError, match=r"rank 1: compute 1 is not a Forward/Backward: 'nop'"):
        add_communication([full[0], [F(1, 0), "nop"]], df, tensors=tensors)
    with pytest.raises(PlanError, match="1 compute orders for 2 pipeline ranks"):
        add_communication([full[0]], df, tensors=tensors)
    with pytest.raises(ValueError, match="positive"):
        add_communication(full, df, tensors=tensors, compute_time=lambda r, i: 0.0)


def test_local_edges_send_nothing_and_pp1_has_no_messages():
    chunks = tuple(ChunkSpec("m", c, 0, c, c + 1) for c in range(3))
    placement = Placement(1, (ModuleLayout("m", 3, True, chunks),))
    subs = [SubMicrobatch("m", 0, 0, 0, 1, 1, 1)]
    df = Dataflow(placement, subs, ())
    order = [Forward(StageId("m", c, 0)) for c in range(3)]
    order += [Backward(StageId("m", c, 0)) for c in reversed(range(3))]
    (prog,) = add_communication([order], df, tensors=tensors)
    assert prog.instructions == tuple(order)


def test_ideal_timing_of_1f1b_matches_the_textbook():
    _, _, df = _two_rank_pipeline()
    orders = [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]]
    t = ideal_timing(orders, df, compute_time=lambda r, i: 1.0 if isinstance(i, Forward) else 2.0)
    # Rank 0's backwards wait for rank 1's: B m0 mb0 starts when B m1 mb0 ends (2 + 2).
    assert t.start == [[0, 1, 4, 7], [1, 2, 4, 5]]
    assert t.finish[0][-1] == 9  # (F + B) * (M + P - 1) with F = 1, B = 2
    assert t.where[compute_id(B(1, 1))] == (1, 3)


def test_messages_are_posted_before_they_are_needed():
    """The receive of mb 1's activation is posted ahead, with the send of mb 0's gradient."""
    placement, subs, df = _two_rank_pipeline()
    orders = [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]]
    programs = add_communication(orders, df, tensors=tensors)
    validate_plan(make_plan(placement, subs, (), programs))
    r1 = programs[1].instructions
    b10 = r1.index(B(1, 0))
    batch_after = []
    for ins in r1[b10 + 1 :]:
        if not isinstance(ins, (Send, Recv)):
            break
        batch_after.append((type(ins).__name__, ins.key.kind.value, ins.key.producer.microbatch))
    assert ("Send", "grad", 0) in batch_after
    assert execute_programs(programs, compute_time=lambda r, i: 1.0).makespan == 6.0


def test_dependencies_between_modules_become_messages():
    placement = Placement(
        2,
        (
            ModuleLayout("a", 1, True, (ChunkSpec("a", 0, 1, 0, 1),)),
            ModuleLayout("b", 1, True, (ChunkSpec("b", 0, 0, 0, 1),)),
        ),
    )
    subs = [SubMicrobatch("a", 0, 0, 0, 1, 1, 1), SubMicrobatch("b", 0, 0, 0, 1, 1, 1)]
    deps = [Dependency(WorkId("a", 0), WorkId("b", 0))]
    df = Dataflow(placement, subs, deps)
    a, b = StageId("a", 0, 0), StageId("b", 0, 0)
    programs = add_communication(
        [[Forward(b), Backward(b)], [Forward(a), Backward(a)]], df, tensors=tensors
    )
    plan = make_plan(placement, subs, deps, programs)
    validate_plan(plan)
    sends = {
        (prog.rank, i.key.kind.value)
        for prog in programs
        for i in prog.instructions
        if isinstance(i, Send)
    }
    assert sends == {(1, "act"), (0, "grad")}
