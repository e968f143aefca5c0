"""Split backwards (B / W) and explicit gradient reductions in the plan format, the engine and the
planner. The runtime's split itself: `test_runtime_backward_split.py`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_dip.schedule import (
    BatchTotals,
    ChunkSpec,
    Dependency,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    PlanError,
    Program,
    SubMicrobatch,
    TensorSpec,
    WorkId,
    build_1f1b_plan,
    build_segment_plan,
    execute_programs,
    format_plan,
    plan_from_bytes,
    plan_to_bytes,
    validate_plan,
)
from megatron_dip.schedule.backward_split import split_backwards
from megatron_dip.schedule.ir import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ReduceGrads,
    StageId,
)

HIDDEN = (TensorSpec("hidden", (4, 8)),)


def two_modules(*, vit_trainable=True):
    """ViT (2 chunks) -> LLM (2 chunks) on 2 ranks, chunk c on rank c, two microbatches."""
    layouts = tuple(
        ModuleLayout(
            m, 2, m != "vit" or vit_trainable, tuple(ChunkSpec(m, c, c, c, c + 1) for c in range(2))
        )
        for m in ("vit", "llm")
    )
    subs = [SubMicrobatch(m, mb, 0, 0, 1, 4, 4) for mb in range(2) for m in ("vit", "llm")]
    return build_segment_plan(
        placement=Placement(2, layouts),
        microbatches=[MicrobatchInfo(i, (i,), 4) for i in range(2)],
        submicrobatches=subs,
        dependencies=[Dependency(WorkId("vit", mb), WorkId("llm", mb)) for mb in range(2)],
        totals=BatchTotals(2, 2, 8),
        tensors=lambda key: HIDDEN,
    )


def split(plan):
    return replace(plan, programs=split_backwards(plan))


def heavy_stages(plan, cost) -> set:
    """The stages whose pending W would hold more than their activations (recomputed in B)."""
    from megatron_dip.planner.simulator import stage_costs

    costs, _ = stage_costs(plan, cost)
    return {s for s, c in costs.items() if c.pending_weight_bytes > c.activation_bytes}


def fused_and_weights(plan) -> tuple[set, set]:
    """(stages with a fused backward, stages with a separate W) of `plan`."""
    kinds = [i for p in plan.programs for i in p.instructions]
    fused = {i.stage for i in kinds if type(i) is Backward}
    return fused, {i.stage for i in kinds if isinstance(i, BackwardWeight)}


def test_split_plans_validate_serialize_and_print():
    for plan in (build_1f1b_plan(num_ranks=2, num_microbatches=3), two_modules()):
        s = split(plan)
        validate_plan(s)
        assert plan_from_bytes(plan_to_bytes(s)) == s
        text = format_plan(s)
        assert "BI " in text and "BW " in text and "R " in text
        kinds = [type(i) for p in s.programs for i in p.instructions]
        assert Backward not in kinds
        # Each W right after its B; one reduction per chunk of the rank.
        for p in s.programs:
            for i, ins in enumerate(p.instructions):
                if isinstance(ins, BackwardInput):
                    assert p.instructions[i + 1] == BackwardWeight(ins.stage)
            chunks = {(c.module, c.index) for c in plan.placement.chunks_on_rank(p.rank)}
            assert {
                (r.module, r.chunk) for r in p.instructions if isinstance(r, ReduceGrads)
            } == chunks


def test_frozen_module_has_no_weight_half():
    s = split(two_modules(vit_trainable=False))
    validate_plan(s)
    ws = [i for p in s.programs for i in p.instructions if isinstance(i, BackwardWeight)]
    assert ws and all(w.stage.module == "llm" for w in ws)
    reduced = [i for p in s.programs for i in p.instructions if isinstance(i, ReduceGrads)]
    assert {r.module for r in reduced} == {"llm"}
    bad = _edit(s, 0, lambda ins: ins.append(BackwardWeight(StageId("vit", 0, 0))))
    with pytest.raises(PlanError, match="frozen: it has no weight gradients"):
        validate_plan(bad)


def _edit(plan, rank, fn):
    ins = list(plan.programs[rank].instructions)
    fn(ins)
    programs = list(plan.programs)
    programs[rank] = Program(rank, tuple(ins))
    return replace(plan, programs=tuple(programs))


def _move_w_before_b(ins):
    k = next(k for k, x in enumerate(ins) if isinstance(x, BackwardWeight))
    w = ins.pop(k)
    ins.insert(k - 1, w)


def _drop_w(ins):
    del ins[next(k for k, x in enumerate(ins) if isinstance(x, BackwardWeight))]


def _reduce_early(ins):
    k = next(k for k, x in enumerate(ins) if isinstance(x, ReduceGrads))
    r = ins.pop(k)
    ins.insert(0, r)


def _swap_reductions(ins):
    first = next(k for k, x in enumerate(ins) if isinstance(x, ReduceGrads))
    ins.append(ins.pop(first))


def _second_w(ins):
    k = next(k for k, x in enumerate(ins) if isinstance(x, BackwardWeight))
    ins.insert(k + 1, ins[k])


def _foreign_w(ins):
    ins.append(BackwardWeight(StageId("llm", 1, 0)))


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (_move_w_before_b, "BackwardWeight before its BackwardInput"),
        (_drop_w, "has no BackwardWeight"),
        (_reduce_early, "after its reduction"),
        (_second_w, "second BackwardWeight"),
        (_foreign_w, "lives on rank 1"),
    ],
)
def test_split_errors(mutate, fragment):
    with pytest.raises(PlanError, match=fragment):
        validate_plan(_edit(split(two_modules()), 0, mutate))


def test_reductions_in_canonical_order():
    plan = split(build_1f1b_plan(num_ranks=1, num_microbatches=2))
    validate_plan(plan)
    s = split(two_modules())  # rank 0 holds vit0 and llm0: llm0 is reduced first
    assert [i for i in s.programs[0].instructions if isinstance(i, ReduceGrads)] == [
        ReduceGrads("llm", 0),
        ReduceGrads("vit", 0),
    ]
    with pytest.raises(PlanError, match="canonical order"):
        validate_plan(_edit(s, 0, _swap_reductions))


def test_engine_times_weight_halves_and_reductions():
    s = split(build_1f1b_plan(num_ranks=2, num_microbatches=2))

    def cost(rank, ins):
        if isinstance(ins, ReduceGrads):
            return 5.0
        return 1.0

    result = execute_programs(s.programs, compute_time=cost)
    # Each rank: 2 F + 2 B + 2 W = 6 compute spans; one reduction each, overlapping nothing
    # after the last W: it ends the rank.
    assert [len(sp) for sp in result.spans] == [6, 6]
    assert [len(r) for r in result.reductions] == [1, 1]
    for r in range(2):
        (_, start, end), last_w = result.reductions[r][0], result.spans[r][-1][2]
        assert start == pytest.approx(last_w) and end == pytest.approx(last_w + 5.0)
        assert result.finish[r] == pytest.approx(end)


def test_weights_fill_the_drain_of_1f1b_like_zb_h1():
    """F = B = W = 1: 1F1B takes (M + P - 1) * 3; with W deferred into the bubbles the
    makespan is ZB-H1's 3M + (P - 1) (its bubble (P - 1)(F + B - W)), a valid plan."""
    from megatron_dip.schedule.zero_bubble import fill_bubbles_with_weights

    def cost(rank, ins):
        return 0.0 if isinstance(ins, ReduceGrads) else 1.0 + (type(ins) is Backward)

    def run(programs):
        return execute_programs(programs, compute_time=cost)

    for p, m in ((4, 8), (8, 16)):
        plan = build_1f1b_plan(num_ranks=p, num_microbatches=m)
        assert run(plan.programs).makespan == 3 * (m + p - 1)
        programs, result = fill_bubbles_with_weights(
            split_backwards(plan), placement=plan.placement, execute=run
        )
        validate_plan(replace(plan, programs=programs))
        assert result.makespan == 3 * m + p - 1
        # Within 1F1B's own memory (rank r holds at most P - r microbatches): still faster.
        kept, held = fill_bubbles_with_weights(
            split_backwards(plan),
            placement=plan.placement,
            execute=run,
            weight_bytes=lambda stage: 1.0,
            memory_limit=[float(p - r) for r in range(p)],
        )
        assert held.makespan < 3 * (m + p - 1)
        for r, program in enumerate(kept):
            alive = peak = 0
            for ins in program.instructions:
                alive += isinstance(ins, Forward) - isinstance(ins, BackwardWeight)
                peak = max(peak, alive)
            assert peak <= p - r


