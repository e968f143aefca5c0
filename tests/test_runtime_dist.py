"""The runtime on several gloo processes: exact gradients under every kind of plan and layout.

Two process launches in total (2 and 4 ranks, module-scoped fixtures); each runs every scenario
of its world size in sequence (`test_runtime_scenarios.py`) and returns per-rank numbers: the
gradient of every parameter by global name, loss reports, the normalised objective, buffers left
over, recompute counts and data-parallel reduction points. Rank 0 also returns the single-process,
non-pipelined reference (`megatron_dip.reference`), computed with the dense-mask attention the
packed-sequence attention replaced (`attention_reference.dense_reference`): every plan, TP2 and
sequence-parallel run of the packed path is compared with it. Models are tiny and fp64, so
"close" means rtol 1e-9 plus an atol of 1e-11 times the parameter gradient's largest magnitude.
The PP=2 launch ends with the failure scenarios (`test_runtime_faults.py`): a bad plan on one
rank, plans of different iterations, a stalled rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed_harness import run_world

pytestmark = pytest.mark.distributed

RTOL, ATOL = 1e-9, 1e-11


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_world(world_size=2, target="test_runtime_faults:world2", timeout=270)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_world(world_size=4, target="test_runtime_scenarios:world4", timeout=300)


def _expected_shard(full: np.ndarray, shard) -> np.ndarray:
    from megatron_dip.models.init import shard_for_rank

    dim, glu, tp_rank, tp_size = shard

    class _P:  # the attributes shard_for_rank reads
        tensor_model_parallel = True
        partition_dim = dim

    out = shard_for_rank(torch.from_numpy(full), _P(), tp_rank=tp_rank, tp_size=tp_size, glu=glu)
    return out.numpy()


def check_grads(results: list[dict], name: str, ranks=None) -> float:
    """Assert every parameter's gradient (on every rank holding it) matches the reference;
    return the largest error relative to the parameter's largest reference gradient."""
    ref = results[0][f"ref:{_kind(name)}"]["grads"]
    seen, worst = set(), 0.0
    for r in ranks if ranks is not None else range(len(results)):
        for pname, (grad, shard) in results[r][name]["grads"].items():
            full = ref[pname]
            want = full if shard is None else _expected_shard(full, shard)
            scale = float(np.abs(full).max())
            np.testing.assert_allclose(
                grad, want, rtol=RTOL, atol=ATOL * scale, err_msg=f"{name}: {pname} on rank {r}"
            )
            worst = max(worst, float(np.abs(grad - want).max()) / max(scale, 1e-300))
            seen.add(pname)
    assert seen == set(ref), f"{name}: gradients missing for {sorted(set(ref) - seen)[:5]}"
    assert all(np.abs(g).max() > 0 for g in ref.values()), "a parameter gets no gradient at all"
    return worst


def check_loss(results: list[dict], name: str, ranks=None) -> None:
    total = sum(results[r][name]["objective"] for r in ranks or range(len(results)))
    assert total == pytest.approx(results[0][f"ref:{_kind(name)}"]["loss"], rel=1e-12)


def _kind(name: str) -> str:
    """The batch a scenario ran ("vlm", "omni", "t2v" or "t2v-frozen"), from its name."""
    if "t2vfrozen" in name:
        return "t2v-frozen"
    return next(k for k in ("vlm", "omni") if k in name) if "t2v" not in name else "t2v"


def check_clean(results: list[dict], name: str) -> None:
    for r, res in enumerate(results):
        if name in res and "leftovers" in res[name]:
            assert not any(res[name]["leftovers"].values()), f"{name} rank {r}: buffers left"


def reports(results: list[dict], name: str) -> np.ndarray:
    found = [res[name]["reports"] for res in results if res[name]["reports"]]
    assert len(found) == 1, f"{name}: exactly one rank holds the loss"
    return np.array(found[0])


# -- PP=2 -----------------------------------------------------------------------------------------

PIPELINE = [
    "vlm_seg_v1",
    "vlm_seg_v2_rc",
    "t2v_seg_v2_rc",
    "vlm_dip",
    "t2v_dip",
    "vlm_dip_static",
    "omni_seg_rc",
    "omni_dip",
    "vlm_split",
    "t2v_split",
    "omni_split",
]


