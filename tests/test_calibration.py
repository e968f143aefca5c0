"""In-run cost-model calibration: window aggregation, frozen mode, determinism, checkpoint state,
and the calibrated cost model reaching both the inline planner and the planner service."""

from __future__ import annotations

import functools
import json
import types

import pytest
from test_planner_service import _client, _wait_ready, batch, make_planner, store_address  # noqa: F401

from megatron_dip.planner.calibration import Calibration, model_error
from megatron_dip.planner.service import (
    SEARCHED,
    PlannerService,
    publish_calibration,
    read_calibration,
)
from megatron_dip.planner.simulator import simulate
from megatron_dip.schedule.engine import per_peer_channel
from megatron_dip.schedule.ir import Backward, Forward
from megatron_dip.schedule.serialize import plan_to_bytes

# -- aggregation ---------------------------------------------------------------------------------


def test_window_sums_then_sets_measured_over_predicted():
    c = Calibration(window=3)
    rows = [({"vit": 2.0, "llm": 9.0}, {"vit": 1.0, "llm": 1.0}),
            ({"vit": 6.0, "llm": 3.0}, {"vit": 1.0, "llm": 2.0}),
            ({"vit": 4.0}, {"vit": 2.0, "llm": 0.0})]  # fmt: skip
    assert [c.observe(m, p) for m, p in rows[:2]] == [False, False]
    assert c.scales == {} and c.version == 0 and c.count == 2
    assert c.observe(*rows[2]) is True
    # sums over the window, not a mean of per-iteration ratios (that would give vit 2.667)
    assert c.scales == {"vit": 12.0 / 4.0, "llm": 12.0 / 3.0}
    assert c.version == 1 and c.count == 0 and c.measured_sum == {}
    # next window: a module that did not run keeps its factor
    for _ in range(3):
        c.observe({"vit": 1.0}, {"vit": 1.0})
    assert c.scales == {"vit": 1.0, "llm": 4.0} and c.version == 2


def test_frozen_never_changes_and_bad_input_is_refused():
    c = Calibration(window=1, frozen=True)
    c.load_state_dict({"scales": {"vit": 2.0}, "version": 3})
    before = c.state_dict()
    for _ in range(5):
        assert c.observe({"vit": 50.0}, {"vit": 1.0}) is False
    assert c.state_dict() == before
    with pytest.raises(ValueError, match="--dip-calibration-window"):
        Calibration(window=0)
    with pytest.raises(ValueError, match="non-positive"):
        Calibration().load_state_dict({"scales": {"vit": 0.0}})


def test_error_is_the_calibrated_miss_over_measured():
    measured, predicted = {"vit": 3.0, "llm": 1.0}, {"vit": 1.0, "llm": 1.0}
    assert model_error(measured, predicted, {}) == pytest.approx((2.0 + 0.0) / 4.0)
    assert model_error(measured, predicted, {"vit": 3.0}) == 0.0
    assert model_error({}, predicted, {}) is None
    c = Calibration(scales={"vit": 6.0})
    assert c.ratio(measured, predicted) == pytest.approx(7.0 / 4.0)  # over-predicts 1.75x
    assert c.error(measured, predicted) == pytest.approx(3.0 / 4.0)
    assert c.ratio({}, predicted) is None


def test_state_round_trips_through_json_and_resumes_identically():
    """A checkpoint mid-window: the resumed calibration updates at the same iteration to the
    same bits as the uninterrupted one (old checkpoints with only scales still load)."""
    rows = [
        ({"vit": 0.1 * (i + 1), "llm": 1.0 / (i + 3)}, {"vit": 0.01, "llm": 0.003})
        for i in range(7)
    ]
    full = Calibration(window=4)
    for m, p in rows[:3]:
        full.observe(m, p)
    resumed = Calibration(window=4)
    resumed.load_state_dict(json.loads(json.dumps(full.state_dict())))
    assert resumed == full
    for m, p in rows[3:]:
        assert full.observe(m, p) == resumed.observe(m, p)
    assert full.state_dict() == resumed.state_dict() and full.version == 1
    old = Calibration()
    old.load_state_dict({"scales": {"vit": 2.5}})
    assert (old.version, old.scales, old.count) == (1, {"vit": 2.5}, 0)


# -- the calibrated cost model ---------------------------------------------------------------------


