"""Training end to end on 4 gloo processes (one launch, several runs; see test_training_scenarios).

* DIP at PP=2 x DP=2 with the planner process trains 20 iterations and the loss falls;
  evaluation runs forward-only plans; traces and checkpoints are written.
* Resume is exact: iterations 4-6 after loading the iteration-3 checkpoint equal the
  uninterrupted run's; the same checkpoint loaded at PP=4 (another placement, DP=1) gives
  the same iteration-4 loss.
* Megatron-Core's own 1F1B (PP=4) and interleaved (PP=2 x DP=2) schedules give the same
  first-iteration loss as DIP on the same data and weights; with recomputation in the stages
  and the DP reduction overlapped (Megatron's DDP hooks) they train exactly as without.
* Evaluation resumes its stream: evaluations after a resume equal the uninterrupted run's.
* Checkpoints are Megatron-Core dist_checkpointing's torch_dist, keyed globally: they load
  under another placement (PP=2 x DP=2 -> PP=4), another schedule (DIP -> Megatron's 1F1B and
  back), with or without --use-distributed-optimizer (gloo, DP=2: it trains as the plain
  optimizer; its checkpoints resume exactly and load without it, and the plain ones with it),
  and at another TP (PP=2 x TP=2 loads at TP=1); DIP's 20-iteration run saves them in the
  background (--async-save).
* A checkpoint with flipped bytes in a shard file stops every rank with the same one-line error
  naming the file, and nothing is written; a loss that is NaN from the first iteration stops the
  run at iteration 3 (--dip-max-nonfinite-iters' default), naming the iterations.
* In-run calibration: the cost model's error falls after the first window; the calibration is
  identical on every rank and restored from the checkpoint.
* Planner faults: killed, slow, raising, stopped (SIGSTOP: found by its heartbeat, killed) planner
  processes. Each run completes on rank 0's shared fallback plans where the planner had none,
  restarts a dead planner, logs what happened, and its losses equal those of a run without a
  planner process (up to the accumulation order of the fallback plans), the same on every rank.
* The host-overhead measurement (`benchmark.overhead`) times zero-sleep emulated DIP and 1F1B
  iterations on the training's own step.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from pathlib import Path

import pytest
from distributed_harness import run_world
from hf_models import save_llama, save_qwen2_vl

pytestmark = pytest.mark.distributed

RTOL = 1e-5  # float32; plans of different runs may accumulate gradients in another order


def _with_undecodable_first_sample(directory) -> str:
    """A tiny LLaVA dataset whose first training sample's image is damaged past its header."""
    from test_training_faults import corrupt_png_pixels

    from megatron_dip.batching import packing_limits
    from megatron_dip.data.tiny_llava import make_tiny_llava_sample
    from megatron_dip.modelspec import tiny_vlm
    from megatron_dip.training.config.data_source import DataSpec, make_stream

    path = make_tiny_llava_sample(directory, num_samples=16, seed=1)
    model = tiny_vlm()
    spec = DataSpec.parse(f"llava:{path}", scale=1.0, image_size=32)
    stream = make_stream(
        spec, model, seed=7, global_batch_size=4, limits=packing_limits(model, 128)
    )  # as the run's, `COMMON`'s seed
    first = stream.dataset_index(next(stream).samples[0].sample_id)
    corrupt_png_pixels(directory / "images" / f"{first:04d}.png")
    return str(path)