@pytest.mark.parametrize("name", PIPELINE)
def test_pp2_plans_give_reference_gradients(world2, name):
    """Segment plans (1 and 2 chunks per rank per module, unequal sub-microbatches, the three
    recompute modes, batched/unbatched/tagged p2p, debug mode) and searched DIP plans."""
    check_grads(world2, name)
    check_loss(world2, name)
    check_clean(world2, name)


def test_searched_plans_use_submicrobatches_and_recompute(world2, world4):
    for results, prefix in ((world2, ""), (world4, "pp4_")):
        for kind in ("vlm", "t2v", "omni"):
            counts = [res[f"{prefix}{kind}_dip"]["recompute"] for res in results]
            assert sum(v for c in counts for k, v in c.items() if k != "none") > 0
            assert sum(c.get("none", 0) for c in counts) > 0


@pytest.mark.parametrize(
    ("ours", "stock"),
    [
        ("vlm_meg_interleaved", "vlm_stock_interleaved"),
        ("t2v_meg_1f1b", "t2v_stock_1f1b"),
        ("omni_meg_1f1b", "omni_stock_1f1b"),
    ],
)
def test_pp2_megatron_orders_match_megatron_and_reference(world2, ours, stock):
    """Megatron's orders as plans, on our executor, vs. Megatron-Core's own unmodified
    schedule functions on the same chunks and data: same gradients, same loss reports."""
    check_grads(world2, ours)
    check_grads(world2, stock)
    np.testing.assert_allclose(reports(world2, ours), reports(world2, stock), rtol=1e-12)


def test_sent_outputs_are_freed_and_the_held_peak_drops(world2, world4):
    """Two chunks per rank per module: with sent outputs freed once their sends completed (data
    a placeholder, autograd graph kept) every rank's activation peak is lower than with them
    kept until their backward, and the gradients are still
    the reference's; every pipeline scenario ran with them freed (the checks above)."""
    for results, prefix in ((world2, ""), (world4, "pp4_")):
        kept, freed = f"{prefix}held_vlm_kept", f"{prefix}held_vlm_freed"
        check_grads(results, freed)
        check_loss(results, freed)
        for res in results:
            assert res[kept]["freed_bytes"] == 0
            assert res[freed]["peak"] <= res[kept]["peak"]
        lower = [res[freed]["peak"] < res[kept]["peak"] for res in results]
        sent = [res[freed]["freed_bytes"] > 0 for res in results]
        assert all(sent) and lower == sent  # every rank sends to the next chunk's rank
        assert results[0][f"{prefix}vlm_seg_v1"]["freed_bytes"] > 0  # the default


# What a rank holds at its peak against the simulator's memory model of the plan: the LLM's last
# chunk on the CPU keeps up to ~2% more than modelled (`tests/test_memory_model.py` holds each
# chunk to 10%).
HELD_TOLERANCE = 0.03


def test_the_memory_model_gives_what_each_rank_holds_under_dip_plans(world2, world4):
    """DIP's plans as training runs them (receives posted one compute ahead on per-pair
    communicators, sent outputs freed, recomputation under the limit), VLM and T2V at PP2 and
    PP4: every rank's pipeline message buffers at their peak are the simulator's
    (`message_peaks`) to the byte, and all it holds at its peak (stored activations, buffers,
    the executor's own) is within `HELD_TOLERANCE` of the plan's modelled `activation_peaks`
    (priced with the kernels the CPU runs); the gradients are the reference's."""
    for results, prefix in ((world2, ""), (world4, "pp4_")):
        for kind in ("vlm", "t2v"):
            name = f"{prefix}held_{kind}_dip"
            check_grads(results, name)
            for rank, res in enumerate(results):
                held = res[name]
                assert held["message_peak"] > 0, (name, rank)
                assert held["message_peak"] == held["modelled_message_peak"], (name, rank)
                error = held["modelled_peak"] / held["peak"] - 1
                assert abs(error) < HELD_TOLERANCE, (name, rank, held)


