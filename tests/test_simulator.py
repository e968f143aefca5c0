"""The simulator against the Megatron paper's bubble formulas, memory counts and trace export."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.cost_model import CostModel, StageCost
from megatron_dip.planner.devices import H100
from megatron_dip.planner.simulator import UniformCost, activation_peaks, message_peaks, simulate
from megatron_dip.planner.trace import write_chrome_trace
from megatron_dip.schedule.baselines import build_1f1b_plan, build_interleaved_plan
from megatron_dip.schedule.engine import DeadlockError
from megatron_dip.schedule.ir import (
    Backward,
    BatchTotals,
    ChunkSpec,
    Forward,
    MessageKey,
    MessageKind,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Plan,
    Program,
    Recv,
    Send,
    StageId,
    SubMicrobatch,
    TensorSpec,
    Wait,
)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16), (3, 9)])
def test_1f1b_bubble_matches_megatron_formula(p: int, m: int) -> None:
    # Backward = 2x forward: 1F1B's formula does not depend on the ratio.
    result = simulate(build_1f1b_plan(num_ranks=p, num_microbatches=m), UniformCost(1.0, 2.0))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert result.iteration_time == pytest.approx((m + p - 1) * 3.0)
    assert result.busy == pytest.approx([3.0 * m] * p)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 16), (3, 2, 6)])
def test_interleaved_bubble_matches_megatron_formula(p: int, v: int, m: int) -> None:
    # Exact when backward == forward. With backward = 2x forward the communication-free timing
    # still meets the formula, but Megatron's blocking batched p2p couples neighbours' steps.
    plan = build_interleaved_plan(num_ranks=p, num_model_chunks=v, num_microbatches=m)
    equal = simulate(plan, UniformCost(1.0, 1.0))
    assert equal.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert equal.iteration_time == pytest.approx((v * m + p - 1) * 2.0)
    skewed = simulate(plan, UniformCost(1.0, 2.0))
    assert skewed.iteration_time >= (v * m + p - 1) * 3.0 - 1e-9


def test_1f1b_memory_peak_counts_inflight_microbatches() -> None:
    for p, m in [(4, 8), (4, 2), (6, 6)]:
        plan = build_1f1b_plan(num_ranks=p, num_microbatches=m)
        r = simulate(plan, UniformCost(1.0, 2.0, 1000))
        # each stage's 1000 bytes, and a few of the baseline's 4-byte message buffers
        buffers = [peak - 1000 * min(p - k, m) for k, peak in enumerate(r.peak_activation_bytes)]
        assert all(0 <= b <= 4 * 3 for b in buffers), buffers
        assert r.peak_activation_bytes == activation_peaks(plan, UniformCost(1.0, 2.0, 1000))
        assert all(steps[-1][1] == 0 for steps in r.memory_timeline)  # everything released


def test_message_buffers_are_held_from_post_to_their_use() -> None:
    """A received tensor from its receive's post to the end of the compute consuming it (then
    it is that compute's stored input), a sent one until the wait that releases it."""
    plan = _two_rank_plan(deadlock=False)  # messages of 2048 bytes, 5 bytes per stage
    cost = UniformCost(1.0, 2.0, 5)
    # rank 0: F0 +5, send +2048, wait -2048, recv +2048, B0 -2053
    # rank 1: recv +2048 (from the start), F1 +5 -2048, B1 -5, send +2048, wait -2048
    assert message_peaks(plan) == (2048, 2048)
    assert activation_peaks(plan, cost) == (2053, 2048)
    r = simulate(plan, cost)
    assert r.peak_activation_bytes == (2053, 2048)
    f1_end = 1.0 + 1.0  # F0, the activation (no transfer time), F1
    assert r.memory_timeline[1][:2] == ((0.0, 2048), (f1_end, 5))
    assert all(steps[-1][1] == 0 for steps in r.memory_timeline)


def test_message_latency_is_paid_per_message() -> None:
    one = build_1f1b_plan(num_ranks=4, num_microbatches=8)
    inter = build_interleaved_plan(num_ranks=4, num_model_chunks=2, num_microbatches=8)
    cost = UniformCost(1.0, 2.0)
    assert inter.num_ranks == one.num_ranks
    r1, ri = simulate(one, cost), simulate(inter, cost)
    assert ri.num_messages > r1.num_messages
    slow1 = simulate(one, cost, message_latency=0.1)
    slowi = simulate(inter, cost, message_latency=0.1)
    assert slow1.iteration_time > r1.iteration_time
    assert slowi.iteration_time - ri.iteration_time > slow1.iteration_time - r1.iteration_time


