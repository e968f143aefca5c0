"""Sub-microbatch size as a planned choice (planner/sub_size_choice.py): the planner plans a batch
at the configured sizes and at `PlannerConfig.sub_size_scales` times them, and keeps the plan
that fits and simulates fastest."""

from __future__ import annotations

import dataclasses

from planner_cases import tiny_case

from megatron_dip.planner.config import scoring_config
from megatron_dip.planner.dip import DipPlanner
from megatron_dip.planner.simulator import simulate
from megatron_dip.planner.stock_configs import fits
from megatron_dip.planner.sub_size_choice import scaled_sizes
from megatron_dip.schedule.engine import per_peer_channel
from megatron_dip.schedule.validate import validate_plan


def _with_scales(planner: DipPlanner, scales: tuple[int, ...]) -> DipPlanner:
    config = dataclasses.replace(planner.config, sub_size_scales=scales)
    return DipPlanner(planner.model, planner.cost_model, planner.placement, config)


def _largest(plan, module: str) -> int:
    return max(s.num_instances for s in plan.submicrobatches if s.module == module)


def test_scaled_sizes_multiply_every_module_once() -> None:
    assert scaled_sizes({"vit": 4}, (2,)) == [{"vit": 8}]
    assert scaled_sizes({"text": 3, "dit": 1}, (1, 2, 2, 3)) == [
        {"text": 6, "dit": 2},
        {"text": 9, "dit": 3},
    ]
    assert scaled_sizes({"vit": 4}, ()) == []
    assert scaled_sizes({"vit": 4, "dit": 1}, (1.5,)) == [{"vit": 6, "dit": 2}]
    # Each scale a cut of its own: 1 x 1.5 and 1 x 2 both round to 2, so the second takes 3.
    assert scaled_sizes({"vit": 4, "dit": 1}, (2, 1.5)) == [
        {"vit": 6, "dit": 2},
        {"vit": 8, "dit": 3},
    ]


def test_coarser_cut_is_planned_and_kept_where_faster() -> None:
    """Without a memory limit the larger ViT GEMMs of size 2 win over size 1 here: the planner
    returns the size-2 cut of the same microbatches, valid, and faster in simulation."""
    case = tiny_case(sub_sizes=(("vit", 1),), search=False, megatron_candidate=False)
    plain = case.planner(None)
    coarse = _with_scales(plain, (2,))
    (configured,) = plain.plan_batch(case.batch)
    (chosen,) = coarse.plan_batch(case.batch)
    validate_plan(chosen.plan)
    assert _largest(configured.plan, "vit") == 1
    assert _largest(chosen.plan, "vit") == 2
    assert chosen.plan.microbatches == configured.plan.microbatches
    cost = plain.cost_model
    before = simulate(configured.plan, cost, channel=per_peer_channel).iteration_time
    after = simulate(chosen.plan, cost, channel=per_peer_channel).iteration_time
    assert after < before


def test_chosen_cut_fits_and_is_never_slower_under_a_binding_limit() -> None:
    """With the limit at the configured plan's own peaks, whichever cut is returned fits them and
    simulates no slower than the configured cut."""
    case = tiny_case(
        sub_sizes=(("vit", 1),), search=False, megatron_candidate=False, strict_memory=False
    )
    free = case.planner(None)
    (unlimited,) = free.plan_batch(case.batch)
    cost = free.cost_model
    limit = max(simulate(unlimited.plan, cost).peak_activation_bytes)
    plain = case.planner(limit * 0.8)
    (configured,) = plain.plan_batch(case.batch)
    (chosen,) = _with_scales(plain, (2, 4)).plan_batch(case.batch)
    limits = plain.scheduling_limits
    sim_configured = simulate(configured.plan, cost, channel=per_peer_channel)
    sim_chosen = simulate(chosen.plan, cost, channel=per_peer_channel)
    if fits(sim_configured, limits):
        assert fits(sim_chosen, limits)
    assert sim_chosen.iteration_time <= sim_configured.iteration_time


def test_forward_only_and_scoring_plan_at_the_configured_sizes() -> None:
    case = tiny_case(sub_sizes=(("vit", 1),), search=False, megatron_candidate=False)
    coarse = _with_scales(case.planner(None), (2,))
    layout = coarse.layout(case.batch)
    forward = coarse.plan_layout(layout, 0, forward_only=True)
    assert _largest(forward.plan, "vit") == 1
    assert scoring_config(coarse.config).sub_size_scales == ()


def test_a_faster_cut_over_the_memory_limit_loses_to_one_that_fits(monkeypatch) -> None:
    """The coarser cut simulates faster here (previous test); marked over the memory limit, the
    configured cut is kept."""
    case = tiny_case(sub_sizes=(("vit", 1),), search=False, megatron_candidate=False)
    coarse = _with_scales(case.planner(None), (2,))
    plan_replica = coarse.plan_replica

    def marking(works, **kwargs):
        found = plan_replica(works, **kwargs)
        over = any(s.num_instances > 1 for s in found.plan.submicrobatches if s.module == "vit")
        return dataclasses.replace(found, overcommitted=over)

    monkeypatch.setattr(coarse, "plan_replica", marking)
    (chosen,) = coarse.plan_batch(case.batch)
    assert _largest(chosen.plan, "vit") == 1 and not chosen.overcommitted