def test_pp2_message_swap_would_be_silent_and_wrong(world2):
    """The PP=2 trap is live in this data: Megatron's batched p2p at PP=2 interleaved swaps
    activations and gradients of the same shape and silently gives other gradients. Our
    executor runs the same order, in which the channel rank 0 -> rank 1 carries activations
    AND gradients of identical shapes (a mismatch of order would swap them silently), and
    gives the reference gradients (test above)."""
    with pytest.raises(AssertionError):
        check_grads(world2, "vlm_stock_interleaved_batched")
    import test_runtime_setups as st
    from test_runtime_scenarios import vlm_microbatches

    from megatron_dip.schedule import Send

    batch = st.make_batch("vlm", vlm_microbatches())
    placement, units = st.stock_placement(batch.model, 2, vp=2)
    plan = st.megatron_plan(batch, placement, units, vp=2)
    for program in plan.programs:
        by_kind: dict = {}
        for ins in program.instructions:
            if isinstance(ins, Send):
                by_kind.setdefault(ins.key.kind, set()).add(ins.tensors)
        assert len(by_kind) == 2  # activations and gradients on the one channel to the peer
        assert set.intersection(*by_kind.values())  # ... with identical tensor specs


def test_mismatched_plans_are_rejected_on_every_rank_before_communicating(world2):
    place = [res["reject_placement"] for res in world2]
    assert [p["rejected"] for p in place] == ["PlanError", "PlanError"]
    assert "another placement" in place[0]["message"] and "llm" in place[0]["message"]
    shapes = [res["reject_shapes"] for res in world2]
    assert [s["rejected"] for s in shapes] == ["PlanError", "PlanError"]
    assert "float32" in shapes[0]["message"] and "instruction" in shapes[0]["message"]


# -- PP=4, PP=2 x TP=2, PP=2 x DP=2 ---------------------------------------------------------------


@pytest.mark.parametrize("name", [f"pp4_{n}" for n in PIPELINE])
def test_pp4_plans_give_reference_gradients(world4, name):
    check_grads(world4, name)
    check_loss(world4, name)
    check_clean(world4, name)


@pytest.mark.parametrize(
    ("ours", "stock"),
    [
        ("pp4_vlm_meg_interleaved", "pp4_vlm_stock_interleaved"),
        ("pp4_t2v_meg_1f1b", "pp4_t2v_stock_1f1b"),
        ("pp4_omni_meg_1f1b", "pp4_omni_stock_1f1b"),
    ],
)
def test_pp4_megatron_orders_match_megatron_and_reference(world4, ours, stock):
    check_grads(world4, ours)
    check_grads(world4, stock)
    np.testing.assert_allclose(reports(world4, ours), reports(world4, stock), rtol=1e-12)


@pytest.mark.parametrize(
    "name", ["tp2_vlm", "tp2_t2v", "tp2sp_vlm", "tp2sp_t2v", "tp2sp_vlm_split"]
)
def test_pp2_tp2_shards_match_reference(world4, name):
    """Tensor-parallel shards (column, row, vocabulary, gated fc1) of every parameter; "tp2sp_":
    with sequence parallelism (activations sharded along the sequence, sequence-parallel norm
    and row-bias gradients summed over the TP group by the runtime)."""
    check_grads(world4, name)
    check_loss(world4, name, ranks=[0, 2])  # the TP rank 0 of each pipeline rank
    check_clean(world4, name)
    marked = [res[name]["sequence_parallel_params"] for res in world4]
    if name.startswith("tp2sp_"):
        assert all(n > 0 for n in marked)  # norms (and row-parallel biases) of every rank
        sp_rows = {r for res in world4 for r in res[name]["hidden_rows"]}
        full_name = name.replace("tp2sp_", "tp2_").removesuffix("_split")
        full_rows = {r for res in world4 for r in res[full_name]["hidden_rows"]}
        assert sp_rows and max(sp_rows) * 2 == max(full_rows)  # sharded along the sequence
    else:
        assert not any(marked)


@pytest.mark.parametrize("name", ["dp2_vlm", "dp2_t2v", "dp2_omni", "dp2_vlm_split"])
def test_pp2_dp2_unequal_replicas_average_to_global_batch(world4, name):
    """Replica 0 holds 3 microbatches, replica 1 one (unequal tokens): after the DDP reduction
    every replica holds the single-process gradient of the whole global batch."""
    check_grads(world4, name)
    check_loss(world4, name)
    check_clean(world4, name)