def _energon_with_hf_tokenizer(directory) -> tuple[str, str]:
    """A tiny LLaVA dataset whose captions hold '"' and '!' (ids 1 and 0 of a byte-level BPE,
    the byte tokenizer's IMAGE and PAD), converted to Energon; and a BPE trained on its text."""
    import json

    from megatron_dip.data.energon_write import write_llava_energon
    from megatron_dip.data.tiny_llava import make_tiny_llava_sample
    from megatron_dip.data.tiny_tokenizer import make_tiny_tokenizer

    path = make_tiny_llava_sample(directory / "llava", num_samples=64, seed=2)
    records = json.loads(path.read_text())
    for r in records:
        answer = r["conversations"][1]
        first, *rest = answer["value"].split(" ", 1)
        answer["value"] = f'{first} "{rest[0]}"!' if rest else f'"{first}"!'
    path.write_text(json.dumps(records))
    texts = [t["value"] for r in records for t in r["conversations"]]
    tokenizer = make_tiny_tokenizer(directory / "tokenizer", texts)
    write_llava_energon(path, directory / "energon", samples_per_shard=10)
    return str(directory / "energon"), str(tokenizer)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    from megatron_dip.data.tiny_llava import make_tiny_llava_sample

    tmp = tmp_path_factory.mktemp("training")
    data = make_tiny_llava_sample(tmp / "llava", num_samples=64, seed=0)
    bad = _with_undecodable_first_sample(tmp / "llava_bad")
    energon, tokenizer = _energon_with_hf_tokenizer(tmp)
    save_llama(tmp / "hf_llama", tied=False, layers=4)
    save_qwen2_vl(tmp / "hf_qwen2_vl", image_token=1)  # the byte tokenizer's image id
    return run_world(
        world_size=4,
        target="test_training_scenarios:world4",
        kwargs={
            "data": str(data),
            "tmp": str(tmp),
            "bad_data": str(bad),
            "energon": energon,
            "tokenizer": tokenizer,
            "hf_llama": str(tmp / "hf_llama"),
            "hf_qwen2_vl": str(tmp / "hf_qwen2_vl"),
        },
        timeout=600,
        daemon=False,  # rank 0 starts the planner process
    )


def test_dip_loss_falls_over_20_iterations(world):
    losses = world[0]["dip"]["losses"]
    assert sorted(losses) == list(range(1, 21))
    first, last = [losses[i] for i in (1, 2, 3)], [losses[i] for i in (18, 19, 20)]
    assert max(last) < min(first) - 0.3, losses
    # every rank computed the same global loss
    for res in world[1:]:
        assert res["dip"]["losses"] == pytest.approx(losses, rel=1e-12)


def test_dip_run_evaluates_traces_and_checkpoints(world):
    dip = world[0]["dip"]
    assert sorted(dip["eval"]) == list(range(2, 21, 2))
    assert all(2.0 < v < 6.0 for v in dip["eval"].values())
    assert world[0]["trace_files"] == ["iteration_0000010.json", "iteration_0000020.json"]
    assert world[0]["trace_processes"] == sorted(
        f"{kind} rank {r}" for kind in ("planned", "measured") for r in (0, 1)
    )
    assert world[0]["trace_spans"] > 20
    assert "iter_0000003" in world[0]["ckpt_dirs"] and "iter_0000020" in world[0]["ckpt_dirs"]
    assert not any(d.endswith((".tmp", ".old", ".unverified")) for d in world[0]["ckpt_dirs"])
    assert sum(dip["variants"].values()) == 20
    assert all(0.0 < b <= 1.0 for b in dip["bound"].values())


def test_resume_from_checkpoint_is_exact(world):
    full, resumed = world[0]["dip"]["losses"], world[0]["resume"]["losses"]
    assert world[0]["resume"]["first"] == 3 and sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        assert resumed[it] == pytest.approx(full[it], rel=RTOL)
    # the consumed-samples counter continues across the resume (the log line shows it)
    assert world[0]["resume"]["consumed"] == {it: world[0]["dip"]["consumed"][it] for it in resumed}
    # evaluation continues the evaluation stream saved at iteration 3 (after the one at 2)
    full_eval, resumed_eval = world[0]["dip"]["eval"], world[0]["resume"]["eval"]
    assert sorted(resumed_eval) == [4, 6]
    for it in (4, 6):
        assert resumed_eval[it] == pytest.approx(full_eval[it], rel=RTOL)
    assert full_eval[4] != pytest.approx(full_eval[2], rel=1e-3)  # other batches, other loss


def test_checkpoint_of_pp2_dp2_loads_at_pp4(world):
    relayout = world[0]["relayout"]["losses"]
    assert sorted(relayout) == [4]
    assert relayout[4] == pytest.approx(world[0]["dip"]["losses"][4], rel=RTOL)