def test_planner_splits_backwards_only_where_faster_and_fitting():
    """The DIP planner with `split_backward`: a valid plan, no slower than without the split
    and within the memory limit; the split plan (when taken) defers some W past its B."""
    from planner_cases import tiny_case

    from megatron_dip.planner.simulator import simulate
    from megatron_dip.planner.weight_fill import split_into_bubbles

    case = tiny_case(pipeline=4, search=False)
    cost = case.cost_model()
    fused = case.planner(None).plan_batch(case.batch)[0].plan
    base = simulate(fused, cost)
    split, sim = split_into_bubbles(fused, cost)
    validate_plan(split)
    assert sim.iteration_time <= base.iteration_time
    assert split is not fused and sim.iteration_time < base.iteration_time
    deferred = 0
    for p in split.programs:
        for i, ins in enumerate(p.instructions):
            if isinstance(ins, BackwardInput) and BackwardWeight(ins.stage) in p.instructions:
                deferred += p.instructions[i + 1] != BackwardWeight(ins.stage)
    assert deferred > 0
    # Under a limit at the fused plan's own peaks, the split plan holds no more.
    held, sim2 = split_into_bubbles(fused, cost, limits=list(base.peak_activation_bytes))
    assert all(p <= q for p, q in zip(sim2.peak_activation_bytes, base.peak_activation_bytes))
    assert sim2.iteration_time <= base.iteration_time


