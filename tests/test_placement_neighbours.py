"""The start-up search's neighbouring cuts of the static one-list placements
(planner/placement_neighbours.py: one stage boundary moved by one layer) and the climb through
them from the search's choice (planner/placement_climb.py); DIP's candidates only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import get_device
from megatron_dip.planner.placement import ModuleWorkload
from megatron_dip.planner.placement_climb import climb_cut
from megatron_dip.planner.placement_neighbours import (
    cut_candidate,
    moved_boundaries,
    neighbour_candidates,
    stage_cuts,
)
from megatron_dip.planner.placement_search import static_candidates
from megatron_dip.planner.static_baselines import static_pipelines


@pytest.fixture(scope="module")
def vlm():
    """VLM-S (ViT 63 layers, LLM 32, 4 ranks), its cost model, a workload and its static
    placements as search candidates."""
    setup = PAPER_SETUPS["vlm-s"]
    cost = CostModel(setup.model, get_device("H800"), shape=setup.shape)
    workload = {m.name: ModuleWorkload(20, 20 * 1024) for m in setup.model.modules}
    static = static_pipelines(
        setup.model, cost, num_ranks=setup.pipeline_parallel, workload=workload
    )
    return SimpleNamespace(
        model=setup.model,
        cost=cost,
        workload=workload,
        static=static,
        cands={c.name: c for c in static_candidates(static)},
    )


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


@pytest.mark.parametrize(
    "name", ["static cost-split v1", "static cost-split v2", "static params-split v2"]
)
def test_each_neighbour_is_its_base_with_one_layer_moved_across_one_boundary(vlm, name) -> None:
    """Every neighbour places every layer once, keeps the base's virtual-stage structure (each
    unit's chunk on its stage's rank), and its stages differ from the base's at one boundary by
    one layer; no two neighbours are the same, and each is named after its base and cut."""
    layers = {m.name: list(range(m.num_layers)) for m in vlm.model.modules}
    base = vlm.cands[name]
    cuts = stage_cuts(base.placement, base.stage_units)
    assert cuts is not None and len(cuts) == 4 * len(base.stage_units[0])
    neighbours = neighbour_candidates(vlm.model, base)
    assert len(neighbours) == 2 * (len(cuts) - 1)  # no stage of these is one layer
    seen = set()
    for n in neighbours:
        assert _placed_layers(n.placement) == layers
        assert len(n.stage_units[0]) == len(base.stage_units[0])
        chunks = {(m.name, c.index): c for m in n.placement.modules for c in m.chunks}
        for rank, stages in enumerate(n.stage_units):
            assert all(chunks[u].rank == rank for units in stages for u in units)
        new = stage_cuts(n.placement, n.stage_units)
        assert n.name == f"{name} cut " + "/".join(str(e - s) for s, e in new)
        moved = [i for i in range(1, len(cuts)) if new[i][0] != cuts[i][0]]
        assert len(moved) == 1 and abs(new[moved[0]][0] - cuts[moved[0]][0]) == 1
        seen.add(tuple(new))
    assert len(seen) == len(neighbours)


def test_only_the_one_list_cuts_have_neighbours(vlm) -> None:
    """The stock placements (encoder whole on stage 0) keep their cut, and so does a pipeline
    whose stages are not the layer list in order; the static baselines are not touched."""
    assert neighbour_candidates(vlm.model, vlm.cands["static stock v1"]) == []
    base = vlm.cands["static cost-split v1"]
    swapped = type(base)(base.name, base.placement, base.stage_units[::-1])  # stage 0 on rank 3
    assert stage_cuts(swapped.placement, swapped.stage_units) is None
    assert neighbour_candidates(vlm.model, swapped) == []
    assert [c.name for c in static_candidates(vlm.static)] == list(vlm.cands)


def test_a_cut_is_built_again_from_its_base_and_sizes(vlm) -> None:
    base = vlm.cands["static cost-split v1"]
    for n in neighbour_candidates(vlm.model, base):
        sizes = [int(x) for x in n.name.split(" cut ")[1].split("/")]
        again = cut_candidate(vlm.model, base, sizes)
        assert again == n
    with pytest.raises(ValueError, match="4 positive stage sizes adding up to 95"):
        cut_candidate(vlm.model, base, [30, 30, 30, 4, 1])


def _sizes(cand) -> list[int]:
    return [e - s for s, e in stage_cuts(cand.placement, cand.stage_units)]


def _boundaries(sizes: list[int]) -> list[int]:
    return [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]


def test_the_climb_moves_the_cut_while_it_scores_lower_and_stops(vlm) -> None:
    """A score falling by one per layer moved towards a valley two moves away (two boundaries
    moved): the climb takes the two improving steps from the cost rule's cut, then stops (the
    valley's neighbours score higher), scoring no cut twice."""
    base = vlm.cands["static cost-split v1"]
    start = _sizes(base)
    valley = [start[0] - 1, start[1] + 1, start[2] + 1, start[3] - 1]
    evaluated = []

    def evaluate(cand) -> float:
        evaluated.append(cand.name)
        away = zip(_boundaries(_sizes(cand)), _boundaries(valley))
        return 100.0 + sum(abs(a - b) for a, b in away)

    scores = {base.name: evaluate(base)}
    chosen = climb_cut(vlm.model, base, scores, evaluate=evaluate, bound=lambda c: 0.0)
    assert chosen.name == "static cost-split v1 cut " + "/".join(map(str, valley))
    assert scores[chosen.name] == min(scores.values()) == scores[base.name] - 2
    assert len(evaluated) == len(set(evaluated)) == len(scores)
    assert base.name + " cut " + "/".join(map(str, start)) not in scores  # the base again
    assert len(scores) <= 1 + 6 + 5 + 5  # the base, then each step's new neighbours