@pytest.mark.parametrize(("bf16", "fp32"), [("bf16_pp2", "dip"), ("bf16_pp1", "fp32_pp1")])
def test_bf16_trains_within_2_percent_of_float32(world, bf16, fp32):
    """--bf16 on the CPU: Megatron's Float16OptimizerWithFloat16Params (fp32 master weights,
    clipping at --clip-grad 1), bf16 weights, activations and pipeline messages; the loss stays
    within 2% of the float32 run's at each of 10 iterations and falls."""
    low, full = world[0][bf16]["losses"], world[0][fp32]["losses"]
    assert sorted(low) == list(range(1, 11))
    for it in range(1, 11):
        assert low[it] == pytest.approx(full[it], rel=0.02), (it, low, full)
    assert low[10] < low[1] - 0.5, low
    # Not the float32 numbers: the run really computed in bfloat16.
    assert any(abs(low[it] - full[it]) > 1e-4 * full[it] for it in range(2, 11))
    norms = world[0][bf16]["grad_norms"]
    assert sorted(norms) == list(range(1, 11)) and all(0 < n < 100 for n in norms.values())
    for res in world[1:]:
        assert res[bf16]["losses"] == pytest.approx(low, rel=1e-12)


def test_bf16_resume_restores_the_fp32_master_weights(world):
    """A bf16 checkpoint holds the fp32 master weights: resuming at iteration 5 continues the
    uninterrupted run exactly (restarting from the bf16 weights would not)."""
    full, resumed = world[0]["bf16_pp2"]["losses"], world[0]["bf16_pp2_resume"]["losses"]
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    for it in resumed:
        assert resumed[it] == pytest.approx(full[it], rel=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_stock_schedule_first_loss_equals_dip(world, schedule):
    stock = world[0][schedule]
    assert stock["variants"] == {schedule: len(stock["losses"])}
    assert stock["losses"][1] == pytest.approx(world[0]["dip"]["losses"][1], rel=RTOL)


def test_placement_searched_at_start_up_trains_like_the_preset_placement(world):
    """`--dip-segments auto` (here a static Megatron placement wins on the tiny model) trains
    with DIP's plans, planner process included, to the preset placement's first loss."""
    auto = world[0]["auto_placement"]
    assert sorted(auto["losses"]) == [1, 2] and sum(auto["variants"].values()) == 2
    assert auto["losses"][1] == pytest.approx(world[0]["dip"]["losses"][1], rel=RTOL)


def test_calibration_lowers_the_cost_model_error_and_survives_checkpoints(world):
    """The data-sheet (H100) cost model predicts these CPU timings ~10^4 times too fast.
    Iteration 1 is warm-up (not observed), so the default window of 8 updates at iterations 9
    and 17; from then on the calibrated model's total is within a small factor (the shared,
    oversubscribed CPUs make single iterations swing 2-3x, hence the median). Every rank holds
    the same calibration and plans with the same version; the frozen resume keeps exactly the
    iteration-3 checkpoint's state (partial window included)."""
    dip = world[0]["dip"]
    errors, ratios = dip["cost_error"], dip["cost_ratio"]
    assert sorted(errors) == sorted(ratios) == list(range(1, 21))
    assert all(errors[i] > 0.99 and ratios[i] < 1e-2 for i in range(1, 10)), ratios
    after = [abs(math.log(ratios[i])) for i in range(10, 21)]
    assert statistics.median(after) < math.log(3.0), ratios
    cal = dip["calibration"]
    assert cal["version"] == 2 and cal["count"] == 3 and set(cal["scales"]) == {"vit", "llm"}
    # a plan is never newer than the calibration in force (it may be older: planned ahead)
    assert all(0 <= v <= (i >= 10) + (i >= 18) for i, v in dip["plan_calibration"].items())
    for rank in world[1:]:
        assert rank["dip"]["calibration"] == cal
        assert rank["dip"]["plan_calibration"] == dip["plan_calibration"]
    saved = world[0]["ckpt3_calibration"]
    assert saved["version"] == 0 and saved["count"] == 2 and saved["measured_sum"]["llm"] > 0
    assert world[0]["resume"]["calibration"] == saved == world[0]["relayout"]["calibration"]


def test_diffusion_model_trains(world):
    losses = world[0]["t2v"]["losses"]
    assert sorted(losses) == [1, 2]
    assert all(0.0 < v < 10.0 for v in losses.values())


def test_three_modality_model_trains_with_falling_loss(world):
    """tiny-omni (ViT and audio encoder feeding the LLM) at PP=2 x DP=2 under DIP plans: the
    same loss on every rank, falling over 8 iterations (its synthetic words are learnable)."""
    losses = world[0]["omni"]["losses"]
    assert sorted(losses) == list(range(1, 9))
    assert all(res["omni"]["losses"] == losses for res in world)
    assert losses[8] < losses[1] - 0.2


def test_an_undecodable_image_on_some_ranks_stops_every_rank_together(world):
    """Only one replica's ranks load the damaged image; without agreeing on the outcome the
    other replica's ranks would wait for them in the pipeline forever."""
    errors = [res["decode"] for res in world]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert "samples failed to load, every rank stops" in errors[0]
    failed = sorted(int(r) for r in re.findall(r"rank (\d): LLaVA record", errors[0]))
    assert len(failed) == 2, errors[0]  # the two pipeline stages of one replica, not the other
    assert re.search(r"id 'tiny\d+', image 'images/\d+\.png'", errors[0])


def test_an_undecodable_image_in_skip_mode_is_named_once_and_the_run_goes_on(world):
    runs = [res["decode_skip"] for res in world]
    losses = runs[0]["losses"]
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert all(r["losses"] == losses for r in runs)
    named = [m for r in runs for m in r["log"] if m.startswith("skipping sample")]
    assert len(named) == 1, named  # by the first rank of the replica that loaded it
    assert re.search(r"id 'tiny\d+', image 'images/\d+\.png'.*cannot decode image 0", named[0])
    assert "no loss (--dip-bad-samples skip)" in named[0]
    lines = [m for m in runs[0]["log"] if "consumed samples" in m]
    assert "skipped samples: 1" in lines[0] and "skipped samples: 1" in lines[1], lines


def test_ranks_that_formed_different_batches_stop_together(world):
    errors = [res["disagree"] for res in world]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert "the ranks formed different batches" in errors[0]
    prints = [int(x) for x in re.search(r"by rank \[(.*)\]", errors[0]).group(1).split(",")]
    assert len(set(prints[:3])) == 1 and prints[3] != prints[0]


def test_the_start_up_sizing_runs_on_rank_0_and_reaches_every_rank(world):
    """The entry point's sizing step (placement search) is computed once, on rank 0, and its
    result, or its configuration error, reaches every rank."""
    for rank, res in enumerate(world):
        shared = res["shared_sizing"]
        assert shared["got"] == {"placement": "static:cost-split-v1", "by": 0}
        assert shared["calls"] == ([0] if rank == 0 else [])
        assert shared["error"] == "--dip-segments: refused on rank 0"
        if rank > 0:
            assert "did not arrive within 0.5 s (--distributed-timeout-minutes" in shared["late"]


@pytest.mark.parametrize("fault", ["killed", "slow", "raises", "stopped"])
def test_training_survives_a_faulty_planner_with_the_same_losses(world, fault):
    undisturbed = world[0]["undisturbed"]
    assert undisturbed["variants"] == {"inline": 5}
    run = world[0][fault]
    assert sorted(run["losses"]) == list(range(1, 6))
    # The planner process's plans are the undisturbed run's greedy plans; a late iteration runs
    # rank 0's fallback (Megatron's order on the placement): the same loss up to the order its
    # gradients accumulate in.
    assert run["losses"] == pytest.approx(undisturbed["losses"], rel=RTOL)
    for rank in world[1:]:  # every rank ran the same plans (the fallback made once, shared)
        assert rank[fault]["losses"] == run["losses"]
        assert rank[fault]["variants"] == run["variants"]
    assert sum(run["variants"].values()) == 5 and run["variants"].get("inline", 0) >= 1
    log = "\n".join(run["log"])
    assert "no plan ready from the planner; planned inline for every replica in" in log
    if fault == "slow":  # alive throughout: nothing to restart
        assert run["variants"] == {"inline": 5} and "restarting" not in log
        assert "planner restarts: 0" in log
        return
    # A stopped planner is found by the heartbeat check: silent past its timeout, or (when it
    # was stopped deep into a slow plan, on a loaded machine) busy past the progress limit.
    reasons = {
        "killed": ("was killed by signal 9",),
        "raises": ("failed with exit code 1",),
        "stopped": ("sent no heartbeat for", "made no progress for"),
    }[fault]
    assert any(f"planner process {r}" in log for r in reasons), log
    assert "restarting it (restart 1)" in log
    assert "planner restarts: 1" in log
    if fault == "killed":
        assert "injected fault: killing the planner process (iteration 2)" in log


def test_distributed_optimizer_checkpoints_are_exact_and_portable(world):
    """--use-distributed-optimizer on gloo (DP=2), per-token loss: 2 iterations + save + load +
    3 equal 5 uninterrupted iterations; its checkpoint continues with the plain optimizer at
    PP=1 x DP=4, whose checkpoint continues with the distributed optimizer again, and both
    updates (each from the other optimizer's moments) land on the uninterrupted losses."""
    distopt = world[0]["distopt"]["losses"]
    assert sorted(distopt) == [1, 2, 3, 4, 5]
    assert distopt[1] == pytest.approx(world[0]["dip"]["losses"][1], rel=RTOL)
    resumed = world[0]["distopt_resume"]["losses"]
    assert sorted(resumed) == [3, 4, 5]
    to_plain = world[0]["distopt_to_plain"]["losses"]
    back = world[0]["plain_to_distopt"]["losses"]
    assert sorted(to_plain) == [3] and sorted(back) == [4, 5]
    for run in (resumed, to_plain, back):
        for it, loss in run.items():
            assert loss == pytest.approx(distopt[it], rel=RTOL), (it, run)
    for rank in world[1:]:
        assert rank["distopt_resume"]["losses"] == pytest.approx(resumed, rel=1e-12)


def test_tensor_parallel_checkpoint_loads_at_another_tp(world):
    """PP=2 x TP=2 starts from the TP=1 weights; its iteration-3 checkpoint (full tensors,
    gated fc1 halves included, Adam moments too) continues at PP=2 x TP=1 x DP=2 with the
    losses of the TP=2 run."""
    tp2, tp1 = world[0]["tp2"]["losses"], world[0]["tp2_to_tp1"]["losses"]
    assert sorted(tp2) == [1, 2, 3, 4, 5] and sorted(tp1) == [4, 5]
    assert tp2[1] == pytest.approx(world[0]["dip"]["losses"][1], rel=RTOL)
    for it in (4, 5):
        assert tp1[it] == pytest.approx(tp2[it], rel=RTOL)


def test_stock_recompute_and_overlapped_reduction_keep_the_gradients(world):
    """Megatron's schedules with recomputation inside the stages (full at PP=2 x DP=2 with the
    DP reduction overlapped through Megatron's DDP hooks, Megatron's block recomputation; selective
    at PP=4) train exactly as the plain stock run (Megatron's interleaved schedule over 3 chunks
    per rank): same losses after one and two updates."""
    reference = world[0]["interleaved"]["losses"]
    overlap = world[0]["1f1b_overlap"]["losses"]
    assert sorted(overlap) == [1, 2, 3]
    for it in (1, 2, 3):
        assert overlap[it] == pytest.approx(reference[it], rel=RTOL)
    assert world[0]["1f1b"]["losses"][2] == pytest.approx(reference[2], rel=RTOL)


@pytest.mark.parametrize("name", ["emulated_dip", "emulated_interleaved"])
def test_emulated_runs_take_at_least_the_cost_model_time(world, name):
    """Emulated chunks sleep the cost model's times: no iteration can beat its simulated
    bubble-free bound; the metrics file holds the simulator's prediction of every iteration."""
    metrics = world[0][name]["metrics"]
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["emulate_scale"] == 3000.0 and m["predicted_s"] >= m["bound_s"] > 0
        assert m["schedule_seconds"] >= m["bound_s"] * 0.999, m
        assert math.isfinite(m["loss"])
    assert world[0][name]["losses"] == pytest.approx(world[1][name]["losses"], rel=1e-12)


def test_energon_data_with_a_hf_tokenizer_trains_and_resumes_exactly(world):
    """Megatron-Energon shards, a BPE tokenizer whose ids 0 and 1 are text (the captions hold
    them), DIP at PP=2 x DP=2: every rank computes the same finite losses, and the iteration-3
    checkpoint continues with the uninterrupted run's losses and evaluation (the data position of
    both streams restored)."""
    full, resumed = world[0]["energon"], world[0]["energon_resume"]
    assert sorted(full["losses"]) == list(range(1, 7)) and resumed["first"] == 3
    assert all(math.isfinite(v) and 0 < v < 10 for v in full["losses"].values())
    assert sorted(resumed["losses"]) == [4, 5, 6] and sorted(full["eval"]) == [2, 4, 6]
    for it in (4, 5, 6):
        assert resumed["losses"][it] == pytest.approx(full["losses"][it], rel=RTOL)
    for it in (4, 6):  # the evaluation stream continues after the evaluation at 2
        assert resumed["eval"][it] == pytest.approx(full["eval"][it], rel=RTOL)
    for rank in world[1:]:
        assert rank["energon"]["losses"] == pytest.approx(full["losses"], rel=1e-12)


def test_checkpoints_load_across_schedules(world):
    """Megatron's 1F1B at PP=4 saves at iteration 2; DIP at PP=2 x DP=2 continues it with
    1F1B's iteration-3 loss; 1F1B continues DIP's iteration-3 checkpoint with DIP's loss."""
    stock, dip = world[0]["1f1b"], world[0]["dip"]["losses"]
    assert [c.rsplit("/", 1)[1] for c in stock["checkpoints"]] == ["iter_0000002", "iter_0000003"]
    from_stock, from_dip = world[0]["dip_from_1f1b"], world[0]["1f1b_from_dip"]
    assert sorted(from_stock["losses"]) == [3] and sorted(from_dip["losses"]) == [4]
    assert from_stock["variants"] == {"inline": 1} and from_dip["variants"] == {"1f1b": 1}
    assert from_stock["losses"][3] == pytest.approx(stock["losses"][3], rel=RTOL)
    assert from_dip["losses"][4] == pytest.approx(dip[4], rel=RTOL)


def test_asynchronous_saves_are_published_complete(world):
    """DIP's run saves with --async-save every 3 iterations while training and evaluating;
    each save is published once complete (the resumes above load them), the last at the end."""
    names = [c.rsplit("/", 1)[1] for c in world[0]["dip"]["checkpoints"]]
    assert names == [f"iter_{i:07d}" for i in (3, 6, 9, 12, 15, 18, 20)]
    assert all(res["dip"]["checkpoints"] == world[0]["dip"]["checkpoints"] for res in world)


def test_a_corrupted_checkpoint_stops_every_rank_naming_the_file(world):
    errors = [res["corrupt"] for res in world]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert re.search(
        r"corrupt/iter_0000003/__\d+_\d+\.distcp: sha256 differs from the "
        r"manifest \(corrupted\)",
        errors[0],
    ), errors[0]
    assert "--ckpt-step" in errors[0] and "\n" not in errors[0]
    assert all(res["corrupt_untouched"] for res in world)  # but the --save lock, released:
    assert world[0]["corrupt_lock_released"]


def test_a_loss_that_stays_nan_stops_the_run(world):
    errors = [res["nonfinite"] for res in world]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0].startswith("iterations 1-3: loss nan")
    assert "(--dip-max-nonfinite-iters 3)" in errors[0]