def test_at_its_memory_limit_a_plan_splits_the_backwards_whose_w_holds_no_more():
    """The LLM's chunks under full recomputation: their W would hold the layers B rebuilt,
    more than their forward kept. Limited to the fused plan's own peaks, the
    split plan keeps exactly those backwards fused, splits the rest (a valid mixed plan) and
    stays within the peaks; without a limit every backward is split."""
    from planner_cases import tiny_case

    from megatron_dip.planner.simulator import simulate, stage_costs
    from megatron_dip.planner.weight_fill import split_into_bubbles
    from megatron_dip.schedule.ir import MemoryPolicy, Recompute

    case = tiny_case(pipeline=2, search=False)
    cost = case.cost_model()
    plan = case.planner(None).plan_batch(case.batch)[0].plan
    full = MemoryPolicy(Recompute.FULL)

    def recomputed(ins):
        llm = isinstance(ins, Forward) and ins.stage.module == "llm"
        return replace(ins, memory=full) if llm else ins

    programs = [
        replace(p, instructions=tuple(map(recomputed, p.instructions))) for p in plan.programs
    ]
    plan = replace(plan, programs=tuple(programs))
    costs, _ = stage_costs(plan, cost)
    heavy = heavy_stages(plan, cost)
    assert heavy == {s for s in costs if s.module == "llm"}
    peaks = list(simulate(plan, cost).peak_activation_bytes)

    open_split, _ = split_into_bubbles(plan, cost, require_faster=False)
    assert fused_and_weights(open_split)[0] == set()
    held, sim = split_into_bubbles(plan, cost, limits=peaks, require_faster=False)
    validate_plan(held)
    fused, weights = fused_and_weights(held)
    assert fused == heavy and weights and not weights & heavy
    assert all(p <= q for p, q in zip(sim.peak_activation_bytes, peaks))


