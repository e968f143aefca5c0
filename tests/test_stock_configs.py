"""The stock Megatron configurations (planner/stock_configs.py), the balanced bound
(planner/bounds.py) and the study that compares them with DIP (planner/compare.py, study.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from metas import vlm_meta
from planner_cases import MERGE, tiny_case

from megatron_dip.data.sample import BatchMeta
from megatron_dip.modelspec import Setup
from megatron_dip.planner.compare import Comparison
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import get_device
from megatron_dip.planner.placement import ModuleWorkload
from megatron_dip.planner.placement_neighbours import neighbour_candidates
from megatron_dip.planner.placement_search import static_candidates
from megatron_dip.planner.search import SearchConfig
from megatron_dip.planner.static_baselines import INTERLEAVED_CHUNKS, static_pipelines
from megatron_dip.planner.stock_configs import mode_label, recompute_modes
from megatron_dip.planner.study import Study, format_table
from megatron_dip.schedule.ir import NO_RECOMPUTE, MemoryPolicy, Recompute

MODEL = tiny_case().model  # ViT 4 layers -> LLM 6 layers, small shapes
SETUP = Setup("tiny", MODEL, tensor_parallel=1, pipeline_parallel=2, num_gpus=2, seq_length=512)


def _batch(iteration: int, grids: list[tuple[int, ...]]) -> BatchMeta:
    samples = tuple(
        vlm_meta(
            i,
            40 + 9 * i + sum(g * g for g in gs),
            tuple((g * MERGE) ** 2 for g in gs),
            tuple(g * g for g in gs),
        )
        for i, gs in enumerate(grids)
    )
    return BatchMeta(iteration, samples)


BATCHES = [
    _batch(0, [(4, 4), (), (6,), (2, 2, 2), (5,), (), (3, 3)]),
    _batch(1, [(6, 6), (5, 5), (), (4,), (2,), (6,)]),
]


def _comparison(memory_gib: float, placement: str | None = None, workers: int = 1) -> Comparison:
    device = dataclasses.replace(get_device("H100"), memory_bytes=memory_gib * 2**30)
    cost = CostModel(MODEL, device)
    search = SearchConfig(max_rollouts=4, time_budget_s=600.0, seed=0)
    return Comparison.create(
        SETUP,
        cost,
        device=device,
        calibration=BATCHES,
        search=search,
        placement=placement,
        workers=workers,
    )


@pytest.fixture(scope="module")
def free_study() -> tuple[Comparison, Study]:
    cmp = _comparison(80.0)
    study = Study()
    for b in BATCHES:
        study.add(cmp.run_batch(b))
    return cmp, study


def test_recompute_grid_holds_megatrons_flags():
    cmp = _comparison(80.0)
    pipe = next(p for p in cmp.static if p.num_model_chunks == 1)
    modes = recompute_modes(pipe.placement)
    top = max(c.num_layers for m in pipe.placement.modules for c in m.chunks)
    assert modes[:3] == [
        NO_RECOMPUTE,
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.FULL, 0),
    ]
    assert MemoryPolicy(Recompute.BLOCK, 1) in modes and MemoryPolicy(Recompute.BLOCK, top) in modes
    assert MemoryPolicy(Recompute.UNIFORM, 1) in modes and len(set(modes)) == len(modes)
    assert [mode_label(m) for m in modes[:4]] == ["none", "selective", "full", "block 1"]


def test_the_search_chooses_the_same_on_two_processes(free_study, monkeypatch, caplog):
    """`workers` (simulate_paper.py --startup-workers) scores the start-up search's candidates,
    its climb's and its near-ties' on that many processes (the study's scorer pickles): the
    same scores and choice."""
    import logging

    from megatron_dip.planner import candidate_pool

    searched, _ = free_study
    monkeypatch.setattr(candidate_pool, "POOL_WORTH_S", 0.0)  # a pool even for tiny candidates
    with caplog.at_level(logging.INFO, logger=candidate_pool.__name__):
        parallel = _comparison(80.0, workers=2)
    assert "scoring the rest on 2 processes" in caplog.text
    assert parallel.dip.name == searched.dip.name
    assert parallel.placement_scores == searched.placement_scores
    assert parallel.tie_scores == searched.tie_scores


def test_a_named_placement_is_rebuilt_without_the_search(free_study):
    """`placement=` (simulate_paper.py --placement): the placement a study printed, built again
    without scoring any candidate: the searched one by its name, a static one moved a layer, and
    DIP's segments; a name that is none of those is refused, naming the static ones."""
    searched, _ = free_study
    assert searched.placement_scores  # the search ran there
    again = _comparison(80.0, placement=searched.dip.name)
    assert again.placement_scores == {}
    assert (again.dip.placement, again.dip.stage_units) == (
        searched.dip.placement,
        searched.dip.stage_units,
    )
    base = next(c for c in static_candidates(searched.static) if c.family == "cost-split")
    moved = neighbour_candidates(MODEL, base)[0]
    got = _comparison(80.0, placement=moved.name).dip
    assert moved.name.startswith(f"{base.name} cut ") and got.placement == moved.placement
    assert got.placement != base.placement and got.stage_units == moved.stage_units
    segments = _comparison(80.0, placement="vit=2, llm=1").dip
    assert segments.name == "vit=2,llm=1"  # as the start-up search names it
    assert {m.name: m.num_chunks for m in segments.placement.modules} == {"vit": 4, "llm": 2}
    with pytest.raises(ValueError, match="unknown static placement .*known: static "):
        _comparison(80.0, placement="static cost-split v9")
    with pytest.raises(ValueError, match="positive stage sizes"):
        _comparison(80.0, placement=f"{base.name} cut 1/2")
    with pytest.raises(ValueError, match="MODULE=N"):
        _comparison(80.0, placement="vit:2")


def test_the_cost_split_runs_interleaved_over_up_to_four_chunks_per_rank(free_study):
    """A Megatron expert also tunes the virtual pipeline size (on VLM-M mixed 8 chunks per rank
    beat 2 by 8%): the grid has the cost-split cut at 1 chunk and at each of
    `INTERLEAVED_CHUNKS`, each its own row ("interleaved v3"), where the layers fill the stages
    (10 layers on 2 ranks: up to 4 chunks each)."""
    cmp, study = free_study
    assert INTERLEAVED_CHUNKS == (2, 3, 4, 6, 8)
    chunks = sorted(p.num_model_chunks for p in cmp.static if p.name == "cost-split")
    assert chunks == [1, 2, 3, 4]
    schedules = {r.schedule for b in study.batches for r in b.stock if r.pipeline == "cost-split"}
    assert schedules == {"1f1b", "interleaved", "interleaved v3", "interleaved v4"}
    assert "megatron interleaved v4 (cost-split), none" in {r.name for r in study.stock_rows()}
    workload = {m.name: ModuleWorkload(4, 4 * 64) for m in MODEL.modules}
    one = static_pipelines(MODEL, cmp.cost_model, num_ranks=1, workload=workload)
    assert {p.num_model_chunks for p in one} == {1}  # interleaving needs a pipeline


def test_every_schedule_is_at_least_the_balanced_bound(free_study):
    _, study = free_study
    for b in study.batches:
        assert b.balanced_bound > 0
        for r in b.stock:
            assert r.sim.iteration_time >= b.balanced_bound * (1 - 1e-9), r.label
        for o in b.dip:
            assert o.sim.iteration_time >= b.balanced_bound * (1 - 1e-9), o.name


def test_without_memory_pressure_the_baseline_recomputes_nothing(free_study):
    _, study = free_study
    pipeline, schedule, mode = study.baseline()
    assert mode == NO_RECOMPUTE
    summary = study.summary()
    assert summary["baseline"]["fits"] == "2/2" and summary["speedup"] > 0
    table = format_table("tiny", study)
    assert "* the strongest stock configuration" in table and pipeline in table


def test_under_memory_pressure_the_baseline_is_the_cheapest_fitting_partial_recompute(
    free_study,
):
    """With the device shrunk until no stock configuration fits without recompute, the
    baseline is a fitting one, and for its pipeline no fitting setting is faster; a smaller
    block N recomputes less (faster) and holds more (so N is the smallest that fits)."""
    _, free = free_study
    peaks = [
        max(r.sim.peak_activation_bytes)
        for b in free.batches
        for r in b.stock
        if r.mode == NO_RECOMPUTE
    ]
    cmp = _comparison(80.0)
    reserve = 0.9 * 80.0 * 2**30  # sizing.activation_limits keeps 10% of the device
    static = max(reserve - lim for p in cmp.static for lim in cmp.memory(p.placement))
    # A device whose activation budget is 70% of the smallest no-recompute peak.
    tight = _comparison((0.7 * min(peaks) + static) / 0.9 / 2**30)
    study = Study()
    for b in BATCHES:
        study.add(tight.run_batch(b))
    key = study.baseline()
    assert key is not None and key[2] != NO_RECOMPUTE
    results = [r for b in study.batches for r in b.stock if r.key[:2] == key[:2]]
    fitting = {}
    for r in results:
        fitting.setdefault(r.mode, []).append(r)
    ok = {
        m: sum(r.sim.iteration_time for r in rs)
        for m, rs in fitting.items()
        if all(r.fits for r in rs)
    }
    assert min(ok, key=ok.get) == key[2]
    blocks = sorted(
        (m.layers, rs[0])
        for m, rs in fitting.items()
        if m.method is Recompute.BLOCK and not m.offload  # Megatron's offload aside
    )
    for (n1, a), (n2, b) in zip(blocks, blocks[1:]):
        assert a.sim.iteration_time <= b.sim.iteration_time * (1 + 1e-9), (n1, n2)
        assert max(a.sim.peak_activation_bytes) >= max(b.sim.peak_activation_bytes), (n1, n2)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.lists(st.integers(1, 6), max_size=3), min_size=2, max_size=9))
