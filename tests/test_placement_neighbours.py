"""The start-up search's neighbouring cuts of the static one-list placements
(planner/placement_neighbours.py): one stage boundary moved by one layer, DIP's candidates only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import get_device
from megatron_dip.planner.placement import ModuleWorkload, choose_dip_placement
from megatron_dip.planner.placement_neighbours import (
    moved_boundaries,
    neighbour_candidates,
    neighbour_pipelines,
    search_candidates,
    stage_cuts,
)
from megatron_dip.planner.placement_search import static_candidates
from megatron_dip.planner.static_baselines import StaticPipeline, static_pipelines


@pytest.fixture(scope="module")
def vlm():
    """VLM-S (ViT 63 layers, LLM 32, 4 ranks), its cost model, a workload and its static
    placements."""
    setup = PAPER_SETUPS["vlm-s"]
    cost = CostModel(setup.model, get_device("H800"), shape=setup.shape)
    workload = {m.name: ModuleWorkload(20, 20 * 1024) for m in setup.model.modules}
    static = static_pipelines(
        setup.model, cost, num_ranks=setup.pipeline_parallel, workload=workload
    )
    return SimpleNamespace(model=setup.model, cost=cost, workload=workload, static=static)


def test_moved_boundaries_moves_one_boundary_by_one_and_keeps_stages_non_empty() -> None:
    assert moved_boundaries([(0, 1), (1, 3), (3, 5)]) == [
        [(0, 2), (2, 3), (3, 5)],  # boundary 1 + 1 (- 1 would empty stage 0)
        [(0, 1), (1, 2), (2, 5)],  # boundary 2 - 1
        [(0, 1), (1, 4), (4, 5)],  # boundary 2 + 1
    ]


def _placed_layers(placement) -> dict[str, list[int]]:
    return {
        m.name: sorted(x for c in m.chunks for x in range(c.layer_start, c.layer_end))
        for m in placement.modules
    }


@pytest.mark.parametrize("base", ["cost-split", "params-split"])
def test_each_neighbour_is_its_base_with_one_layer_moved_across_one_boundary(vlm, base) -> None:
    """Every neighbour places every layer once, keeps the base's virtual-stage structure (each
    unit's chunk on its stage's rank), and its stages differ from the base's at one boundary by
    one layer; no two neighbours are the same."""
    layers = {m.name: list(range(m.num_layers)) for m in vlm.model.modules}
    for q in (q for q in vlm.static if q.name == base):
        cuts = stage_cuts(q)
        assert cuts is not None and len(cuts) == 4 * q.num_model_chunks
        neighbours = neighbour_pipelines(vlm.model, q)
        assert len(neighbours) == 2 * (len(cuts) - 1)  # no stage of these is one layer
        seen = set()
        for sizes, n in neighbours:
            assert _placed_layers(n.placement) == layers
            assert n.num_model_chunks == q.num_model_chunks
            for rank, stages in enumerate(n.stage_units):
                chunks = {(m.name, c.index): c for m in n.placement.modules for c in m.chunks}
                assert all(chunks[u].rank == rank for units in stages for u in units)
            new = stage_cuts(n)
            assert sizes == "/".join(str(e - s) for s, e in new)
            moved = [i for i in range(1, len(cuts)) if new[i][0] != cuts[i][0]]
            assert len(moved) == 1 and abs(new[moved[0]][0] - cuts[moved[0]][0]) == 1
            seen.add(tuple(new))
        assert len(seen) == len(neighbours)


def test_only_the_one_list_cuts_get_neighbours_and_the_baselines_stay(vlm) -> None:
    """Neighbours of cost-split (v1, v2) and params-split (v2), named after their base and
    cut; the static candidates come first and unchanged (the stock baselines' grid is
    `static_pipelines`, which this does not touch)."""
    extra = neighbour_candidates(vlm.model, vlm.static)
    assert {c.name.split(" cut ")[0] for c in extra} == {
        "static cost-split v1",
        "static cost-split v2",
        "static params-split v2",
    }
    assert len(extra) == 6 + 14 + 14
    everything = search_candidates(vlm.model, vlm.static)
    assert [c.name for c in everything[: len(vlm.static)]] == [
        c.name for c in static_candidates(vlm.static)
    ]
    assert everything[len(vlm.static) :] == extra


def test_a_pipeline_whose_stages_are_not_one_list_in_order_has_no_neighbours(vlm) -> None:
    q = next(q for q in vlm.static if q.name == "cost-split" and q.num_model_chunks == 1)
    swapped = StaticPipeline(q.name, q.placement, q.stage_units[::-1], 1)  # stage 0 on rank 3
    assert stage_cuts(swapped) is None and neighbour_pipelines(vlm.model, swapped) == []


def test_the_search_picks_a_neighbour_that_scores_lower(vlm) -> None:
    """With every bound below every score all candidates are scored; the one neighbour that
    scores lowest is chosen, with its virtual stages."""
    extra = search_candidates(vlm.model, vlm.static)
    target = next(c for c in extra if " cut " in c.name and c.name.startswith("static cost"))

    def evaluate(cand) -> float:
        return 1.0 if cand.name == target.name else 2.0

    chosen, scores = choose_dip_placement(
        vlm.model,
        vlm.cost,
        num_ranks=4,
        workload=vlm.workload,
        unit_instances=None,
        evaluate=evaluate,
        extra=extra,
        bound=lambda cand: 0.5,
    )
    assert chosen.name == target.name and chosen.stage_units == target.stage_units
    assert set(c.name for c in extra) <= set(scores)


def test_the_run_resolves_a_neighbours_flag_to_the_same_placement(vlm) -> None:
    """`--dip-segments static:...-cut-...` (the flag the start-up search logs for a neighbour)
    gives that neighbour's placement and virtual stages without searching again."""
    from megatron_dip.training.config.layout import _named_static, placement_flag

    sizing = SimpleNamespace(model=vlm.model, cost_model=vlm.cost, pp=4, workload=vlm.workload)
    for cand in neighbour_candidates(vlm.model, vlm.static)[:3]:
        got = _named_static(sizing, placement_flag(cand.name, {}))
        assert got.placement == cand.placement and got.stage_units == cand.stage_units