@pytest.mark.parametrize("pipeline", [1, 2])
def test_split_always_runs_a_split_plan_where_the_fused_one_is_faster(pipeline):
    """With host time per instruction (1 ms, far above the tiny model's compute) a split plan's
    extra W instructions make it slower: `split_backward` keeps the fused plan, `split_always`
    a valid split plan (what a benchmark of the split runtime needs), slower in simulation."""
    from planner_cases import tiny_case

    from megatron_dip.planner.dip import DipPlanner
    from megatron_dip.planner.overheads import HostOverheads
    from megatron_dip.planner.simulator import simulate

    case = tiny_case(pipeline=pipeline, search=False)
    base = case.planner(None)
    cost = base.cost_model.with_overheads(HostOverheads(instruction=1e-3))

    def planned(**flags):
        config = replace(base.config, **flags)
        plan = DipPlanner(base.model, cost, base.placement, config).plan_batch(case.batch)[0].plan
        validate_plan(plan)
        weights = sum(isinstance(i, BackwardWeight) for p in plan.programs for i in p.instructions)
        return weights, simulate(plan, cost).iteration_time

    fused = planned()
    assert planned(split_backward=True) == fused and fused[0] == 0
    weights, time = planned(split_backward=True, split_always=True)
    assert weights > 0 and time > fused[1]


def test_list_scheduler_puts_weights_into_the_drain_within_memory():
    """One module over P ranks, F = B = W = 1 (fused backward 2), each rank limited to 1F1B's
    memory (rank r holds at most P - r microbatches): the list scheduler with split backwards
    is strictly shorter than with fused ones, every W runs after its B, and no rank ever holds
    more than its limit, though a pending W keeps its activations."""
    from megatron_dip.planner.list_scheduler import build_stage_graph, list_schedule
    from megatron_dip.planner.split_schedule import best_split_schedule, split_graph
    from megatron_dip.schedule.graph import Dataflow

    p, m = 4, 8
    chunks = tuple(ChunkSpec("m", c, c, c, c + 1) for c in range(p))
    placement = Placement(p, (ModuleLayout("m", p, True, chunks),))
    subs = [SubMicrobatch("m", mb, 0, 0, 1, 10, 10) for mb in range(m)]
    graph = build_stage_graph(
        Dataflow(placement, subs, []),
        stage_cost=lambda s, r: (1.0, 2.0, 1),
        transfer=lambda k: 0.0,
    )
    priority = [(s.microbatch, s.chunk) for s in graph.stages]
    limits = [float(p - r) for r in range(p)]
    fused = list_schedule(graph, priority=priority, memory_limit=limits)
    split = best_split_schedule(
        split_graph(graph, lambda s: (1.0, 1.0, 1)), priority=priority, memory_limit=limits
    )
    assert split is not None and split.makespan < fused.makespan
    assert all(peak <= lim for peak, lim in zip(split.peak_memory, limits))
    for r, order in enumerate(split.orders):
        held = peak = 0
        seen = set()
        for ins in order:
            if isinstance(ins, BackwardInput):
                seen.add(ins.stage)
            if isinstance(ins, BackwardWeight):
                assert ins.stage in seen
            held += isinstance(ins, Forward) - isinstance(ins, BackwardWeight)
            peak = max(peak, held)
        assert peak <= limits[r]
        assert sum(isinstance(i, BackwardWeight) for i in order) == m


@pytest.mark.parametrize("search", [False, True])
def test_planner_with_split_backward_fits_and_never_loses(search: bool, monkeypatch):
    """`PlannerConfig.split_backward` under a memory limit that binds (60% of the unlimited
    plan's peak): a valid split plan within the limit per the simulator, no slower than the
    same planner's fused plan; with the search on, also when the search runs again with split
    schedules as its score (`SplitCandidates.searched_order`)."""
    from planner_cases import tiny_case

    from megatron_dip.planner.simulator import simulate
    from megatron_dip.planner.split_candidates import SplitCandidates

    searched = []
    searched_order = SplitCandidates.searched_order
    monkeypatch.setattr(
        SplitCandidates,
        "searched_order",
        lambda *a: searched.append(1) or searched_order(*a),
    )
    case = tiny_case(pipeline=4, search=search)
    cost = case.cost_model()
    free = simulate(case.planner(None).plan_batch(case.batch)[0].plan, cost)
    limit = 0.6 * max(free.peak_activation_bytes)
    planner = case.planner(limit)
    fused = simulate(planner.plan_batch(case.batch)[0].plan, cost)
    planner.config = replace(planner.config, split_backward=True, split_search=True)
    plan = planner.plan_batch(case.batch)[0].plan
    validate_plan(plan)
    sim = simulate(plan, cost)
    assert any(isinstance(i, BackwardWeight) for p in plan.programs for i in p.instructions)
    assert all(peak <= limit for peak in sim.peak_activation_bytes)
    assert sim.iteration_time < fused.iteration_time
    assert len(searched) == search