def _ops(plan, scale_of, *, tuples: bool = False):
    """Fake executor timings of every compute instruction of `plan`: the cost model's time times
    a per-module 'machine' factor, with a deterministic +-20% wobble per instruction."""
    cost = make_planner().cost_model
    out = []
    for program in plan.programs:
        for n, ins in enumerate(program.instructions):
            if not isinstance(ins, (Forward, Backward)):
                continue
            chunk = plan.placement.module(ins.stage.module).chunks[ins.stage.chunk]
            c = cost.stage_cost(chunk, plan.submicrobatch(ins.stage.work))
            t = c.forward if isinstance(ins, Forward) else c.backward
            t *= scale_of[ins.stage.module] * (1.0 + 0.2 * ((-1) ** n))
            fwd = isinstance(ins, Forward)
            out.append((ins.stage.module, fwd, t, ins.stage) if tuples else (ins, t))
    return out


def test_calibrated_cost_model_predicts_what_was_measured():
    from megatron_dip.training.iteration.metrics import measured_ops, predicted_ops

    machine = {"vit": 300.0, "llm": 40.0}  # e.g. a CPU against the H100 data sheet
    cost = make_planner().cost_model
    c = Calibration(window=3)
    errors = []
    for it in range(6):
        plan = make_planner().plan_batch(batch(it), search=False)[0].plan
        ops = _ops(plan, machine)
        measured, predicted = measured_ops(ops), predicted_ops(plan, cost, ops)
        # both executor timing formats are understood
        tuples = _ops(plan, machine, tuples=True)
        assert measured_ops(tuples) == measured and predicted_ops(plan, cost, tuples) == predicted
        # the error's shortcut (scale * uncalibrated prediction) is what the calibrated model says
        calibrated = predicted_ops(plan, c.apply(cost), ops)
        direct = sum(abs(calibrated[m] - measured[m]) for m in measured) / sum(measured.values())
        assert c.error(measured, predicted) == pytest.approx(direct, rel=1e-9)
        errors.append(c.error(measured, predicted))
        c.observe(measured, predicted)
    assert c.version == 2 and c.scales == pytest.approx(machine, rel=0.1)
    assert min(errors[:3]) > 0.95 and max(errors[3:]) < 0.1, errors


def test_calibrated_plans_are_faster_on_the_measured_machine():
    """Where compute dominates, plans made with the calibrated model simulate faster under the
    measured costs than plans made with the data-sheet model (the point of calibrating)."""
    truth = {"vit": 800.0, "llm": 100.0}
    blind, informed = make_planner(), make_planner()
    informed.cost_model = informed.cost_model.calibrated(truth)

    def total(planner) -> float:
        plans = [planner.plan_batch(batch(it), search=False)[0].plan for it in range(3)]
        return sum(
            simulate(p, informed.cost_model, channel=per_peer_channel).iteration_time for p in plans
        )

    assert total(informed) < 0.97 * total(blind)


# -- inline planning (DipPlans) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_spec():
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.data_source import make_stream
    from megatron_dip.training.config.validate import resolve

    argv = ["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1e-3", "--dip-lookahead", "0",
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]  # fmt: skip
    spec = resolve(parse_config(argv), world_size=2, cuda=False)
    t = spec.training
    stream = make_stream(
        spec.data,
        spec.model,
        seed=t.seed,
        global_batch_size=t.global_batch_size,
        limits=spec.limits,
        evaluation=False,
    )
    return spec, [next(stream) for _ in range(3)]


def test_inline_plans_deterministic_and_follow_the_calibration(run_spec):
    from megatron_dip.training.iteration.planning import DipPlans, replica_plan
    from megatron_dip.training.iteration.planning import make_planner as spec_planner

    spec, batches = run_spec
    ctx = types.SimpleNamespace(rank=0, dp_rank=0)
    a, b = DipPlans(spec, ctx), DipPlans(spec, ctx)
    plain = [plan_to_bytes(a.plan(x)[0]) for x in batches]
    assert plain == [plan_to_bytes(b.plan(x)[0]) for x in batches]  # uncalibrated: identical
    assert a.plan_calibration == 0
    scales = {"vit": 900.0, "llm": 60.0}
    a.calibrate(version=4, scales=scales)
    reference = spec_planner(spec)
    reference.cost_model = spec.cost_model.calibrated(scales)
    calibrated = [plan_to_bytes(a.plan(x)[0]) for x in batches]
    assert calibrated == [plan_to_bytes(replica_plan(reference, x, 0).plan) for x in batches]
    assert calibrated != plain and a.plan_calibration == 4
    assert spec.cost_model._scale == {}  # the loaded cost model itself is never modified