# Found by this test: 3 microbatches at PP=2, which Megatron's interleaved schedule refuses
# (its last group would be shorter than PP); the study must leave that configuration out.
@example([[5, 3, 1], [], [4, 4, 6], [3, 4, 1], [4], [5, 6, 1], [5, 1, 6], [], []])
def test_balanced_bound_never_exceeds_any_plan(grids):
    """Property: on random batches, no stock configuration and no DIP step beats the bound."""
    cmp = _comparison(80.0)
    result = cmp.run_batch(_batch(3, [tuple(g) for g in grids]))
    times = [r.sim.iteration_time for r in result.stock] + [
        o.sim.iteration_time for o in result.dip
    ]
    assert min(times) >= result.balanced_bound * (1 - 1e-9)


def test_zero_bubble_peer_and_split_dip_never_lose(free_study):
    """ZB-H1 (1F1B's order, backwards split, W in the bubbles within 1F1B's peak) is its own
    row, never the baseline, no slower than its 1F1B configuration and within its memory; the
    full DIP (B/W split) is no slower than DIP without the split."""
    _, study = free_study
    peers = study.peer_rows()
    assert peers and all(r.name.startswith("zb-h1 (") for r in peers)
    assert study.baseline()[1] != "zb-h1"
    for b in study.batches:
        stock = {(r.pipeline, r.mode): r for r in b.stock if r.schedule == "1f1b"}
        for peer in b.peers:
            base = stock[(peer.pipeline, peer.mode)]
            assert peer.sim.iteration_time <= base.sim.iteration_time * (1 + 1e-12)
            assert max(peer.sim.peak_activation_bytes) <= max(base.sim.peak_activation_bytes)
        steps = {o.name: o for o in b.dip}
        split, fused = steps["dip: +B/W split (full DIP)"], steps["dip: +memory"]
        assert split.sim.iteration_time <= fused.sim.iteration_time * (1 + 1e-12)
    summary = study.summary()
    assert summary["vs_zb_h1"] is not None and "zb-h1" in format_table("tiny", study)