def test_the_climb_keeps_a_cut_no_neighbour_beats_and_other_candidates(vlm) -> None:
    base = vlm.cands["static cost-split v1"]
    scores = {base.name: 1.0}
    assert climb_cut(vlm.model, base, scores, evaluate=lambda c: 1.0) is base
    assert len(scores) == 7  # scored its 6 neighbours, none strictly lower
    dip = vlm.cands["static stock v1"]
    assert climb_cut(vlm.model, dip, {dip.name: 1.0}, evaluate=lambda c: 0.0) is dip


def test_a_bound_above_the_score_to_beat_skips_scoring(vlm) -> None:
    base = vlm.cands["static cost-split v1"]
    scores = {base.name: 1.0}
    chosen = climb_cut(vlm.model, base, scores, evaluate=lambda c: 0.5, bound=lambda c: 2.0)
    assert chosen is base and scores == {base.name: 1.0}


def test_the_run_resolves_a_moved_cuts_flag_to_the_same_placement(vlm) -> None:
    """`--dip-segments static:...-cut-...` (the flag the start-up search logs for a moved
    cut, two moves away here) gives that placement and its virtual stages without searching;
    a cut that does not fit the base is refused."""
    from megatron_dip.training.config.arguments import ConfigError
    from megatron_dip.training.config.layout import _named_static, placement_flag

    sizing = SimpleNamespace(model=vlm.model, cost_model=vlm.cost, pp=4, workload=vlm.workload)
    base = vlm.cands["static cost-split v1"]
    step = neighbour_candidates(vlm.model, base)[0]
    for cand in neighbour_candidates(vlm.model, step)[:3]:
        got = _named_static(sizing, placement_flag(cand.name, {}))
        assert got.placement == cand.placement and got.stage_units == cand.stage_units
    with pytest.raises(ConfigError, match="positive stage sizes"):
        _named_static(sizing, "static:cost-split-v1-cut-1/2/3")


def test_a_second_climb_starts_from_the_cost_cut_where_no_one_list_cut_wins(vlm) -> None:
    """Where DIP's segments win the greedy scores, the cost rule's cut over one chunk per rank
    is climbed too: over the memory limit its score is doubled (here 20, against the winner's
    10), a cut one layer away fits and scores 5, so the search ends there; where a one-list cut
    wins, only that one is climbed."""
    from megatron_dip.planner.placement_climb import second_start
    from megatron_dip.planner.placement_search import search_placement

    base = vlm.cands["static cost-split v1"]
    sizes = _sizes(base)
    fits = "static cost-split v1 cut " + "/".join(
        map(str, [sizes[0] - 1, sizes[1] + 1, *sizes[2:]])
    )

    def score(cand) -> float:
        if cand.name == base.name:
            return 20.0  # over the limit: counted double
        if cand.name == fits:
            return 5.0
        if " cut " in cand.name:
            return 25.0
        return 12.0 if cand.name.startswith("static ") else 10.0  # DIP's segments win

    chosen, scores, planned = search_placement(
        vlm.model,
        vlm.cost,
        num_ranks=4,
        workload=vlm.workload,
        unit_instances=None,
        static=vlm.static,
        score=score,
        plan_score=score,
        bound=lambda c: 0.0,
    )
    assert chosen.name == fits and scores[base.name] == 20.0
    assert planned == {fits: 5.0, base.name: 20.0}  # planned against the cut it climbed from
    assert second_start(base, scores, {base.name: base}) is None  # a one-list cut: climbed itself