# -- the planner service -----------------------------------------------------------------------------


def test_service_plans_with_the_newest_calibration_and_tags_it(store_address):  # noqa: F811
    address, master = store_address
    scales = {"vit": 700.0, "llm": 90.0}
    service = PlannerService(functools.partial(make_planner, rollouts=4), address, lookahead=2)
    try:
        service.submit(batch(0))
        _wait_ready(master, 0, SEARCHED)
        publish_calibration(master, version=1, scales=scales)
        assert read_calibration(master) == (1, scales)
        service.submit(batch(1))
        _wait_ready(master, 1, SEARCHED)
        rank = _client(address)
        # Planned before the ranks moved to version 1: still the plan every rank runs, tagged 0.
        old, _ = rank.fetch(0, inline=lambda: pytest.fail("planned ahead"))
        assert rank.plan_calibration == 0
        assert plan_to_bytes(old) == plan_to_bytes(
            make_planner(rollouts=4).plan_batch(batch(0))[0].plan
        )
        new, _ = rank.fetch(1, inline=lambda: pytest.fail("planned ahead"))
        assert rank.plan_calibration == 1
        reference = make_planner(rollouts=4)
        reference.cost_model = reference.cost_model.calibrated(scales)
        assert plan_to_bytes(new) == plan_to_bytes(reference.plan_batch(batch(1))[0].plan)
        blind = make_planner(rollouts=4).plan_batch(batch(1))[0].plan
        assert plan_to_bytes(new) != plan_to_bytes(blind)
        rank.cleanup(1, num_replicas=1)
        assert not master.check(["dip/1/searched/calibration"])
    finally:
        service.close()


def test_log_line_shows_the_interval_error_and_version():
    from megatron_dip.training.iteration.log import IntervalLog, IterationRecord

    log = IntervalLog(train_iters=10, world_size=2, global_batch=4)
    for it, error in ((1, 0.9), (2, 0.3), (3, None)):
        log.add(
            IterationRecord(
                iteration=it,
                loss=4.0,
                lr=1e-3,
                grad_norm=None,
                seconds=0.5,
                schedule_seconds=0.4,
                samples=4,
                consumed=4 * it,
                tokens=100,
                flops=1e9,
                bound_efficiency=0.8,
                variant="inline",
                cost_error=error,
                calibration_version=3,
            )
        )
    assert "cost-model error: 60.0% (calibration v3)" in log.line()
    log.add(
        IterationRecord(
            iteration=4,
            loss=4.0,
            lr=1e-3,
            grad_norm=None,
            seconds=0.5,
            schedule_seconds=0.4,
            samples=4,
            consumed=16,
            tokens=100,
            flops=1e9,
            bound_efficiency=0.8,
            variant="inline",
        )
    )
    assert "cost-model error: n/a (calibration v0)" in log.line()


def test_predicted_ops_price_a_split_backward_as_its_halves():
    """A split plan's B and W are predicted as `backward_input` and `weight`: together the
    fused backward, so measured / predicted compares like with like."""
    from dataclasses import replace

    from megatron_dip.schedule.backward_split import split_backwards
    from megatron_dip.schedule.ir import BackwardWeight
    from megatron_dip.training.iteration.metrics import predicted_ops

    cost = make_planner().cost_model
    plan = make_planner().plan_batch(batch(0), search=False)[0].plan
    split = replace(plan, programs=split_backwards(plan))

    def ops(p):
        kinds = (Forward, Backward, BackwardWeight)
        return [(i, 1.0) for prog in p.programs for i in prog.instructions if isinstance(i, kinds)]

    assert any(isinstance(i, BackwardWeight) for i, _ in ops(split))
    fused, halves = predicted_ops(plan, cost, ops(plan)), predicted_ops(split, cost, ops(split))
    assert halves.keys() == fused.keys()
    assert all(halves[m] == pytest.approx(fused[m], rel=1e-9) for m in fused)
