"""Granularity against host overhead: sub-microbatch sizes (planner/submicrobatch.py) and the
start-up placement search (planner/placement.py, planner/placement_search.py) scored with the
host overheads, and the run's layout choosing them (training/layout.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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


_TINY = [
    "--dip-emulate-compute", "--model", "tiny-vlm", "--pipeline-model-parallel-size", "2",
    "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
    "--dip-segments", "auto",  # search, not the tiny preset's segments
]  # fmt: skip
_HEAVY = HostOverheads(1e-3, 1e-3, 1e-3)


@pytest.fixture(scope="module")
def tiny():
    from megatron_dip.batching import LayoutConfig, pack
    from megatron_dip.benchmark.bench import first_batches, resolve_run
    from megatron_dip.planner.sizing import average_workload
    from megatron_dip.training.config.layout import split_all

    spec = resolve_run(_TINY, world_size=2)
    batches = first_batches(spec, 1)
    whole = LayoutConfig(seq_length=spec.training.seq_length, packing=spec.limits)
    mbs = [list(mb) for b in batches for mb in pack(list(b.samples), spec.limits)]
    return spec, batches, average_workload(spec.model, split_all(spec.model, mbs, whole))


def _search(spec, batches, workload, cost):
    """The DIP segment candidates' scores under `cost` (greedy plans, simulated)."""
    import dataclasses

    from megatron_dip.planner.dip import DipPlanner
    from megatron_dip.planner.placement import choose_dip_placement
    from megatron_dip.planner.placement_search import simulated_score

    def evaluate(cand) -> float:
        config = dataclasses.replace(spec.planner, use_search=False)
        planner = DipPlanner(spec.model, cost, cand.placement, config)
        return simulated_score(planner, batches, limits=None)

    return choose_dip_placement(
        spec.model,
        cost,
        num_ranks=2,
        workload=workload,
        unit_instances=spec.sub_sizes,
        evaluate=evaluate,
    )


def _chunks(placement) -> int:
    return sum(m.num_chunks for m in placement.modules)


def test_host_overheads_make_the_search_prefer_fewer_chunks(tiny) -> None:
    """Every candidate pays the host overheads, the finer ones more: the latency rule's
    placement (the first candidate, more chunks than the choice) pays more than the choice."""
    spec, batches, workload = tiny
    free, free_scores = _search(spec, batches, workload, spec.cost_model)
    heavy, heavy_scores = _search(spec, batches, workload, spec.cost_model.with_overheads(_HEAVY))
    assert heavy_scores[heavy.name] == min(heavy_scores.values())
    assert all(heavy_scores[n] > free_scores[n] for n in free_scores)
    rule = next(iter(heavy_scores))  # choose_dip_placement lists the rule's segments first
    assert rule == "vit=1,llm=2" != heavy.name  # the tiny model's rule interleaves the LLM
    finer = [n for n in heavy_scores if sum(int(x[-1]) for x in n.split(",")) > 2]
    for name in finer:  # the overheads are what a coarser placement saves
        assert (
            heavy_scores[name] - free_scores[name]
            > heavy_scores[heavy.name] - free_scores[heavy.name]
        )


def test_the_run_scores_its_placement_search_with_the_host_overheads(tiny, tmp_path, caplog):
    import logging

    from megatron_dip.benchmark.bench import resolve_run

    path = tmp_path / "o.json"
    save_overheads(path, OverheadsFile(_HEAVY))
    scores = []
    for extra in ([], ["--dip-host-overheads", str(path)]):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_dip.training.config.layout"):
            resolve_run([*_TINY, *extra], world_size=2)
        (record,) = [r for r in caplog.records if "chosen" in r.getMessage()]
        scores.append(record.args[-1])  # {candidate: simulated s}, last in the line
    free, heavy = scores
    assert set(free) == set(heavy) and all(heavy[n] > free[n] for n in free)
    # Explicit segments are never second-guessed.
    fixed = resolve_run(
        [*_TINY[:-2], "--dip-segments", "vit=1,llm=2", "--dip-host-overheads", str(path)],
        world_size=2,
    )
    assert fixed.segments == {"vit": 1, "llm": 2}


def test_the_start_up_search_scores_on_worker_processes_with_the_same_choice(caplog, monkeypatch):
    """--dip-startup-workers 2 scores the candidates two at a time on spawned processes (the
    run's scorer pickles) once one candidate was slow to score (here: any): the same scores
    and the same placement as one process."""
    import logging

    from megatron_dip.benchmark.bench import resolve_run
    from megatron_dip.planner import candidate_pool

    monkeypatch.setattr(candidate_pool, "POOL_WORTH_S", 0.0)
    seen = []
    for workers in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_dip"):
            spec = resolve_run([*_TINY, "--dip-startup-workers", str(workers)], world_size=2)
        (record,) = [r for r in caplog.records if "chosen" in r.getMessage()]
        pooled = [r for r in caplog.records if r.name == candidate_pool.__name__]
        # one pool for the search, and one per step of the cut's climb (placement_climb)
        assert record.args[2] == workers and bool(pooled) == (workers > 1)
        seen.append((spec.placement_name, spec.segments, record.args[-1]))
    assert seen[0] == seen[1] and len(seen[0][2]) > 2
