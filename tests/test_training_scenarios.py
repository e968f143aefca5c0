"""Helpers, no tests: the training runs of `test_training_dist.py`, executed one after the other
inside the same 4 gloo worker processes (targets of `distributed_harness.run_world`)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from pathlib import Path

COMMON = [
    "--model", "tiny-vlm", "--global-batch-size", "4", "--dip-image-size", "32",
    "--lr", "3e-3", "--lr-decay-iters", "20", "--log-interval", "5", "--seed", "7",
]  # fmt: skip


def run(argv: list[str], *, world_size: int) -> dict:
    """Parse, validate and train one run on this rank; the numbers the tests compare."""
    from megatron_dip.training.arguments import parse_config
    from megatron_dip.training.loop import pretrain
    from megatron_dip.training.validate import resolve

    spec = resolve(parse_config(argv), world_size=world_size, cuda=False)
    result = pretrain(spec)
    return {
        "losses": dict(result.losses),
        "eval": dict(result.eval_losses),
        "seconds": dict(result.seconds),
        "planned": dict(result.planned),
        "bound": dict(result.bound_efficiency),
        "variants": dict(result.variants),
        "first": result.first_iteration,
        "last": result.last_iteration,
        "checkpoints": list(result.checkpoints),
    }


def world4(*, rank: int, world_size: int, data: str, tmp: str) -> dict:
    """DIP at PP=2 x DP=2 for 20 iterations with the planner process, checkpoints, evaluation and
    traces; then resume at iteration 3 (same layout and at PP=4); then the stock schedules."""
    # The harness's workers are daemonic, and daemonic processes may not start children; the
    # trainer's planner service is one (closed by the trainer at the end of each run).
    multiprocessing.current_process()._config["daemon"] = False
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("megatron_dip.planner.service").setLevel(logging.ERROR)
    ckpt, traces = os.path.join(tmp, "ckpt"), os.path.join(tmp, "traces")
    data_flags = ["--dip-data", f"llava:{data}"]
    base = COMMON + data_flags
    out = {}
    out["dip"] = run(
        base + [
            "--pipeline-model-parallel-size", "2", "--train-iters", "20",
            "--dip-lookahead", "2", "--dip-search-time-ms", "100",
            "--save", ckpt, "--save-interval", "3", "--eval-interval", "10", "--eval-iters", "2",
            "--dip-trace-dir", traces, "--dip-trace-interval", "10",
        ],
        world_size=world_size,
    )  # fmt: skip
    resume = ["--load", ckpt, "--ckpt-step", "3", "--dip-lookahead", "0"]
    out["resume"] = run(
        base + resume + ["--pipeline-model-parallel-size", "2", "--train-iters", "6"],
        world_size=world_size,
    )
    out["relayout"] = run(
        base + resume + ["--pipeline-model-parallel-size", "4", "--train-iters", "4"],
        world_size=world_size,
    )
    out["1f1b"] = run(
        base
        + ["--pipeline-model-parallel-size", "4", "--train-iters", "1", "--dip-schedule", "1f1b"],
        world_size=world_size,
    )
    out["interleaved"] = run(
        base + [
            "--pipeline-model-parallel-size", "2", "--train-iters", "1",
            "--dip-schedule", "interleaved",
        ],
        world_size=world_size,
    )  # fmt: skip
    out["t2v"] = run(
        ["--model", "tiny-t2v", "--pipeline-model-parallel-size", "2", "--train-iters", "2",
         "--lr", "1e-3", "--dip-lookahead", "0", "--global-batch-size", "2"],
        world_size=world_size,
    )  # fmt: skip
    if rank == 0:
        out["trace_files"] = sorted(p.name for p in Path(traces).glob("*.json"))
        events = json.loads(Path(traces, out["trace_files"][-1]).read_text())["traceEvents"]
        out["trace_processes"] = sorted(
            e["args"]["name"] for e in events if e.get("name") == "process_name"
        )
        out["trace_spans"] = sum(e.get("ph") == "X" for e in events)
        out["ckpt_dirs"] = sorted(p.name for p in Path(ckpt).iterdir())
    return out