@pytest.mark.parametrize("segments", [None, (("vit", 1), ("llm", 2)), (("vit", 2), ("llm", 2))])
def test_megatron_order_peaks_are_the_order_s_whatever_its_message_timing(segments) -> None:
    """The start-up search and the planner's Megatron candidate decide which recompute modes
    fit from the peaks of the NO_RECOMPUTE order re-tagged (`activation_peaks`), simulating
    only the modes that fit: this holds only if a mode's own plan (its messages placed by that
    mode's durations) holds exactly those peaks."""
    from megatron_dip.planner.candidates import megatron_candidate, merge_submicrobatches
    from megatron_dip.planner.simulator import activation_peaks, simulate
    from megatron_dip.planner.stock_configs import max_chunk_layers, with_recompute

    case = tiny_case(pipeline=2, segments=segments)
    planner = case.planner()
    layout = planner.layout(case.batch)
    works = layout.replicas[0].works
    merged = merge_submicrobatches(planner.model, works)

    def order(mode):
        return megatron_candidate(
            planner, merged, mode, totals=layout.totals, iteration=layout.iteration, replica=0
        )

    plain = order(NO_RECOMPUTE)
    layers = max_chunk_layers(planner.placement)
    modes = [MemoryPolicy(Recompute.BLOCK, n) for n in range(1, layers + 1)]
    modes += [
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.UNIFORM, layers),
        MemoryPolicy(Recompute.FULL, 0),
    ]
    cost = planner.cost_model
    for mode in modes:
        own = simulate(order(mode), cost).peak_activation_bytes
        assert activation_peaks(with_recompute(plain, mode), cost) == own, mode
    assert len({activation_peaks(with_recompute(plain, m), cost) for m in modes}) > 1


def test_a_peer_whose_recompute_setting_differs_between_batches_keeps_its_row():
    """ZB-H1 runs under each batch's fastest fitting 1F1B setting: where those differ (VLM-M's
    cost cut: block 4 on one batch, block 3 on another) the peer is still one row, "recompute
    per batch", fastest rows first (grouped by setting it was dropped, and the table compared
    DIP with a slower placement's peer)."""
    from types import SimpleNamespace

    from megatron_dip.planner.compare import BatchResult
    from megatron_dip.planner.stock_configs import StockResult

    def peer(pipeline: str, layers: int, seconds: float) -> StockResult:
        mode = MemoryPolicy(Recompute.BLOCK, layers=layers)
        sim = SimpleNamespace(iteration_time=seconds, lower_bound=seconds / 2)
        return StockResult(pipeline, "zb-h1", mode, sim, True)

    study = Study()
    for i, (layers, seconds) in enumerate([(4, 10.0), (3, 11.0)]):
        peers = (peer("cost-split", layers, seconds), peer("stock", 48, 29.0))
        study.add(BatchResult(i, (), (), 8.0, peers))
    rows = study.peer_rows()
    assert [r.name for r in rows] == [
        "zb-h1 (cost-split), recompute per batch",
        "zb-h1 (stock), block 48",
    ]
    assert rows[0].time == [10.0, 11.0] and rows[0].recompute == ["block 4", "block 3"]