def test_list_scheduled_split_keeps_heavy_backwards_fused_where_all_split_does_not_fit(
    monkeypatch,
):
    """DIP's own order list-scheduled with split backwards (`SplitCandidates.order_plan`):
    where no all-split schedule fits (forced here), it schedules again with the stages whose
    pending W holds more than their activations fused; under a binding limit (60% of the
    unlimited peak, so some chunks recompute) that gives a valid mixed plan within the limit
    whose fused backwards are exactly those heavy stages."""
    from planner_cases import tiny_case

    from megatron_dip.planner import weight_fill
    from megatron_dip.planner.simulator import simulate
    from megatron_dip.planner.split_candidates import SplitCandidates

    case = tiny_case(pipeline=2, search=False)
    cost = case.cost_model()
    free = simulate(case.planner(None).plan_batch(case.batch)[0].plan, cost)
    limit = 0.6 * max(free.peak_activation_bytes)
    planner = case.planner(limit)
    planner.config = replace(planner.config, split_backward=True, split_always=True)
    tried = []
    options_plan = SplitCandidates.options_plan

    def all_split_never_fits(self, *args):
        tried.append(args[-1])
        return options_plan(self, *args) if args[-1] else None

    monkeypatch.setattr(SplitCandidates, "options_plan", all_split_never_fits)
    # Only the list-scheduled split candidate: the post-pass (imported by the planner as it
    # runs) keeps the fused plan.
    monkeypatch.setattr(
        weight_fill, "split_into_bubbles", lambda plan, cost, **kw: (plan, simulate(plan, cost))
    )
    plan = planner.plan_batch(case.batch)[0].plan
    validate_plan(plan)
    assert tried[:2] == [False, True]
    heavy = heavy_stages(plan, cost)
    fused, weights = fused_and_weights(plan)
    assert heavy and fused == heavy and weights and not weights & heavy
    assert all(peak <= limit for peak in simulate(plan, cost).peak_activation_bytes)


def test_a_split_schedule_over_its_limit_with_its_message_buffers_is_scheduled_again(
    monkeypatch,
):
    """A split candidate list-scheduled right up to the device's limit (no room for its message
    buffers) holds more than the limit once its buffers count; `SplitCandidates.fitted`
    schedules it again within the limit less those buffers (`message_room.grown_room`), and
    the plan fits. Without the refit the candidate would be dropped."""
    import functools

    from planner_cases import tiny_case

    from megatron_dip.planner import split_candidates
    from megatron_dip.planner.simulator import message_peaks, simulate
    from megatron_dip.planner.split_candidates import SplitCandidates
    from megatron_dip.planner.split_schedule import split_plan

    case = tiny_case(pipeline=2, search=False)
    cost = case.cost_model()
    free = simulate(case.planner(None).plan_batch(case.batch)[0].plan, cost)
    planner = case.planner(0.8 * max(free.peak_activation_bytes))
    planner.config = replace(planner.config, split_backward=True)
    calls = []
    fitted = SplitCandidates.fitted
    monkeypatch.setattr(
        SplitCandidates, "fitted", lambda self, *a: calls.append((self, a)) or fitted(self, *a)
    )
    planner.plan_batch(case.batch)
    candidates, (order, _, choice, keep_heavy) = calls[0]
    caps = list(candidates.caps)
    no_room = replace(candidates, limits=caps)
    schedule = no_room.scheduled(order, choice, caps, keep_heavy)
    tensors = functools.partial(planner.message_tensors, no_room.sub_of)
    plan = split_plan(no_room.own, schedule, no_room.dataflow, tensors)
    over = [p - c for p, c in zip(simulate(plan, cost).peak_activation_bytes, caps)]
    assert max(over) > 0 and max(over) <= max(message_peaks(plan)), over
    plan, sim = no_room.fitted(order, schedule, choice, keep_heavy)
    validate_plan(plan)
    assert all(p <= c for p, c in zip(sim.peak_activation_bytes, caps))
    monkeypatch.setattr(split_candidates, "MESSAGE_REFITS", 0)
    assert no_room.fitted(order, schedule, choice, keep_heavy) is None