def test_a_non_finite_streak_never_moves_the_tracker_to_poisoned_weights(world):
    """--lr 1e30 from iteration 3's checkpoint: iteration 4 (its weights) is finite, 5-7 are
    not; the checkpoints of 4, 5 and 6 never trained with a finite loss and stay unpublished;
    every rank's stop line names iteration 3's as the one to resume from (the 1-rank tests in
    test_checkpoint_training.py resume from it)."""
    errors = [res["streak"] for res in world]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0].startswith("iterations 5-7: loss "), errors[0]
    assert "The last verified checkpoint is " in errors[0], errors[0]
    assert "streak/iter_0000003 (iteration 3, its weights trained with a finite loss)" in errors[0]
    unpublished = [f"iter_{i:07d}.unverified" for i in (4, 5, 6)]
    assert errors[0].endswith(": " + ", ".join(unpublished)), errors[0]
    assert world[0]["streak_tracker"] == "3"
    assert world[0]["streak_dirs"] == [
        "iter_0000003",
        *unpublished,
        "latest_checkpointed_iteration.txt",
    ]


def test_a_save_that_fails_on_one_rank_is_one_line_on_every_rank(world):
    errors = [res["disk_full"] for res in world]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert re.fullmatch(
        r"saving \S+/full/iter_0000001\.tmp failed on rank 1: no space left on device \(ENOSPC\) "
        r"writing \S+/full/iter_0000001\.tmp; the partial iter_0000001\.tmp was removed; the "
        r"previous checkpoint and the tracker are unchanged",
        errors[0],
    ), errors[0]
    assert world[0]["disk_full_dirs"] == []


