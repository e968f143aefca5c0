"""Host overheads (planner/overheads.py): the file format, and where they are charged — the
simulator, the planner's stage graph, the emulated prediction — and where not (stage costs,
emulated sleeps)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import H100
from megatron_dip.planner.overheads import (
    NO_OVERHEADS,
    HostOverheads,
    OverheadsFile,
    host_overheads,
    load_overheads,
    save_overheads,
)
from megatron_dip.planner.simulator import UniformCost, simulate
from megatron_dip.schedule.baselines import build_1f1b_plan, build_interleaved_plan
from megatron_dip.schedule.ir import ChunkSpec, Forward, SubMicrobatch


@dataclasses.dataclass(frozen=True)
class _HostCost(UniformCost):
    """Uniform stage costs plus host overheads."""

    overheads: HostOverheads = NO_OVERHEADS


def test_overheads_are_validated_and_round_trip_through_their_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="'batch' must be a finite number >= 0"):
        HostOverheads(batch=-1e-3)
    with pytest.raises(ValueError, match="'message'"):
        HostOverheads(message=float("nan"))
    o = HostOverheads(2e-3, 1e-3, 5e-4)
    assert o.scaled(0.5) == HostOverheads(1e-3, 5e-4, 2.5e-4) and not o.is_zero
    assert o.instruction_times(1.0, 2.0) == (1.002, 2.002)
    assert o.per_pass(4) == pytest.approx(4 * 3e-3)
    written = OverheadsFile(o, HostOverheads(1e-4, 0.0, 0.0), {"ranks": 4})
    save_overheads(tmp_path / "o.json", written)
    assert load_overheads(tmp_path / "o.json") == written


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        ('{"format": "megatron-dip-profile/1"}', "not a megatron-dip-host-overheads/1 file"),
        ('{"format": "megatron-dip-host-overheads/1", "dip": {"launch": 1}}', "'dip' must map"),
        ('{"format": "megatron-dip-host-overheads/1", "dip": {"batch": -1}}', "'batch'"),
    ],
)
def test_a_bad_overheads_file_is_refused_naming_the_file(tmp_path, content, match) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        load_overheads(path)
    assert str(path) in str(err.value)


def test_per_instruction_overhead_flips_interleaved_versus_1f1b_by_hand() -> None:
    """P=2, M=4, equal forward and backward. Interleaved (V=2) halves each chunk's time
    (f = b = 1) against 1F1B's whole stages (f = b = 2). Megatron's formulas, every compute
    instruction taking h more:
        1F1B:        (M + P - 1) * (f + b) = 5 * (4 + 2h) = 20 + 10h
        interleaved: (V M + P - 1) * (f + b) = 9 * (2 + 2h) = 18 + 18h
    Without overhead interleaved wins (18 < 20); from h = 0.25 on 1F1B does (h = 0.5: 25 < 27)."""
    one = build_1f1b_plan(num_ranks=2, num_microbatches=4)
    inter = build_interleaved_plan(num_ranks=2, num_model_chunks=2, num_microbatches=4)
    for h, want_1f1b, want_inter in ((0.0, 20.0, 18.0), (0.5, 25.0, 27.0), (0.25, 22.5, 22.5)):
        host = HostOverheads(instruction=h)
        t1 = simulate(one, _HostCost(2.0, 2.0, overheads=host)).iteration_time
        ti = simulate(inter, _HostCost(1.0, 1.0, overheads=host)).iteration_time
        assert (t1, ti) == pytest.approx((want_1f1b, want_inter))


def test_batch_and_message_overheads_default_from_the_cost_model() -> None:
    plan = build_1f1b_plan(num_ranks=2, num_microbatches=2)
    host = HostOverheads(batch=0.1, message=0.3)
    charged = simulate(plan, _HostCost(1.0, 2.0, overheads=host)).iteration_time
    explicit = simulate(
        plan, UniformCost(1.0, 2.0), post_overhead=0.1, message_latency=0.3
    ).iteration_time
    assert charged == pytest.approx(explicit)
    assert charged > simulate(plan, UniformCost(1.0, 2.0)).iteration_time
    # An explicit argument wins over the cost model's term.
    assert simulate(
        plan, _HostCost(1.0, 2.0, overheads=host), post_overhead=0.0, message_latency=0.0
    ).iteration_time == pytest.approx(simulate(plan, UniformCost(1.0, 2.0)).iteration_time)


def test_stage_cost_stays_compute_only_and_the_copy_keeps_caches() -> None:
    setup = PAPER_SETUPS["vlm-s"]
    base = CostModel(setup.model, H100, shape=ParallelShape(tp=4))
    host = HostOverheads(1e-3, 2e-3, 3e-3)
    charged = base.with_overheads(host)
    chunk, sub = ChunkSpec("llm", 0, 0, 0, 8), SubMicrobatch("llm", 0, 0, 0, 1, 4096, 4096)
    assert charged.stage_cost(chunk, sub) == base.stage_cost(chunk, sub)
    assert host_overheads(charged) is host and host_overheads(base).is_zero
    assert host_overheads(UniformCost()) is NO_OVERHEADS  # stand-ins carry none
    eff = base.efficiency("vit", instances=4, tokens_per_instance=1024)
    slower = base.efficiency("vit", instances=4, tokens_per_instance=1024, host_seconds=1e-3)
    assert 0 < slower < eff


def test_the_planner_sees_the_instruction_overhead_in_its_durations() -> None:
    """The list scheduler's duration of every compute instruction is its stage cost plus the
    per-instruction host time (what the communication pass and the search score with)."""
    from megatron_dip.benchmark.bench import first_batches, resolve_run
    from megatron_dip.planner.dip import DipPlanner

    spec = resolve_run(_TINY, world_size=2)
    h = 1e-3
    batch = first_batches(spec, 1)[0]
    cost = spec.cost_model.with_overheads(HostOverheads(instruction=h))
    planner = DipPlanner(spec.model, cost, spec.placement, spec.planner)
    layout = planner.layout(batch)
    works = layout.replicas[0].works
    from megatron_dip.schedule.graph import Dataflow

    subs = tuple(s for w in works for s in w.submicrobatches)
    deps = tuple(d for w in works for d in w.dependencies)
    sub_of = {s.work: s for s in subs}
    graph = planner.stage_graph(
        Dataflow(spec.placement, subs, deps), sub_of, planner.uniform_choice(), forward_only=False
    )
    for k, stage in enumerate(graph.stages):
        chunk = spec.placement.module(stage.module).chunks[stage.chunk]
        c = spec.cost_model.stage_cost(chunk, sub_of[stage.work])
        assert graph.fwd_time[k] == pytest.approx(c.forward + h)
        assert graph.bwd_time[k] == pytest.approx(c.backward + h)
    plan = planner.plan_layout(layout, 0).plan
    plain = simulate(plan, spec.cost_model).iteration_time
    busiest = max(sum(isinstance(i, Forward) for i in p.instructions) for p in plan.programs)
    assert simulate(plan, cost).iteration_time >= plain + h * busiest  # forwards alone


_TINY = [
    "--dip-emulate-compute", "--model", "tiny-vlm", "--pipeline-model-parallel-size", "2",
    "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
]  # fmt: skip


def test_emulated_chunks_sleep_compute_only_and_the_prediction_pays_host_seconds(tmp_path) -> None:
    """An emulated run at scale s plans with host seconds / s; its chunks sleep s x compute
    (never the overheads, which are the run's real host time); the prediction of the run is
    s x compute plus the host seconds themselves."""
    from megatron_dip.benchmark.bench import first_batches, resolve_run
    from megatron_dip.emulation import EmulatedBatchSource, EmulationConfig
    from megatron_dip.emulation.timing import ScaledCostModel
    from megatron_dip.training.iteration.planning import make_planner, replica_plan

    measured = HostOverheads(2e-3, 1e-3, 4e-4)
    path = tmp_path / "o.json"
    save_overheads(path, OverheadsFile(measured))
    scale = 50.0
    flags = [*_TINY, "--dip-emulate-scale", str(scale), "--dip-host-overheads", str(path)]
    spec = resolve_run(flags, world_size=2)
    assert spec.cost_model.overheads == measured.scaled(1 / scale)
    batch = first_batches(spec, 1)[0]
    plan = replica_plan(make_planner(spec), batch, 0).plan
    source = EmulatedBatchSource(
        plan=plan,
        cost_model=spec.cost_model,
        config=EmulationConfig(scale=scale),
        loss_tokens={m.index: [0] * len(m.sample_ids) for m in plan.microbatches},
    )
    for stage in source.df.stages()[:6]:
        chunk = plan.placement.module(stage.module).chunks[stage.chunk]
        cost = spec.cost_model.stage_cost(chunk, plan.submicrobatch(stage.work))
        assert source.timing(stage).forward_s == pytest.approx(scale * cost.forward)
    scaled = ScaledCostModel(spec.cost_model, scale)
    # Host seconds, unscaled.
    assert dataclasses.astuple(scaled.overheads) == pytest.approx(dataclasses.astuple(measured))
    assert simulate(plan, scaled).iteration_time == pytest.approx(
        scale * simulate(plan, spec.cost_model).iteration_time
    )
    # The zero-sleep floor (scale 0) keeps the host seconds as measured.
    floor = resolve_run([*_TINY, "--dip-emulate-scale", "0", "--dip-host-overheads", str(path)],
                        world_size=2)  # fmt: skip
    assert floor.cost_model.overheads == measured


def test_the_flag_names_itself_and_the_file(tmp_path) -> None:
    from megatron_dip.benchmark.bench import resolve_run
    from megatron_dip.training.config.validate import ConfigError

    path = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match=r"^--dip-host-overheads: cannot read .*missing\.json"):
        resolve_run([*_TINY, "--dip-host-overheads", str(path)], world_size=2)
    path.write_text(json.dumps({"format": "megatron-dip-host-overheads/1", "dip": {"x": 1}}))
    with pytest.raises(ConfigError, match=r"^--dip-host-overheads: .*missing\.json"):
        resolve_run([*_TINY, "--dip-host-overheads", str(path)], world_size=2)
