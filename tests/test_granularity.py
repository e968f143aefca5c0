"""Granularity against host overhead: sub-microbatch sizes (planner/submicrobatch.py) and segments
traded in simulation (planner/granularity.py), and the run's layout choosing them
(training/layout.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from megatron_dip.planner.granularity import (
    coarser_segments,
    granularity,
    greedy_score,
    trade_segments,
)
from megatron_dip.planner.overheads import HostOverheads, OverheadsFile, save_overheads
from megatron_dip.planner.submicrobatch import choose_sub_size


class _Curve:
    """One layer of `b` instances takes 1 + b seconds and does b units of work: efficiency
    b / (1 + b + host), where `host` is the host time charged to the layer."""

    model = SimpleNamespace(module=lambda name: SimpleNamespace(num_layers=2))

    def efficiency(self, module, *, instances, tokens_per_instance, host_seconds=0.0):
        return instances / (1 + instances + host_seconds)


def test_host_time_makes_the_sub_microbatch_size_grow_by_hand() -> None:
    """No host time: peak 64/65; 95% of it is reached from b/(1+b) >= 0.9354, b = 15. A pass
    costing 20 host seconds over the module's 2 layers (10 per layer): peak 64/75, 95% of it
    from b/(11+b) >= 0.8107, b = 48."""
    assert choose_sub_size(_Curve(), "vit", tokens_per_instance=1) == 15
    assert choose_sub_size(_Curve(), "vit", tokens_per_instance=1, host_seconds=20.0) == 48


def test_coarser_segments_halve_each_module_towards_one() -> None:
    assert coarser_segments({"vit": 1, "llm": 4}) == [
        {"vit": 1, "llm": 4},
        {"vit": 1, "llm": 2},
        {"vit": 1, "llm": 1},
    ]
    assert len(coarser_segments({"a": 3, "b": 2})) == 4  # a in (3, 1), b in (2, 1)


_TINY = [
    "--dip-emulate-compute", "--model", "tiny-vlm", "--pipeline-model-parallel-size", "2",
    "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
    "--dip-segments", "",  # ask the cost model, not the tiny preset
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    from megatron_dip.batching import LayoutConfig
    from megatron_dip.benchmark.bench import first_batches, resolve_run
    from megatron_dip.planner.compare import average_workload
    from megatron_dip.training.layout import calibration_microbatches, split_all

    spec = resolve_run(_TINY, world_size=2)
    batches = first_batches(spec, 1)
    whole = LayoutConfig(seq_length=spec.config.train.seq_length, packing=spec.limits)
    works = split_all(spec.model, calibration_microbatches(batches, spec.limits), whole)
    return spec, batches, average_workload(spec.model, works)


def _evaluate(spec, batches, cost):
    from megatron_dip.planner.dip import DipPlanner

    def evaluate(g) -> float:
        config = dataclasses.replace(spec.planner, sub_sizes=g.sub_sizes)
        return greedy_score(DipPlanner(spec.model, cost, g.placement, config), batches, limits=None)

    return evaluate


def test_overhead_flips_the_segment_choice_where_simulation_says_so(tiny) -> None:
    """Without host overheads the latency rule's segments stand, unevaluated (today's
    behaviour). With them every candidate is simulated: the choice is the fastest, coarser
    than the rule, and the rule's finer placement pays more for the overheads."""
    spec, batches, workload = tiny
    rule = dict(spec.segments)
    assert rule["llm"] > 1  # the rule interleaves the LLM
    kwargs = dict(num_ranks=2, workload=workload, segments=rule)
    plain, scores = trade_segments(
        spec.model, spec.cost_model, evaluate=_evaluate(spec, batches, spec.cost_model), **kwargs
    )
    assert plain.segments == rule and scores == {}
    heavy = spec.cost_model.with_overheads(HostOverheads(1e-3, 1e-3, 1e-3))
    chosen, scores = trade_segments(
        spec.model, heavy, evaluate=_evaluate(spec, batches, heavy), **kwargs
    )
    assert len(scores) == len(coarser_segments(rule))
    assert scores[chosen.name] == min(scores.values())
    assert sum(chosen.segments.values()) < sum(rule.values())
    finest = granularity(spec.model, heavy, **kwargs)
    assert scores[finest.name] > scores[chosen.name]
    # The overheads are what the coarser plan saves: its simulated time gains less from them.
    free = _evaluate(spec, batches, spec.cost_model)
    assert scores[finest.name] - free(finest) > scores[chosen.name] - free(chosen)


def test_the_run_trades_granularity_when_given_host_overheads(tiny, tmp_path) -> None:
    from megatron_dip.benchmark.bench import resolve_run

    spec, _, _ = tiny
    path = tmp_path / "o.json"
    save_overheads(path, OverheadsFile(HostOverheads(1e-3, 1e-3, 1e-3)))
    traded = resolve_run([*_TINY, "--dip-host-overheads", str(path)], world_size=2)
    assert sum(traded.segments.values()) < sum(spec.segments.values())
    # Explicit segments are never second-guessed.
    fixed = resolve_run(
        [*_TINY[:-2], "--dip-segments", "vit=1,llm=2", "--dip-host-overheads", str(path)],
        world_size=2,
    )
    assert fixed.segments == {"vit": 1, "llm": 2}