def _reduction_case():
    """One rank holding two independent modules: x (one microbatch, its chunk's reduction
    takes 10 s) scheduled first, y (6 microbatches, no reduction) after it. F = B = W = 1, so
    the rank always has a y node ready and, by the fill rule alone, defers x's W until its F and
    B are done."""
    from megatron_dip.planner.list_scheduler import build_stage_graph
    from megatron_dip.planner.split_schedule import split_graph, with_reductions
    from megatron_dip.schedule.graph import Dataflow

    placement = Placement(
        1,
        (
            ModuleLayout("x", 1, True, (ChunkSpec("x", 0, 0, 0, 1),)),
            ModuleLayout("y", 1, True, (ChunkSpec("y", 0, 0, 0, 1),)),
        ),
    )
    subs = [SubMicrobatch("x", 0, 0, 0, 1, 10, 10)]
    subs += [SubMicrobatch("y", mb, 0, 0, 1, 10, 10) for mb in range(1, 7)]
    fused = build_stage_graph(
        Dataflow(placement, subs, []), stage_cost=lambda s, r: (1.0, 2.0, 1), transfer=lambda k: 0.0
    )
    graph = split_graph(fused, lambda s: (1.0, 1.0, 1))
    reduced = with_reductions(graph, placement, lambda c: 10.0 if c.module == "x" else 0.0)
    priority = [(s.module, s.microbatch) for s in graph.stages]
    return graph, reduced, priority


def test_split_schedule_does_not_defer_w_past_the_reduction_deadline():
    """Deferring x's W to the drain (what the fill rule does without a deadline) leaves its
    10 s reduction exposed after the last compute; with the reduction in the graph, the
    scheduler prices it (makespan = compute + exposed reduction) and runs x's W early enough
    that the reduction ends with the compute."""
    from megatron_dip.planner.list_scheduler import list_schedule, split_list_schedule

    graph, reduced, priority = _reduction_case()
    compute = 7 * 3.0  # every F, B and W on the one rank, back to back
    blind = list_schedule(reduced, priority=priority)  # one run: no deadline known yet
    x_weight = BackwardWeight(StageId("x", 0, 0))
    assert blind.orders[0].index(x_weight) == 14  # after every F and B
    assert blind.makespan == pytest.approx(15.0 + 10.0)
    assert split_list_schedule(graph, priority=priority).makespan == pytest.approx(compute)
    aware = split_list_schedule(reduced, priority=priority)
    assert aware.makespan == pytest.approx(compute)
    order = aware.orders[0]
    last_x = order.index(x_weight)
    assert sum(aware.durations[i] for i in order[: last_x + 1]) + 10.0 <= compute


def test_split_score_is_the_best_split_schedules_makespan():
    """The order search's scorer with split backwards (`SplitScore`) gives the makespan of the
    schedule `best_split_schedule` builds for the same order, and prices the reduction an order
    leaves exposed."""
    from megatron_dip.planner.split_schedule import SplitScore, best_split_schedule

    graph, reduced, priority = _reduction_case()
    units = sorted({(s.module, s.microbatch) for s in graph.stages})
    for g in (graph, reduced):
        best = best_split_schedule(g, priority=priority, memory_limit=None)
        assert SplitScore(g, None)(units) == pytest.approx(best.makespan)
    # y before x: x's W and its 10 s reduction come last whatever the scheduler does
    late = SplitScore(reduced, None)(units[1:] + units[:1])
    assert late == pytest.approx(7 * 3.0 + 10.0)