@st.composite
def _baseline(draw: st.DrawFn) -> tuple:
    p = draw(st.integers(1, 6))
    v = draw(st.integers(1, 3)) if p > 1 else 1  # one rank runs no_pipelining: no chunking
    m = p * draw(st.integers(1, 3)) if v > 1 else draw(st.integers(1, 12))
    costs = draw(st.lists(st.floats(0.1, 5.0), min_size=2 * p * v, max_size=2 * p * v))
    return p, v, m, costs, draw(st.floats(0.0, 0.5))


class _PerChunkCost:
    def __init__(self, costs: list[float], latency: float) -> None:
        self.costs, self.latency = costs, latency

    def stage_cost(
        self, chunk: ChunkSpec, sub: SubMicrobatch, recompute: object = None, layers: int = 0
    ) -> StageCost:
        return StageCost(self.costs[2 * chunk.index], self.costs[2 * chunk.index + 1], 1)

    def transfer_time(self, nbytes: int) -> float:
        return self.latency


@given(_baseline())
def test_simulated_time_never_beats_the_lower_bound(case: tuple) -> None:
    p, v, m, costs, latency = case
    if v == 1:
        plan = build_1f1b_plan(num_ranks=p, num_microbatches=m)
    else:
        plan = build_interleaved_plan(num_ranks=p, num_model_chunks=v, num_microbatches=m)
    r = simulate(plan, _PerChunkCost(costs, latency), message_latency=latency / 2)
    expected_busy = [
        m * sum(costs[2 * c] + costs[2 * c + 1] for c in range(r_, p * v, p)) for r_ in range(p)
    ]
    assert r.busy == pytest.approx(expected_busy)
    assert r.iteration_time >= r.lower_bound - 1e-9
    assert r.lower_bound == pytest.approx(max(expected_busy))
    assert 0.0 <= r.bubble_fraction < 1.0
    assert r.bound_efficiency <= 1.0 + 1e-12
    assert all(i >= -1e-9 for i in r.idle)


def _two_rank_plan(*, deadlock: bool) -> Plan:
    """Chunk 0 on rank 0, chunk 1 on rank 1, one microbatch, written by hand."""
    chunks = (ChunkSpec("m", 0, 0, 0, 1), ChunkSpec("m", 1, 1, 1, 2))
    placement = Placement(2, (ModuleLayout("m", 2, True, chunks),))
    s0, s1 = StageId("m", 0, 0), StageId("m", 1, 0)
    act, grad = MessageKey(MessageKind.ACTIVATION, s0, s1), MessageKey(MessageKind.GRADIENT, s0, s1)
    t = (TensorSpec("hidden", (1024,), "bfloat16"),)
    rank0 = [
        Forward(s0),
        Send(act, 1, t),
        Wait((act,)),
        Recv(grad, 1, t),
        Wait((grad,)),
        Backward(s0),
    ]
    rank1 = [
        Recv(act, 0, t),
        Wait((act,)),
        Forward(s1),
        Backward(s1),
        Send(grad, 0, t),
        Wait((grad,)),
    ]
    if deadlock:  # rank 1 waits for a gradient before sending the activation rank 0 waits for
        rank0 = [
            Recv(grad, 1, t),
            Wait((grad,)),
            Forward(s0),
            Send(act, 1, t),
            Wait((act,)),
            Backward(s0),
        ]
    return Plan(
        iteration=0,
        placement=placement,
        microbatches=(MicrobatchInfo(0, (0,), 8),),
        submicrobatches=(SubMicrobatch("m", 0, 0, 0, 1, 8, 8),),
        dependencies=(),
        totals=BatchTotals(1, 1, 8),
        programs=(Program(0, tuple(rank0)), Program(1, tuple(rank1))),
    )


def test_transfers_use_tensor_bytes_and_latency() -> None:
    class Linear(UniformCost):
        def transfer_time(self, nbytes: int) -> float:
            return nbytes * 1e-3

    r = simulate(_two_rank_plan(deadlock=False), Linear(1.0, 2.0), message_latency=0.5)
    # F0, activation (2048 bytes -> 2.048 + 0.5), F1, B1, gradient, B0
    assert r.iteration_time == pytest.approx(1 + 2.548 + 1 + 2 + 2.548 + 2)
    assert r.num_messages == 2
    with pytest.raises(DeadlockError, match="rank 0"):
        simulate(_two_rank_plan(deadlock=True), UniformCost())


