"""The planner's fast paths against the implementations they replaced (`reference_planner.py`):
the compiled list scheduler and the integer-indexed execution engine must give the same
orders, times, peaks and errors, bit for bit, on random stage graphs (ties of priorities and
ready times, memory limits that bind, fixed segment order) and on the planner's own graphs
and plans of hypothesis-generated cases (`planner_cases.py`). `--fuzz` runs many more cases."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_cases import cases, fixed_cases, limit_for
from reference_planner import reference_execute_programs, reference_list_schedule

from megatron_dip.planner import list_scheduler, schedule_kernel
from megatron_dip.planner.list_scheduler import (
    StageGraph,
    list_makespan,
    list_schedule,
    priorities_from_units,
    priority_ranks,
    unit_priority_ranks,
)
from megatron_dip.planner.memory import MemoryLimitError
from megatron_dip.planner.search import _rollout, unit_constraints
from megatron_dip.planner.simulator import simulate
from megatron_dip.schedule.engine import PlanError, execute_programs, per_peer_channel
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import NO_RECOMPUTE, Forward, Program, Send, StageId


@st.composite
def stage_graphs(draw) -> tuple[StageGraph, list[tuple], list[float] | None, bool]:
    """A random DAG of stages (forward edges i -> j for i < j, gradients back), durations and
    bytes from small sets (so ties happen), priorities with ties, optional memory limits."""
    n = draw(st.integers(1, 24))
    ranks = draw(st.integers(1, 4))
    rank = [draw(st.integers(0, ranks - 1)) for _ in range(n)]
    fwd = [draw(st.sampled_from([0.5, 1.0, 1.0, 2.0])) for _ in range(n)]
    bwd = [draw(st.sampled_from([1.0, 2.0, 3.0])) for _ in range(n)]
    act = [draw(st.sampled_from([1, 2, 3])) for _ in range(n)]
    has_b = [draw(st.booleans()) or draw(st.booleans()) for _ in range(n)]
    succ: list[list[tuple[int, float]]] = [[] for _ in range(2 * n)]
    npred = [0] * (2 * n)
    for k in range(n):
        if has_b[k]:
            succ[2 * k].append((2 * k + 1, 0.0))
            npred[2 * k + 1] += 1
    for j in range(n):
        for i in draw(st.sets(st.integers(0, max(0, j - 1)), max_size=2)) if j else ():
            delay = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
            succ[2 * i].append((2 * j, delay))
            npred[2 * j] += 1
            if has_b[i] and has_b[j]:
                succ[2 * j + 1].append((2 * i + 1, delay))
                npred[2 * i + 1] += 1
    stages = [StageId("m", k, 0) for k in range(n)]
    graph = StageGraph(stages, rank, fwd, bwd, act, has_b, succ, npred, ranks)
    fill = draw(st.booleans())
    if fill:
        groups = draw(st.integers(1, n))
        priority = [(draw(st.integers(0, groups)), draw(st.integers(0, 1))) for _ in range(n)]
    else:  # a fixed order must follow the edges (i < j) to be schedulable
        width = draw(st.integers(1, 3))
        priority = [(k // width, 0) for k in range(n)]
    limits = draw(
        st.one_of(
            st.none(),
            st.lists(st.sampled_from([1, 2, 3, 5, 8, 100]), min_size=ranks, max_size=ranks),
        )
    )
    return graph, priority, limits, fill


def _same_schedule(graph, priority, limits, fill) -> None:
    want = reference_list_schedule(graph, priority=priority, memory_limit=limits, fill_bubbles=fill)
    got = list_schedule(graph, priority=priority, memory_limit=limits, fill_bubbles=fill)
    assert got.orders == want.orders
    assert (got.makespan, got.peak_memory, got.overcommitted) == (
        want.makespan,
        want.peak_memory,
        want.overcommitted,
    )
    assert got.durations == want.durations
    ranks = priority_ranks(priority)
    assert list_makespan(graph, priority=ranks, memory_limit=limits, fill_bubbles=fill) == (
        want.makespan
    )


@settings(max_examples=max(200, settings.default.max_examples), deadline=None)
@given(stage_graphs())
def test_compiled_list_scheduler_matches_the_reference_on_random_graphs(drawn) -> None:
    _same_schedule(*drawn)


def _replica(case):
    planner = case.planner(limit_for(case))
    layout = planner.layout(case.batch)
    works = layout.replicas[0].works
    subs = tuple(s for w in works for s in w.submicrobatches)
    deps = tuple(d for w in works for d in w.dependencies)
    dataflow = Dataflow(planner.placement, subs, deps)
    graph = planner.stage_graph(
        dataflow, {s.work: s for s in subs}, planner.uniform_choice(), forward_only=False
    )
    return planner, layout, dataflow, graph


@settings(max_examples=max(12, settings.default.max_examples // 20), deadline=None)
@given(cases(), st.integers(0, 3))
def test_compiled_list_scheduler_matches_the_reference_on_planner_graphs(case, seed) -> None:
    planner, _, dataflow, graph = _replica(case)
    feeds = {m.name: m.feeds for m in planner.model.modules}
    cons = unit_constraints(planner._units(dataflow), feeds, lookahead=case.lookahead)
    order = _rollout([], cons, random.Random(seed), 0.5)
    for units in (cons.units, order):
        priority = priorities_from_units(graph.stages, units)
        assert unit_priority_ranks(graph, units).tolist() == priority_ranks(priority).tolist()
        limits = planner.scheduling_limits
        for fill in (True, False):
            _same_schedule(graph, priority, limits, fill)


def _same_execution(programs, **kwargs) -> None:
    """Both engines time `programs` alike, waits per operation (the simulator's) and for
    whole batches (the runtime's, which the deadlock check uses)."""
    for whole_batches in (False, True):
        want = reference_execute_programs(programs, whole_batches=whole_batches, **kwargs)
        got = execute_programs(programs, whole_batches=whole_batches, **kwargs)
        assert (got.finish, got.spans, got.waits) == (want.finish, want.spans, want.waits)
        assert list(got.op_complete.items()) == list(want.op_complete.items())


def _errors_alike(programs) -> None:
    """Both engines reject `programs` with the same message (or both accept them)."""
    messages = []
    for run in (reference_execute_programs, execute_programs):
        try:
            run(programs)
            messages.append(None)
        except PlanError as err:
            messages.append((type(err), str(err)))
    assert messages[0] == messages[1]


@settings(max_examples=max(12, settings.default.max_examples // 20), deadline=None)
@given(cases(), st.randoms(use_true_random=False))
def test_engine_matches_the_reference_on_planner_plans(case, rnd) -> None:
    planner = case.planner(limit_for(case))
    try:
        replicas = planner.plan_batch(case.batch)
    except MemoryLimitError:
        return  # an infeasible limit: no plan to execute
    for rp in replicas:
        plan = rp.plan
        cost = case.cost_model()

        def duration(rank, ins, plan=plan, cost=cost):
            chunk = plan.placement.module(ins.stage.module).chunks[ins.stage.chunk]
            c = cost.stage_cost(
                chunk,
                plan.submicrobatch(ins.stage.work),
                ins.memory if isinstance(ins, Forward) else NO_RECOMPUTE,
            )
            return c.forward if isinstance(ins, Forward) else c.backward

        def transfer(send: Send, cost=cost) -> float:
            return cost.transfer_time(sum(t.nbytes for t in send.tensors))

        _same_execution(plan.programs)
        for channel_kw in ({}, {"channel": per_peer_channel}):
            _same_execution(
                plan.programs,
                compute_time=duration,
                transfer_time=transfer,
                post_overhead=1e-6,
                **channel_kw,
            )
        assert simulate(plan, cost).iteration_time > 0
        # Broken programs: an instruction dropped or two swapped on one rank.
        programs = list(plan.programs)
        r = rnd.randrange(len(programs))
        instrs = list(programs[r].instructions)
        if len(instrs) >= 2:
            i = rnd.randrange(len(instrs) - 1)
            if rnd.random() < 0.5:
                del instrs[i]
            else:
                instrs[i], instrs[i + 1] = instrs[i + 1], instrs[i]
            programs[r] = Program(r, tuple(instrs))
            _errors_alike(programs)


def test_without_numba_the_scheduler_runs_interpreted_with_the_same_result() -> None:
    """numba is optional: without it the kernel's own code runs as Python, same orders/times."""
    import json
    import subprocess
    import sys

    script = (
        "import sys, json\n"
        "sys.modules['numba'] = None\n"
        "from megatron_dip.planner import schedule_kernel\n"
        "assert not schedule_kernel.COMPILED\n"
        "from test_fast_paths import _chain_schedule\n"
        "print(json.dumps(_chain_schedule()))\n"
    )
    import os
    from pathlib import Path

    tests = Path(__file__).parent
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(  # noqa: PLW1510 (checked below, with its stderr)
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == _chain_schedule()
    assert "numba is not installed" in out.stderr


def _chain_schedule() -> list:
    """A 2-rank pipeline of 6 stages with a binding memory limit: (order, makespan, peaks)."""
    n, ranks = 6, 2
    succ = [[] for _ in range(2 * n)]
    npred = [0] * (2 * n)
    for k in range(n):
        succ[2 * k].append((2 * k + 1, 0.0))
        npred[2 * k + 1] += 1
    for k in range(0, n, 2):  # stage k on rank 0 feeds stage k + 1 on rank 1
        succ[2 * k].append((2 * (k + 1), 0.1))
        npred[2 * (k + 1)] += 1
        succ[2 * (k + 1) + 1].append((2 * k + 1, 0.1))
        npred[2 * k + 1] += 1
    stages = [StageId("m", k, 0) for k in range(n)]
    graph = StageGraph(
        stages,
        [k % 2 for k in range(n)],
        [1.0, 2.0] * 3,
        [2.0, 3.0] * 3,
        [1, 2] * 3,
        [True] * n,
        succ,
        npred,
        ranks,
    )
    sched = list_schedule(graph, priority=[(k,) for k in range(n)], memory_limit=[2.0, 3.0])
    orders = [[f"{type(i).__name__} {i.stage}" for i in o] for o in sched.orders]
    return [orders, sched.makespan, list(sched.peak_memory)]


def test_warm_up_compiles_the_kernel_for_the_argument_types_of_real_plans(monkeypatch) -> None:
    """Rank 0 warms the kernel up on a thread so that a fallback plan does not compile it
    (training/iteration/planning): the warm-up's arguments must have the types of the planner's
    own calls, memory limits, split backwards and data-parallel reductions included, or numba
    compiles a second specialization inside the plan after all."""
    if not schedule_kernel.COMPILED:
        pytest.skip("numba is not installed: nothing is compiled")
    import numba

    seen: dict[str, set] = {"warm-up": set(), "plans": set()}
    phase = ["warm-up"]
    kernel = list_scheduler.run_schedule

    def recording(*args):
        seen[phase[0]].add(tuple(str(numba.typeof(a)) for a in args))
        return kernel(*args)

    monkeypatch.setattr(list_scheduler, "run_schedule", recording)
    list_scheduler.warm_up()
    phase[0] = "plans"
    case = dataclasses.replace(fixed_cases()[1], search=False)
    planner = case.planner(limit_for(case))
    planner.config = dataclasses.replace(planner.config, split_backward=True)
    plans = planner.plan_batch(case.batch)
    assert any(p.plan.programs for p in plans)
    assert len(seen["warm-up"]) == 1 and seen["plans"] == seen["warm-up"]