@pytest.mark.parametrize("name", ["dp2_vlm", "dp2_t2v", "dp2_omni"])
def test_each_chunk_reduction_starts_at_its_own_last_backward(world4, name):
    from megatron_dip.runtime.gradsync import canonical_reduction_order
    from megatron_dip.schedule import ChunkSpec, ModuleLayout, Placement

    overlapped = 0
    for res in world4:
        got = res[name]["grad_sync"]
        last = res[name]["last_backward"]
        assert {tuple(k) for _, k in got} == set(last)
        modules = {"vlm": ("vit", "llm"), "omni": ("vit", "audio", "llm"), "t2v": ("text", "dit")}
        modules = modules[_kind(name)]
        layouts = tuple(
            ModuleLayout(
                m, 8, True, tuple(ChunkSpec(m, c, c % 2, 2 * c, 2 * c + 2) for c in range(4))
            )
            for m in modules
        )
        order = canonical_reduction_order(Placement(2, layouts), set(last))
        assert [tuple(k) for _, k in got] == order  # identical on every replica
        bound = -1
        for index, key in got:
            bound = max(bound, last[tuple(key)])
            assert index == bound  # right after its last backward (or its predecessor's start)
            overlapped += index < res[name]["length"] - 1
    assert overlapped > 0  # reductions overlap the rest of the schedule


def test_split_backwards_reduce_where_the_plan_says(world2, world4):
    """B/W-split plans: the frozen text encoder (no weight half) gives the reference gradients
    of the trainable DiT; at PP=2 x DP=2 each chunk's reduction starts at its ReduceGrads."""
    check_grads(world2, "t2vfrozen_split")
    check_loss(world2, "t2vfrozen_split")
    check_clean(world2, "t2vfrozen_split")
    for res in world4:
        got = res["dp2_vlm_split"]["grad_sync"]
        assert [tuple(k) for _, k in got] == [tuple(k) for _, k in res["dp2_vlm_split"]["reduce"]]
        assert [i for i, _ in got] == [i for i, _ in res["dp2_vlm_split"]["reduce"]]


def test_drop_in_installed_in_megatron_core_gives_reference_loss_and_gradients(world4):
    """DIP installed as Megatron-Core's schedule (`installed`) and called as Megatron-LM's
    `evaluate` and `train_step` call `get_forward_backward_func()` at PP=2 x DP=2: the
    reference gradients (the forward-only call before left them alone), the executor path's
    loss reports (the evaluation's too), Megatron's function restored afterwards; messages on
    per-pair channels; one timing span per compute instruction, in program order; and a plan
    that only replica 1 rejects is refused by replica 0 as well (the verdict is agreed over the
    replica group) before anything is sent."""
    name = "dropin_dp2_vlm"
    check_grads(world4, name)
    for res in world4:
        got = res[name]
        assert got["installed"] == [True, True] and got["restored"]
        assert got["timed"] == got["compute"] and len(got["spans"]) == len(got["compute"])
        assert got["eval_timed"] == got["eval_forwards"] > 0
        assert got["channels"] == ["per_peer_channel"] and got["messages"][1] > 0
    ours = [res[name]["reports"] for res in world4 if res[name]["reports"]]
    evaluated = [res[name]["eval_reports"] for res in world4 if res[name]["eval_reports"]]
    theirs = [res["dp2_vlm"]["reports"] for res in world4 if res["dp2_vlm"]["reports"]]
    assert len(ours) == 2  # one loss rank per replica
    np.testing.assert_allclose(np.concatenate(ours), np.concatenate(theirs), rtol=1e-12)
    np.testing.assert_allclose(np.concatenate(evaluated), np.concatenate(theirs), rtol=1e-12)
    rejected = [res[f"{name}_reject"] for res in world4]  # rank = 2 * replica + pp_rank
    assert [r["rejected"] for r in rejected] == ["PlanRejectedError"] * 2 + ["PlanError"] * 2
    for r, glob in zip(rejected[:2], (2, 3)):
        assert f"(global rank {glob})" in r["message"] and "float32" in r["message"]


# -- failures: agreed verdicts, timeouts (PP=2, after everything else) ----------------------------


