"""Placement arithmetic, sub-microbatching, the list scheduler, the search and the memory pass,
on small hand-checkable cases with a toy cost model."""

import pytest
from metas import t2v_meta, vlm_meta

from megatron_dip.batching import split_microbatch, split_sizes
from megatron_dip.modelspec import tiny_t2v, tiny_vlm
from megatron_dip.planner.list_scheduler import (
    build_stage_graph,
    list_schedule,
    priorities_from_units,
)
from megatron_dip.planner.memory import (
    MemoryLimitError,
    RecomputeChoice,
    choose_recompute,
    relax_choice,
    stage_modes,
    within_host_limit,
)
from megatron_dip.planner.placement import (
    balanced_layer_split,
    parse_segments,
    segments_per_module,
)
from megatron_dip.planner.search import SearchConfig, mcts_order, unit_constraints
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import (
    Backward,
    ChunkSpec,
    Dependency,
    Forward,
    MemoryPolicy,
    ModuleLayout,
    Placement,
    Recompute,
    StageId,
    SubMicrobatch,
    WorkId,
)


def single_module(num_ranks: int, num_microbatches: int, *, chunks_per_rank: int = 1):
    n = num_ranks * chunks_per_rank
    chunks = tuple(ChunkSpec("m", c, c % num_ranks, c, c + 1) for c in range(n))
    placement = Placement(num_ranks, (ModuleLayout("m", n, True, chunks),))
    subs = [SubMicrobatch("m", mb, 0, 0, 1, 10, 10) for mb in range(num_microbatches)]
    return Dataflow(placement, subs, [])


def unit_graph(dataflow, fwd=1.0, bwd=2.0, act=1):
    return build_stage_graph(
        dataflow, stage_cost=lambda s, r: (fwd, bwd, act), transfer=lambda k: 0.0
    )


def order_string(order):
    return " ".join(
        ("F" if isinstance(i, Forward) else "B") + str(i.stage.microbatch) for i in order
    )


# -- placement ----------------------------------------------------------------------------------


def test_parse_segments_accepts_and_rejects():
    assert parse_segments("vit=1, llm=2") == {"vit": 1, "llm": 2}
    for bad in ("vit", "vit=0", "vit=x", "=2"):
        with pytest.raises(ValueError, match="--dip-segments"):
            parse_segments(bad)


def test_segments_follow_floor_of_latency_ratio():
    k = segments_per_module(tiny_vlm(), {"vit": 2.0, "llm": 5.1})
    assert k == {"vit": 1, "llm": 2}
    assert (
        segments_per_module(tiny_vlm(), {"vit": 2.0, "llm": 5.1}, override={"llm": 3})["llm"] == 3
    )
    with pytest.raises(ValueError, match="unknown module"):
        segments_per_module(tiny_vlm(), {"vit": 1.0, "llm": 1.0}, override={"dit": 1})


def test_balanced_split_charges_head_to_last_chunk():
    # 8 equal layers, 2 chunks; the last chunk also carries a head worth 2 layers.
    cost = lambda i, s, e: (e - s) + (2.0 if e == 8 else 0.0)  # noqa: E731
    assert balanced_layer_split(8, 2, cost) == [(0, 5), (5, 8)]
    assert balanced_layer_split(4, 4, cost) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="non-empty"):
        balanced_layer_split(3, 4, cost)


# -- sub-microbatches ---------------------------------------------------------------------------


def test_split_sizes_balanced_ceil():
    assert split_sizes(5, 2) == [2, 2, 1]
    assert split_sizes(7, 3) == [3, 2, 2]
    assert split_sizes(0, 4) == []
    with pytest.raises(ValueError):
        split_sizes(3, 0)


def test_vlm_microbatch_subs_and_dependencies():
    model = tiny_vlm()
    samples = [
        vlm_meta(0, 40, (64, 64), (16, 16)),
        vlm_meta(1, 20),
        vlm_meta(2, 30, (64, 64, 64), (16, 16, 16)),
    ]
    work = split_microbatch(model, samples, index=3, seq_length=128, sub_sizes={"vit": 2})
    vit = [s for s in work.submicrobatches if s.module == "vit"]
    assert [(s.instance_start, s.instance_end, s.tokens) for s in vit] == [
        (0, 2, 128),
        (2, 4, 128),  # sub-microbatches may span samples
        (4, 5, 64),
    ]
    llm = [s for s in work.submicrobatches if s.module == "llm"]
    assert len(llm) == 1 and (llm[0].tokens, llm[0].padded_tokens) == (90, 128)
    assert llm[0].attention_pairs == 40**2 + 20**2 + 30**2 + 38**2
    assert {d.producer for d in work.dependencies} == {WorkId("vit", 3, k) for k in range(3)}
    assert {d.consumer for d in work.dependencies} == {WorkId("llm", 3, 0)}