def test_real_cost_model_and_chrome_trace(tmp_path) -> None:
    setup = PAPER_SETUPS["vlm-s"]
    model = CostModel(setup.model, H100, shape=ParallelShape(tp=4))

    class AsLlm:  # the baseline's one-layer chunks priced as Llama3-8B layers
        def stage_cost(
            self, chunk: ChunkSpec, sub: SubMicrobatch, memory: object = None
        ) -> StageCost:
            c = ChunkSpec("llm", chunk.index, chunk.rank, 8, 9)
            return model.stage_cost(c, SubMicrobatch("llm", sub.microbatch, 0, 0, 1, 8192, 8192))

        def transfer_time(self, nbytes: int) -> float:
            return model.transfer_time(nbytes)

    t = lambda key: (TensorSpec("hidden", (8192, 4096), "bfloat16"),)  # noqa: E731
    plan = build_1f1b_plan(num_ranks=4, num_microbatches=8, tensors=t)
    layer = AsLlm().stage_cost(plan.placement.modules[0].chunks[0], plan.submicrobatches[0])
    assert 0.4 * 2**30 < layer.activation_bytes < 0.7 * 2**30  # one Llama3-8B layer, 8k, TP4
    r = simulate(plan, AsLlm(), memory_limit_bytes=int(2.5 * layer.activation_bytes))
    assert r.iteration_time > 11 * (layer.forward + layer.backward)  # transfers are not free
    assert r.ranks_over_memory == (0, 1)  # 4 and 3 in-flight microbatches, not 2 and 1
    path = write_chrome_trace(r, tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 4 * 8 * 2
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    first = min((e for e in spans if e["pid"] == 0), key=lambda e: e["ts"])
    assert first["name"] == "F model0 mb0.0" and first["cat"] == "fwd"
    assert first["dur"] == pytest.approx(layer.forward * 1e6)
    measured = [[("F model0 mb0.0", "model", True, 0.0, 0.01)] for _ in range(4)]
    both = json.loads(
        write_chrome_trace((plan, r.execution), tmp_path / "b.json", measured=measured).read_text()
    )
    names = {
        e["args"]["name"]
        for e in both["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert "planned rank 0" in names and "measured rank 3" in names


def test_gap_decomposition_of_1f1b_is_fill_and_drain() -> None:
    """1F1B with F = 1, B = 2 on P = 4 ranks, 8 microbatches: every rank's gap to the balanced
    bound (8 x 3 s) is the textbook bubble (P - 1)(F + B) = 9 s, all of it before its first
    backward (rank r: (P - 1) B - r F) or after its last forward;
    no steady-state idle, imbalance or overhead; messages that take time cost time."""
    from megatron_dip.planner.gap import decompose_gap, format_gap
    from megatron_dip.schedule.engine import single_channel

    p, m = 4, 8
    plan = build_1f1b_plan(num_ranks=p, num_microbatches=m)
    cost = UniformCost(1.0, 2.0)
    module = plan.placement.modules[0].name
    gap = decompose_gap(
        plan,
        simulate(plan, cost),
        cost,
        m * 3.0,
        single_channel,
        {module: m * 3.0 - 1.0},
        whole=plan.submicrobatches,
    )
    assert gap.granularity_by_module == {module: pytest.approx(1.0)}
    # every rank computes its m forwards and backwards, all of them whole (no recompute, host)
    for c in gap.compute:
        assert c.whole == c.plain == c.recomputed == c.busy == pytest.approx(m * 3.0)
        assert c.shares(gap.bound) == {
            "whole": pytest.approx(1.0), "granularity": 0.0, "recompute": 0.0, "host": 0.0
        }  # fmt: skip
    assert gap.makespan == pytest.approx((m + p - 1) * 3.0)
    for r, row in enumerate(gap.ranks):
        assert row.total == pytest.approx(gap.makespan - gap.bound)
        assert row.fill == pytest.approx((p - 1) * 2.0 - r * 1.0)
        assert row.fill + row.drain == pytest.approx((p - 1) * 3.0)
        assert row.steady == row.imbalance == row.reduction == row.overhead == 0.0
    table = format_gap("1f1b", gap)
    assert gap.free_communication == 0.0 and "fill +18.8%" in table
    assert (
        "   3  whole 100.0%  granularity +0.0%  recompute +0.0%  host +0.0%  busy 100.0%" in table
    )
    slow = UniformCost(1.0, 2.0, transfer=0.5)
    gap = decompose_gap(plan, simulate(plan, slow), slow, m * 3.0, single_channel)
    assert gap.free_communication == pytest.approx(gap.makespan - (m + p - 1) * 3.0)
    assert all(row.total == pytest.approx(gap.makespan - gap.bound) for row in gap.ranks)