def test_one_bad_rank_makes_every_rank_refuse_the_plan_before_communicating(world2):
    """Rank 1 alone holds a plan whose messages its model cannot produce; rank 0's plan is fine.
    Both refuse (rank 0 naming rank 1 and its reason). Plans of different iterations, each valid
    on its own, are refused by both. Neither sent anything: the next exchange on the pipeline
    group receives exactly the peer's tensor."""
    own, other = world2[1]["fault_one_bad_rank"], world2[0]["fault_one_bad_rank"]
    assert own["error"] == "PlanError" and "float32" in own["message"]
    assert other["error"] == "PlanRejectedError"
    assert "rank 1 rejected the plan" in other["message"] and "float32" in other["message"]
    for res in world2:
        stale = res["fault_other_iteration"]
        assert stale["error"] == "PlanRejectedError", stale
        assert "different plans" in stale["message"] and "iteration 1" in stale["message"]
    assert world2[0]["fault_ping"] == [11.0] * 3 and world2[1]["fault_ping"] == [10.0] * 3


def test_a_stalled_rank_makes_every_rank_fail_naming_instruction_peer_and_tensor(world2):
    """Rank 0 sleeps 5 s in its first Forward, the timeout is 2 s: rank 1 times out waiting for
    its activations (not for the stalled rank); rank 0, waking up, fails on its first send
    (peer gone) or its next wait. Nobody hangs."""
    import test_runtime_setups as st
    from test_runtime_faults import STALL_S, STALL_TIMEOUT_S
    from test_runtime_scenarios import vlm_microbatches

    from megatron_dip.schedule import Recv, Send, Wait

    vlm = st.make_batch("vlm", vlm_microbatches(), sizes={"vit": 2})
    plan = st.segment_plan(vlm, st.dip_placement(vlm.model, 2, {"vit": 1, "llm": 1}))
    waiting = world2[1]["fault_stall"]
    assert waiting["error"] == "PipelineTimeoutError", waiting
    assert (waiting["rank"], waiting["peer"], waiting["tensor"]) == (1, 0, "hidden")
    wait = plan.program(1).instructions[waiting["index"]]
    assert isinstance(wait, Wait) and waiting["key"] in [str(k) for k in wait.keys]
    text = waiting["message"]
    for part in (f"rank 1: instruction {waiting['index']}", "from peer rank 0", "'hidden'"):
        assert part in text
    assert waiting["key"] in text and f"timed out after {STALL_TIMEOUT_S:g} s" in text
    assert STALL_TIMEOUT_S <= waiting["seconds"] < STALL_S
    stalled = world2[0]["fault_stall"]
    assert stalled["error"] in ("PipelineCommError", "PipelineTimeoutError"), stalled
    assert (stalled["rank"], stalled["peer"]) == (0, 1) and stalled["tensor"] == "hidden"
    program = plan.program(0).instructions
    assert isinstance(program[stalled["index"]], Send | Recv | Wait)
    posted = {str(i.key) for i in program if isinstance(i, Send | Recv) and i.peer == 1}
    assert stalled["key"] in posted
    assert f"rank 0: instruction {stalled['index']}" in stalled["message"]
    assert stalled["seconds"] < STALL_S + 2 * STALL_TIMEOUT_S + 5


def print_held_table() -> None:
    """The activation peaks of `test_sent_outputs_are_freed_and_the_held_peak_drops`, per rank
    (`python tests/test_runtime_dist.py`; runs the PP=2 launch and the PP=4 part of the other)."""
    for size, results, prefix in (
        (2, run_world(world_size=2, target="test_runtime_faults:world2", timeout=1200), ""),
        (
            4,
            run_world(
                world_size=4, target="test_runtime_scenarios:world4", kwargs={"parts": ("pp",)},
                timeout=1200,
            ),
            "pp4_",
        ),
    ):  # fmt: skip
        for rank, res in enumerate(results):
            kept, freed = res[f"{prefix}held_vlm_kept"]["peak"], res[f"{prefix}held_vlm_freed"]
            print(
                f"PP={size} rank {rank}: kept {kept} B, freed {freed['peak']} B "
                f"({100 * (freed['peak'] - kept) / kept:+.2f}%), {freed['freed_bytes']} B freed"
            )


if __name__ == "__main__":
    print_held_table()
