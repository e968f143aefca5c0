"""Property tests of the DIP planner over random models, placements, batches and memory limits.

Every plan the planner returns must validate, run without deadlock in the simulator under both
channel models, respect the activation-memory limit it was given (or the planner must refuse
with `MemoryLimitError`), never beat the bubble-free bound, serialize byte-identically, and be
deterministic: the same inputs give the same bytes twice in one process and in fresh processes
with different hash seeds. The "ci" hypothesis profile runs about 150 planning cases (about 30 s
of CPU); `--fuzz` runs 2500.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from metas import t2v_meta, vlm_meta
from planner_cases import (
    LARGE,
    MERGE,
    SEQ,
    SMALL,
    Case,
    cases,
    check_plan,
    dit_module,
    layer_shape,
    limit_for,
    plan_bytes,
    planning_digest,
    t2v_encoder,
    tiny_case,
)

from megatron_dip.batching import split_microbatch
from megatron_dip.data.sample import BatchMeta, InstanceCounts, SampleMeta
from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import get_device
from megatron_dip.planner.memory import MemoryLimitError
from megatron_dip.planner.search import SearchConfig
from megatron_dip.schedule.ir import Forward, Recompute
from megatron_dip.schedule.serialize import plan_to_bytes

CI_EXAMPLES = 60  # the "ci" profile's max_examples (tests/conftest.py); --fuzz loads 2000
FUZZ = settings.default.max_examples > CI_EXAMPLES
# Thousands of --fuzz cases outlast the suite's 600 s per-test timeout; CI keeps it.
fuzz_timeout = pytest.mark.timeout(4 * 3600) if FUZZ else pytest.mark.timeout(600)

# -- properties over random cases ---------------------------------------------------------------


def _found_silent_overcommit() -> Case:
    """Found by this test: one rank, one 1-token sample, a limit below what even full
    recomputation needs; the planner returned an overcommitted plan without a word."""
    vit = ModuleSpec(
        "vit",
        "vit",
        1,
        layer_shape(SMALL, gated=False),
        trainable=False,
        feeds="llm",
        patch_size=8,
        merge=MERGE,
        out_hidden=SMALL[0],
    )
    llm = ModuleSpec("llm", "llm", 1, layer_shape(SMALL, gated=True), vocab_size=128)
    return tiny_case(
        model=MultimodalSpec("fuzz-vlm", (vit, llm)),
        batch=BatchMeta(0, (vlm_meta(0, 1),)),
        pipeline=1,
        sub_sizes=(("vit", 1),),
        search=False,
        megatron_candidate=False,
        memory_fraction=0.25,
    )


def _found_timing_dependent_milp() -> Case:
    """Found by this test (under CPU load): the recompute MILP ran under a 0.5 s wall-clock
    limit, so the same batch got different recompute modes, and plan bytes, from run to run."""
    model = MultimodalSpec(
        "fuzz-t2v",
        (t2v_encoder(9, LARGE, trainable=False), dit_module(8, LARGE, cond_hidden=LARGE[0])),
    )
    clips = [(50, 12, 3), (21, 7, 7), (38, 12, 6), (54, 4, 1), (21, 7, 7), (6, 24, 2), (27, 18, 3)]
    samples = tuple(t2v_meta(i, t, v, f) for i, (t, v, f) in enumerate(clips))
    return tiny_case(
        model=model,
        batch=BatchMeta(2, samples),
        pipeline=3,
        tensor_parallel=2,
        sequence_parallel=True,
        segments=(("text", 2), ("dit", 2)),
        sub_sizes=(("text", 2), ("dit", 1)),
        rollouts=3,
        seed=0,
        lookahead=2,
        memory_fraction=0.3115873521843426,
    )


@fuzz_timeout
@settings(max_examples=max(2 * CI_EXAMPLES, settings.default.max_examples))
@example(case=_found_silent_overcommit())
@given(cases())
def test_plans_are_valid_fast_and_within_memory(case: Case) -> None:
    """Valid, deadlock-free under both channel models, within the memory limit (or a clear
    MemoryLimitError), never faster than the bubble-free bound, serialization round-trips."""
    limit = limit_for(case)
    planner = case.planner(limit)
    try:
        replicas = planner.plan_batch(case.batch)
    except MemoryLimitError as err:
        # Only a limit below the unconstrained peak may be refused, and only by a strict planner.
        assert limit is not None and case.memory_fraction < 1.0, err
        assert case.strict_memory and "GiB" in str(err)
        return
    assert len(replicas) == case.data_parallel
    cost = case.cost_model()
    for r, rp in enumerate(replicas):
        assert rp.plan.replica == r
        assert not (case.strict_memory and rp.overcommitted)
        check_plan(rp.plan, cost, case.limits(limit), overcommitted=rp.overcommitted)


@fuzz_timeout
@settings(max_examples=max(CI_EXAMPLES // 2, settings.default.max_examples // 4))
@example(case=_found_timing_dependent_milp())
@given(cases())
def test_planning_twice_gives_identical_bytes(case: Case) -> None:
    """Determinism within one process: fresh planners (fresh cost-model caches) give the same
    bytes for the same seed, batch and cost model."""
    limit = limit_for(case)
    try:
        first = plan_bytes(case, limit)
    except MemoryLimitError:
        with pytest.raises(MemoryLimitError):
            plan_bytes(case, limit)
        return
    assert plan_bytes(case, limit) == first


# -- regressions and fixed cases ----------------------------------------------------------------


def test_infeasible_memory_limit_raises_a_clear_error() -> None:
    # Regression: when no recompute choice fit, the planner returned the overcommitted schedule
    # without a word (found by the property test: one rank, one 1-token sample).
    case = tiny_case()
    with pytest.raises(MemoryLimitError, match=r"rank \d+: .*GiB"):
        case.planner(1.0).plan_batch(case.batch)


def test_non_strict_planner_returns_a_flagged_plan(caplog) -> None:
    # Simulation studies (strict_memory=False) still get a plan to score, marked and logged.
    case = tiny_case(strict_memory=False, megatron_candidate=False)
    with caplog.at_level("WARNING", logger="megatron_dip.planner.dip"):
        (rp,) = case.planner(1.0).plan_batch(case.batch)
    assert rp.overcommitted and "overcommits activation memory" in caplog.text
    check_plan(rp.plan, case.cost_model(), [1.0, 1.0], overcommitted=True)
    (free,) = case.planner(None).plan_batch(case.batch)
    assert not free.overcommitted
    strict = tiny_case(optimize_memory=False, megatron_candidate=False)
    with pytest.raises(MemoryLimitError, match="without recomputation"):
        strict.planner(1.0).plan_batch(strict.batch)


def test_binding_limit_is_met_with_recomputation() -> None:
    case = tiny_case(memory_fraction=0.5)
    limit = limit_for(case)
    (rp,) = case.planner(limit).plan_batch(case.batch)
    check_plan(rp.plan, case.cost_model(), [limit, limit])
    assert any(
        isinstance(i, Forward) and i.memory.method is not Recompute.NONE
        for p in rp.plan.programs
        for i in p.instructions
    )


def test_text_to_video_sample_needs_exactly_one_clip() -> None:
    # The runtime conditions clip i on caption i; a sample with two clips used to get
    # dependencies the runtime's messages could not satisfy.
    model = MultimodalSpec("t2v", (t2v_encoder(), dit_module()))
    bad = SampleMeta(3, 10, {"dit": InstanceCounts((8, 8), (), (1, 1))})
    with pytest.raises(ValueError, match=r"samples \[3\] do not hold exactly one clip"):
        split_microbatch(model, [bad], index=0, seq_length=SEQ, sub_sizes={"text": 1, "dit": 1})


def test_sequence_parallel_needs_seq_length_divisible_by_tp() -> None:
    # The LLM sequence used to be padded past --seq-length, which the runtime then rejected.
    model = tiny_case().model
    with pytest.raises(ValueError, match="multiple of the tensor-parallel size 4"):
        split_microbatch(
            model,
            [vlm_meta(0, 10)],
            index=0,
            seq_length=50,
            sub_sizes={"vit": 1},
            pad_multiple=4,
        )


@pytest.mark.parametrize("kind", ["vlm", "t2v"])
def test_layout_split_is_the_planners_split(kind: str) -> None:
    """`batching.split_samples` splits samples with arrays exactly as the planner splits their metadata
    (one definition of sub-microbatches and dependencies)."""
    from megatron_dip.batching import cross_module_dependencies, split_samples
    from megatron_dip.data.meta import sample_meta
    from megatron_dip.data.synthetic import generate_samples
    from megatron_dip.modelspec import tiny_t2v, tiny_vlm

    model = tiny_vlm() if kind == "vlm" else tiny_t2v()
    mix = "mixed" if kind == "vlm" else "t2v"
    samples = generate_samples(mix, model=model, num_samples=7, seed=5, scale=0.02)
    metas = [sample_meta(s, model=model) for s in samples]
    seq = 64 * -(-sum(m.text_tokens for m in metas) // 64)
    for size in (1, 2, 3):
        sizes = {m.name: size for m in model.modules if m.kind != "llm"}
        subs = split_samples(
            model, samples, microbatch=2, seq_length=seq, sizes=sizes, pad_multiple=2
        )
        work = split_microbatch(
            model, metas, index=2, seq_length=seq, sub_sizes=sizes, pad_multiple=2
        )
        assert subs == work.submicrobatches
        assert cross_module_dependencies(model, subs) == work.dependencies
    whole = split_samples(model, samples, microbatch=0, seq_length=seq)
    assert [s.index for s in whole] == [0] * len(model.modules)  # default: one per module


# -- determinism across processes ---------------------------------------------------------------


def test_planning_is_deterministic_across_processes() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); "
        "from planner_cases import planning_digest; print(planning_digest())"
    )
    digests = []
    for hash_seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=os.path.dirname(here),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        digests.append(out.stdout.split()[-1])
    assert digests[0] == digests[1] == planning_digest()


# -- paper scale (slow) ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not FUZZ, reason="paper-scale planning; run with --fuzz")
@fuzz_timeout
@pytest.mark.parametrize(("setup_name", "mixture"), [("vlm-s", "mixed"), ("t2v-s", "t2v")])
@pytest.mark.parametrize("seed", [0, 1])
def test_paper_scale_plans_hold_the_properties(setup_name: str, mixture: str, seed: int) -> None:
    """The paper's setups and data mixes, under the device's real activation budget: the plans
    hold every property above and planning them again gives the same bytes."""
    from megatron_dip.data.stream import BatchStream, StreamConfig
    from megatron_dip.data.synthetic import SyntheticSource
    from megatron_dip.modelspec import PAPER_SETUPS
    from megatron_dip.planner.compare import Comparison, packing_limits

    setup = PAPER_SETUPS[setup_name]
    device = get_device("H800")
    cost = CostModel(setup.model, device, shape=setup.shape)
    stream = BatchStream(
        SyntheticSource(mixture, model=setup.model, seed=seed),
        config=StreamConfig(
            seed=seed,
            batch_microbatches=setup.global_batch_microbatches,
            limits=packing_limits(setup.model, setup.seq_length),
        ),
    )
    search = SearchConfig(max_rollouts=8, time_budget_s=3600.0, seed=seed)
    cmp = Comparison.create(setup, cost, device=device, calibration=stream.peek(1), search=search)
    batch = next(stream)
    limits = cmp.memory(cmp.dip_placement)
    digests = []
    for _ in range(2):
        try:
            replicas = cmp.planner(strict_memory=True).plan_batch(batch)
        except MemoryLimitError as err:  # a clear refusal is allowed; a silent overcommit not
            digests.append(str(err))
            continue
        for rp in replicas:
            check_plan(rp.plan, cost, limits)
        digests.append(hashlib.sha256(b"".join(plan_to_bytes(r.plan) for r in replicas)).digest())
    assert digests[0] == digests[1]