def test_t2v_dit_needs_captions_of_its_clips():
    model = tiny_t2v()
    samples = [t2v_meta(i, 10 + i, 32) for i in range(5)]
    work = split_microbatch(
        model, samples, index=0, seq_length=256, sub_sizes={"text": 3, "dit": 2}
    )
    deps = {(d.producer.sub, d.consumer.sub) for d in work.dependencies}
    # text subs cover captions [0,3) [3,5); dit subs cover clips [0,2) [2,4) [4,5)
    assert deps == {(0, 0), (0, 1), (1, 1), (1, 2)}


def test_text_longer_than_sequence_is_rejected_naming_samples():
    with pytest.raises(ValueError, match=r"samples \[7\]"):
        split_microbatch(
            tiny_vlm(), [vlm_meta(7, 300)], index=0, seq_length=128, sub_sizes={"vit": 1}
        )


# -- list scheduler -----------------------------------------------------------------------------


def test_memory_limit_turns_greedy_into_1f1b():
    g = unit_graph(single_module(4, 8))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(8)])
    free = list_schedule(g, priority=prio)
    assert order_string(free.orders[0]) == "F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"
    limited = list_schedule(g, priority=prio, memory_limit=[4, 3, 2, 1])
    assert order_string(limited.orders[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert order_string(limited.orders[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert limited.peak_memory == (4, 3, 2, 1)
    # Both are bubble-optimal for uniform stages: (M + P - 1) * (f + b).
    assert free.makespan == limited.makespan == (8 + 4 - 1) * 3


def test_retiming_keeps_the_orders_and_their_peaks():
    """The 1F1B orders of a memory-limited schedule timed again with the backwards one second
    shorter: the same orders and peaks, each rank's timeline as 1F1B's with b = 1 (the list
    scheduler itself, given these costs without a limit, would keep every forward in flight)."""
    from megatron_dip.planner.retime import retimed

    flow = single_module(4, 8)
    prio = priorities_from_units(unit_graph(flow).stages, [("m", mb) for mb in range(8)])
    limited = list_schedule(unit_graph(flow), priority=prio, memory_limit=[4, 3, 2, 1])
    faster = retimed(limited, unit_graph(flow, bwd=1.0), lambda s: MemoryPolicy(Recompute.NONE))
    assert faster.orders == limited.orders and faster.peak_memory == limited.peak_memory
    assert not faster.overcommitted and faster.makespan == (8 + 4 - 1) * 2
    assert retimed(limited, unit_graph(flow, act=2), lambda s: None, [4, 3, 2, 1]).overcommitted


def test_fixed_order_waits_for_its_next_forward():
    g = unit_graph(single_module(2, 3))
    prio = priorities_from_units(g.stages, [("m", 2), ("m", 0), ("m", 1)])
    fixed = list_schedule(g, priority=prio, fill_bubbles=False)
    assert [i.stage.microbatch for i in fixed.orders[0] if isinstance(i, Forward)] == [2, 0, 1]


def test_overcommit_reported_when_every_rank_is_stuck():
    g = unit_graph(single_module(2, 4), act=10)
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    s = list_schedule(g, priority=prio, memory_limit=[5, 5])
    assert s.overcommitted
    assert sum(isinstance(i, Backward) for i in s.orders[0]) == 4


# -- search ---------------------------------------------------------------------------------------


def two_module_graph(num_ranks=2, microbatches=4):
    layouts = (
        ModuleLayout(
            "vit",
            num_ranks,
            True,
            tuple(ChunkSpec("vit", c, c, c, c + 1) for c in range(num_ranks)),
        ),
        ModuleLayout(
            "llm",
            num_ranks,
            True,
            tuple(ChunkSpec("llm", c, c, c, c + 1) for c in range(num_ranks)),
        ),
    )
    placement = Placement(num_ranks, layouts)

    subs, deps = [], []
    for mb in range(microbatches):
        if mb % 2 == 0:  # images only in even microbatches: uneven vision work
            subs.append(SubMicrobatch("vit", mb, 0, 0, 4, 400, 400))
            deps.append(Dependency(WorkId("vit", mb, 0), WorkId("llm", mb, 0)))
        subs.append(SubMicrobatch("llm", mb, 0, 0, 1, 100, 100))
    df = Dataflow(placement, subs, deps)
    cost = lambda s, r: (s.module == "vit" and (3.0, 6.0, 1)) or (1.0, 2.0, 1)  # noqa: E731
    return df, build_stage_graph(df, stage_cost=cost, transfer=lambda k: 0.1)


def test_search_never_worse_than_greedy_and_deterministic():
    df, g = two_module_graph()
    units = {"vit": [0, 2], "llm": [0, 1, 2, 3]}
    cons = unit_constraints(units, {"vit": "llm", "llm": None})
    # producers precede their consumer; modules keep microbatch order
    assert cons.units.index(("vit", 2)) < cons.units.index(("llm", 2))

    def score(order):
        return list_schedule(g, priority=priorities_from_units(g.stages, order)).makespan

    a = mcts_order(cons, score, SearchConfig(max_rollouts=40, time_budget_s=30, seed=3))
    b = mcts_order(cons, score, SearchConfig(max_rollouts=40, time_budget_s=30, seed=3))
    assert a.order == b.order and a.makespan == b.makespan
    assert a.makespan <= a.greedy_makespan
    assert a.makespan == score(a.order)
    for prefix_unit in a.order:
        assert all(
            x in a.order[: a.order.index(prefix_unit)] for x in cons.before.get(prefix_unit, ())
        )


# -- memory ---------------------------------------------------------------------------------------


def test_memory_pass_picks_cheapest_mode_under_limit():
    g = unit_graph(single_module(2, 4))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    orders = list_schedule(g, priority=prio).orders  # rank 0 keeps 4 activations alive
    none, sel, full = (
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.FULL, 0),
    )
    table = {none: (3.0, 100), sel: (3.2, 60), full: (4.0, 10)}
    choice = choose_recompute(
        orders,
        mode_cost=lambda s, m: table[m],
        modes_of=lambda s: (none, sel, full),
        keeps_activations=lambda s: True,
        memory_limit=[250, 1000],
    )
    # Four activations alive at rank 0's peak: 4 x 60 <= 250 < 100 + 3 x 60, and mixing in
    # full recompute (100 + 10 + 2 x 60) costs more time (+1.4 against +0.8).
    modes = [choice.of(StageId("m", 0, mb)) for mb in range(4)]
    assert all(m == sel for m in modes)
    assert choice.added_time == pytest.approx(4 * 0.2)
    assert all(choice.of(StageId("m", 1, mb)) == none for mb in range(4))
    with pytest.raises(MemoryLimitError, match="rank 0"):
        choose_recompute(
            orders,
            mode_cost=lambda s, m: table[m],
            modes_of=lambda s: (none, sel, full),
            keeps_activations=lambda s: True,
            memory_limit=[30, 1000],
        )


def test_memory_pass_offloads_where_it_is_cheaper_than_recomputing():
    """With offload among the candidates (`stage_modes(offload=True)`: nine modes, full still
    last) the pass takes a free one-layer offload over block recomputation of that layer, and a
    partly exposed offload only where nothing cheaper fits; the plan it returns carries it."""
    modes = stage_modes(4, offload=True)
    assert len(modes) == 9 and modes[-1] == MemoryPolicy(Recompute.FULL, 0)
    assert modes[:4] == stage_modes(4)[:4]  # the recompute modes first, as without offload
    off1, off2 = MemoryPolicy(Recompute.NONE, 0, 1), MemoryPolicy(Recompute.NONE, 0, 2)
    # The offload that hides (one layer by default), alone and after block 1, 2 and 3.
    block = [MemoryPolicy(Recompute.BLOCK, n, 1) for n in (1, 2, 3)]
    assert modes[4:8] == (off1, *block)
    # Two layers hide after block 0-3, one after block 4, none after block 5: the offload that
    # hides after block 0, 1 and 3 (half), and after the most layers one still hides after.
    hides = {0: 2, 1: 2, 2: 2, 3: 2, 4: 1, 5: 0}
    assert stage_modes(6, offload=True, hidden=hides.__getitem__)[4:8] == (
        MemoryPolicy(Recompute.NONE, 0, 2),
        *(MemoryPolicy(Recompute.BLOCK, n, k) for n, k in ((1, 2), (3, 2), (4, 1))),
    )
    g = unit_graph(single_module(2, 4))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    orders = list_schedule(g, priority=prio).orders  # rank 0 keeps 4 activations alive
    none, block, full = (
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.BLOCK, 1),
        MemoryPolicy(Recompute.FULL, 0),
    )
    table = {none: (3.0, 100), block: (3.25, 75), off1: (3.0, 75), off2: (3.5, 50), full: (4.2, 10)}

    def choose(limit: float, candidates):
        return choose_recompute(
            orders,
            mode_cost=lambda s, m: table[m],
            modes_of=lambda s: candidates,
            keeps_activations=lambda s: True,
            memory_limit=[limit, 1000],
        )

    free = choose(300, (none, block, off1, off2, full))
    assert all(free.of(StageId("m", 0, mb)) == off1 for mb in range(4))
    assert free.added_time == 0.0
    assert choose(300, (none, block, full)).added_time == pytest.approx(4 * 0.25)
    tight = choose(200, (none, block, off1, off2, full))
    assert {tight.of(StageId("m", 0, mb)) for mb in range(4)} == {off2}
    assert tight.added_time == pytest.approx(4 * 0.5)


def test_memory_pass_recomputes_cheap_modules_before_layers():
    """With module recomputation among the candidates (`stage_modes(modules=...)`: each of
    none, selective, block 1 and block N/2 also with the modules, full still last) the pass
    frees memory by the norms' and activation's outputs first (a third of the bytes for a few
    per cent of the time) and recomputes layers only on top of that, where it must."""
    both = ("layernorm", "mlp_act")
    modes = stage_modes(4, modules=both)
    plain = stage_modes(4)
    assert len(modes) == 9 and modes[:4] == plain[:4] and modes[-1] == plain[-1]
    assert modes[4:8] == tuple(MemoryPolicy(p.method, p.layers, 0, both) for p in plain[:4])
    assert len(stage_modes(4, offload=True, modules=both)) == 13
    g = unit_graph(single_module(2, 4))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    orders = list_schedule(g, priority=prio).orders  # rank 0 keeps 4 activations alive
    cheap, block = MemoryPolicy(Recompute.NONE, 0, 0, both), MemoryPolicy(Recompute.BLOCK, 1)
    block_cheap = MemoryPolicy(Recompute.BLOCK, 1, 0, both)
    table = {
        plain[0]: (3.0, 100),
        cheap: (3.05, 65),
        block: (3.25, 75),
        block_cheap: (3.28, 50),
        plain[-1]: (4.2, 10),
    }

    def choose(limit: float):
        return choose_recompute(
            orders,
            mode_cost=lambda s, m: table[m],
            modes_of=lambda s: (plain[0], cheap, block, block_cheap, plain[-1]),
            keeps_activations=lambda s: True,
            memory_limit=[limit, 1000],
        )

    roomy = choose(260)
    assert {roomy.of(StageId("m", 0, mb)) for mb in range(4)} == {cheap}
    assert roomy.added_time == pytest.approx(4 * 0.05)
    tight = choose(200)  # 4 x 65 > 200: block recomputation on top, full nowhere
    assert {tight.of(StageId("m", 0, mb)) for mb in range(4)} <= {cheap, block_cheap}
    assert tight.added_time < 4 * 0.28


def test_the_memory_pass_keeps_offloaded_bytes_under_the_host_limit():
    """Offload is free but host memory holds two stages' offloaded bytes at once: without a
    host limit all four alive stages offload; with it two do, and the pass fits the device
    limit the cheapest other way (one stage recomputes fully, one keeps everything)."""
    g = unit_graph(single_module(2, 4))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    orders = list_schedule(g, priority=prio).orders  # rank 0 keeps 4 activations alive
    none, full = MemoryPolicy(Recompute.NONE, 0), MemoryPolicy(Recompute.FULL, 0)
    off = MemoryPolicy(Recompute.NONE, 0, 1)
    table = {none: (3.0, 100), off: (3.0, 60), full: (4.0, 10)}

    def choose(**host):
        return choose_recompute(
            orders,
            mode_cost=lambda s, m: table[m],
            modes_of=lambda s: (none, off, full),
            keeps_activations=lambda s: True,
            memory_limit=[250, 1000],
            **host,
        )

    stages = [StageId("m", 0, mb) for mb in range(4)]
    assert [choose().of(s) for s in stages] == [off] * 4
    bound = choose(host_bytes=lambda s, m: 40 if m.offload else 0, host_limit=[80, 80])
    assert sorted(map(str, (bound.of(s) for s in stages))) == sorted(
        map(str, (off, off, none, full))
    )
    assert bound.added_time == pytest.approx(1.0)
    # The demotion after scheduling (the orders changed): all four offloads alive at once, two
    # over the host limit go to full recomputation, and the time they add is counted.
    free = choose()
    demoted = within_host_limit(
        orders,
        free,
        host_bytes=lambda s, m: 40 if m.offload else 0,
        host_limit=[80, 80],
        keeps_activations=lambda s: True,
        mode_cost=lambda s, m: table[m],
    )
    assert sorted(map(str, (demoted.of(s) for s in stages))) == sorted(
        map(str, (off, off, full, full))
    )
    assert demoted.added_time == pytest.approx(free.added_time + 2 * 1.0)


@pytest.mark.parametrize(("selective_time", "solved"), [(3.2, True), (3.001, False)])
def test_the_recompute_milp_runs_only_where_it_can_save_a_percent(
    monkeypatch, selective_time, solved
):
    """The MILP can save at most what the greedy answer adds: with selective recomputation
    adding 4 x 0.2 s to rank 0's 12 s it is solved; adding 4 x 0.001 s (< 1%) it is not, and
    the greedy answer stands."""
    from megatron_dip.planner import memory

    calls = []
    exact = memory._exact
    monkeypatch.setattr(memory, "_exact", lambda pb: calls.append(pb) or exact(pb))
    g = unit_graph(single_module(2, 4))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    orders = list_schedule(g, priority=prio).orders
    none, sel, full = (
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.FULL, 0),
    )
    table = {none: (3.0, 100), sel: (selective_time, 60), full: (4.0, 10)}
    choice = choose_recompute(
        orders,
        mode_cost=lambda s, m: table[m],
        modes_of=lambda s: (none, sel, full),
        keeps_activations=lambda s: True,
        memory_limit=[250, 1000],
    )
    assert bool(calls) == solved
    assert all(choice.of(StageId("m", 0, mb)) == sel for mb in range(4))


def test_the_milps_native_output_stays_out_of_stdout(capfd, monkeypatch):
    """HiGHS prints some messages from C++ to descriptor 1 whatever `disp` says: a stand-in
    milp writes to the descriptor and through C's buffered stdio; neither reaches stdout,
    what Python prints around the solve does."""
    import ctypes
    import os

    import scipy.optimize

    real, calls = scipy.optimize.milp, []

    def chatty(*args, **kwargs):
        os.write(1, b"HighsMipSolverData::raw\n")
        ctypes.CDLL(None).printf(b"HighsMipSolverData::buffered\n")
        calls.append(kwargs.get("options", {}).get("disp"))
        return real(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", chatty)
    g = unit_graph(single_module(2, 4))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    orders = list_schedule(g, priority=prio).orders
    none, sel, full = (
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.FULL, 0),
    )
    table = {none: (3.0, 100), sel: (3.2, 60), full: (4.0, 10)}
    print("before the solve")
    choose_recompute(
        orders,
        mode_cost=lambda s, m: table[m],
        modes_of=lambda s: (none, sel, full),
        keeps_activations=lambda s: True,
        memory_limit=[250, 1000],
    )
    print("after the solve")
    out = capfd.readouterr().out
    assert calls and calls[0] is False, "the MILP did not run"
    assert "HighsMipSolverData" not in out
    assert "before the solve" in out and "after the solve" in out


def test_the_memory_pass_undoes_greedy_upgrades_that_became_unnecessary(monkeypatch):
    """Alive-sets {a, b} and {b, c} over a limit of 100: greedy relieves the first by
    recomputing a (the best bytes per second there), then the second by b, which relieves the
    first too; a's upgrade is undone, only b recomputes (the exact solver is off here)."""
    from megatron_dip.planner import memory

    monkeypatch.setattr(memory, "_exact", lambda pb: None)
    a, b, c = (StageId("m", 0, k) for k in range(3))
    order = [Forward(a), Forward(b), Backward(a), Forward(c), Backward(b), Backward(c)]
    none, sel = MemoryPolicy(Recompute.NONE, 0), MemoryPolicy(Recompute.SELECTIVE, 0)
    sel_time = {a: 1.0, b: 1.1, c: 1.2}
    choice = choose_recompute(
        [order],
        mode_cost=lambda s, m: (0.0, 60) if m == none else (sel_time[s], 30),
        modes_of=lambda s: (none, sel),
        keeps_activations=lambda s: True,
        memory_limit=[100],
    )
    assert [choice.of(s) for s in (a, b, c)] == [none, sel, none]
    assert choice.added_time == pytest.approx(1.1)


def test_relaxing_takes_back_what_the_schedules_own_alive_sets_do_not_need():
    """A choice made on a looser order (a, b, c all alive: each recomputes) relaxed on the
    throttled order the schedule ran (at most two alive at once, limit 100): one upgrade of
    each pair stays, the costliest one not needed (c's) is taken back, and its time with it.
    Orders that do not fit the choice itself leave it as it is."""
    a, b, c = (StageId("m", 0, k) for k in range(3))
    none, sel = MemoryPolicy(Recompute.NONE, 0), MemoryPolicy(Recompute.SELECTIVE, 0)
    sel_time = {a: 1.0, b: 1.1, c: 1.2}
    choice = RecomputeChoice({a: sel, b: sel, c: sel}, 3.3)
    kw = dict(
        mode_cost=lambda s, m: (0.0, 60) if m == none else (sel_time[s], 30),
        modes_of=lambda s: (none, sel),
        keeps_activations=lambda s: True,
    )
    order = [Forward(a), Forward(b), Backward(a), Forward(c), Backward(b), Backward(c)]
    relaxed = relax_choice([order], choice, memory_limit=[100], **kw)
    # Costliest first: c back to none leaves {b, c} at 30 + 60; b then would take {b, c} to
    # 120; a back to none leaves {a, b} at 60 + 30. b's recomputation serves both pairs.
    assert [relaxed.of(s) for s in (a, b, c)] == [none, sel, none]
    assert relaxed.added_time == pytest.approx(1.1)
    assert relax_choice([order], choice, memory_limit=[50], **kw) is choice


def test_the_memory_pass_ends_where_no_mode_relieves_a_set(monkeypatch):
    """A limit below full recomputation is refused up front; and greedy keeps moving where a
    set is over the device
    limit whose floor modes (offload, 40 host bytes each) already break a host limit of 10 by
    more than any one move gives back: stepping off offload must stay allowed. Both looped for
    ever before (the py312 suite timed out in the second)."""
    from megatron_dip.planner import memory

    monkeypatch.setattr(memory, "_exact", lambda pb: None)
    a, b = StageId("m", 0, 0), StageId("m", 0, 1)
    order = [Forward(a), Forward(b), Backward(b), Backward(a)]
    none, full = MemoryPolicy(Recompute.NONE, 0), MemoryPolicy(Recompute.FULL, 0)
    off = MemoryPolicy(Recompute.NONE, 0, 1)
    costs = {none: (0.0, 60), off: (0.5, 20), full: (1.0, 10)}
    with pytest.raises(MemoryLimitError, match="even with full recomputation"):
        choose_recompute(
            [order],
            mode_cost=lambda s, m: costs[m],
            modes_of=lambda s: (none, full),
            keeps_activations=lambda s: True,
            memory_limit=[5],
        )
    choice = choose_recompute(
        [order],
        mode_cost=lambda s, m: costs[m],
        modes_of=lambda s: (none, off, full),
        keeps_activations=lambda s: True,
        memory_limit=[35],
        host_bytes=lambda s, m: 40 if m == off else 0,
        host_limit=[10],
        floor=lambda s: off,
    )
    # One stage steps off offload to full recomputation (the other stays at its floor, which
    # is not listed); the host limit stays broken for `within_host_limit` to repair.
    assert list(choice.modes.values()) == [full]


def test_the_recompute_milp_has_no_clock_in_it(monkeypatch):
    """The exact solver is bounded by its node count alone (no time limit: a loaded rank
    would stop it elsewhere than an idle one), and only small problems reach it."""
    import scipy.optimize

    from megatron_dip.planner import memory

    real, options = scipy.optimize.milp, []

    def spy(*args, **kwargs):
        options.append(dict(kwargs["options"]))  # copied: milp consumes its options
        return real(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    g = unit_graph(single_module(2, 4))
    prio = priorities_from_units(g.stages, [("m", mb) for mb in range(4)])
    orders = list_schedule(g, priority=prio).orders
    none, sel, full = (
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.FULL, 0),
    )
    table = {none: (3.0, 100), sel: (3.2, 60), full: (4.0, 10)}
    choose_recompute(
        orders,
        mode_cost=lambda s, m: table[m],
        modes_of=lambda s: (none, sel, full),
        keeps_activations=lambda s: True,
        memory_limit=[250, 1000],
    )
    assert options and all("time_limit" not in o for o in options)
    assert all(o["node_limit"] == memory.MILP_NODE_LIMIT for o in options)
    assert memory.MILP_MAX_STAGES <= 64