def test_a_second_job_on_one_save_directory_is_refused_naming_the_holder(world):
    errors = [res["locked"] for res in world]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert re.match(
        rf"--save \S+/locked: another job \(host \S+, pid {world[0]['holder']}, job "
        r"job-42, started [\d:\- ]+\) holds its lock",
        errors[0],
    ), errors[0]


def test_host_overheads_are_measured_on_the_training_step(world):
    """The overhead measurement ran DIP's and Megatron's zero-sleep emulated iterations: every
    rank got the same (slowest rank's) wall and CPU seconds, positive, for plans with work."""
    got = [w["overhead"] for w in world]
    assert all(g["seconds"] == got[0]["seconds"] for g in got)
    for (wall, cpu, compute), counts in zip((s[0] for s in got[0]["seconds"]), got[0]["counts"]):
        assert wall > compute > 0 and cpu > 0 and counts["compute"] > 0


def test_finetune_from_an_imported_hf_checkpoint_trains_from_iteration_0(world):
    """A Hugging Face Llama imported by 4 ranks at TP=2 x PP=2 (each reading its slices) and
    fine-tuned: iteration 0, falling loss; the same first loss at PP=1 x DP=4, and from the
    per-module flag; a different one from scratch (the weights were loaded)."""
    tuned = world[0]["finetune_tp2pp2"]
    assert tuned["first"] == 0 and sorted(tuned["losses"]) == list(range(1, 7))
    losses = tuned["losses"]
    assert losses[6] < losses[1] - 0.05, losses
    first = losses[1]
    assert world[0]["finetune_pp1"]["first"] == 0
    assert world[0]["finetune_pp1"]["losses"][1] == pytest.approx(first, rel=1e-5)
    assert world[0]["finetune_module"]["losses"][1] == pytest.approx(first, rel=1e-5)
    assert abs(world[0]["finetune_scratch"]["losses"][1] - first) > 1e-3
    # each rank read about a quarter of the LLM (its TP half of its PP half), not all of it
    read = [w["import_bytes"] for w in world]
    on_disk = sum(os.path.getsize(p) for p in Path(world[0]["hf_dir"]).glob("*.safetensors"))
    assert all(0 < r < 0.45 * on_disk for r in read), (read, on_disk)
    assert any("vit.pre.patch_embed.weight" in w["import_initialised"] for w in world)


def test_tied_embeddings_on_two_pipeline_ranks_train_as_in_one_chunk(world):
    """Tied LLM embeddings whose copies live on two pipeline ranks (DIP and Megatron's 1F1B)
    give the losses of the same model in one chunk: gradients summed, counted once in the norm,
    updated alike."""
    one = world[0]["tied_one_chunk"]["losses"]
    assert sorted(one) == [1, 2, 3]
    for name in ("tied_dip", "tied_1f1b"):
        assert world[0][name]["losses"] == pytest.approx(one, rel=1e-5), name


def test_an_imported_qwen2_vl_trains_alike_at_tp2_pp2_and_pp1(world):
    """Qwen2-VL (Conv3d patches, blocked 2-D rotary, M-RoPE) imported by 4 ranks: the same
    losses at TP=2 x PP=2 as at PP=1 x DP=4 over two iterations (the second after an update)."""
    tp2pp2, pp1 = world[0]["vl_tp2pp2"], world[0]["vl_pp1"]
    assert tp2pp2["first"] == pp1["first"] == 0 and sorted(pp1["losses"]) == [1, 2]
    assert tp2pp2["losses"] == pytest.approx(pp1["losses"], rel=1e-5)
