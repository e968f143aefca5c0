"""The GPU check's command: every part run (a failing part recorded, the others still run),
the report written as JSON and its table printed; the exit status says whether all held."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .checks import (
    DTYPE_BYTES,
    MODELS,
    environment,
    memory_check,
    offload_check,
    overhead_check,
    pending_weight_check,
    profile_check,
    split_backward_check,
    training_check,
)
from .report import table

logger = logging.getLogger("megatron_dip.gpu_check")


def _part(report: dict, name: str, run: Callable[[], object]) -> None:
    """Run one part into `report[name]`; a failure is recorded (with its traceback), not raised."""
    try:
        report[name] = run()
    except Exception as e:  # every part runs whatever the others did
        logger.error("gpu check part %s failed: %s", name, e)
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["failed"].append(name)


def _single_rank_world(cuda: bool, work: Path) -> None:
    """The one-rank process group the runs share (NCCL on a GPU, gloo else), its rendezvous
    file in `work` (a directory of its own would be left behind in the system's temp)."""
    if dist.is_initialized():
        return
    store = work / "rendezvous"
    store.unlink(missing_ok=True)  # a file store left by an earlier check would be reused
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )


def run_checks(
    *,
    out: Path,
    iterations: int,
    models,
    profiles: Path | None,
    flags=(),
    microbatches: int = 2,
    dtype: str = "bfloat16",
) -> dict:
    """Every part (module docstring); the report also written to `out/gpu_check.json`.
    `flags`: more training flags; `microbatches`: of the memory part; `dtype`: of training and
    memory (float32 makes the CPU test fast: bf16 matrix products are slow on most CPUs)."""
    cuda = torch.cuda.is_available()
    if not cuda:  # tiny tensors gain nothing from threads; spinning ones on shared cores cost
        torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    _single_rank_world(cuda, work)
    report: dict = {"failed": [], "cuda": cuda, "dtype": dtype}
    flags = [*flags, *(["--bf16"] if dtype == "bfloat16" else [])]
    _part(report, "environment", lambda: environment(cuda))
    _part(
        report,
        "training",
        lambda: training_check(models, iterations=iterations, cuda=cuda, work=work, flags=flags),
    )
    _part(
        report,
        "memory",
        lambda: memory_check(models, cuda=cuda, microbatches=microbatches, dtype=dtype),
    )
    _part(report, "overhead", lambda: overhead_check(work))
    _part(report, "offload", lambda: offload_check(cuda))
    _part(
        report,
        "split_backward",
        lambda: split_backward_check(
            models[0], iterations=iterations, cuda=cuda, work=work, flags=flags
        ),
    )
    _part(
        report,
        "pending_weight",
        lambda: pending_weight_check(models[0], cuda=cuda, microbatches=microbatches, dtype=dtype),
    )
    if profiles is not None:
        _part(report, "profile", lambda: profile_check(profiles))
    training = report.get("training", {})
    if isinstance(training, dict) and not all(m["ok"] for m in training.get("models", {}).values()):
        report["failed"].append("training")
    for name in ("split_backward", "pending_weight"):
        part = report.get(name, {})
        if isinstance(part, dict) and part.get("ok") is False:
            report["failed"].append(name)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def main(argv=None) -> int:
    """Command line (module docstring): 0 when every part ran and every check held."""
    p = argparse.ArgumentParser(
        description="The checks that only a GPU can answer, on one GPU, in one command."
    )
    p.add_argument("--out", required=True, type=Path, help="where gpu_check.json goes")
    p.add_argument("--iterations", type=int, default=5, help="training iterations per run (>= 2)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated run presets")
    p.add_argument("--profiles", type=Path, default=None, help="profile_gpu.sh's output folder")
    p.add_argument(
        "--train-args", default="", help="more training flags for every run, e.g. a smaller batch"
    )
    p.add_argument("--memory-microbatches", type=int, default=2, help="of the memory part")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES), help="of every part")
    args = p.parse_args(argv)
    if args.iterations < 2:
        p.error("--iterations: at least 2 (the first iteration warms up)")
    models = tuple(m for m in args.models.split(",") if m)
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"--models: {unknown} are not among {list(MODELS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("megatron", "megatron_dip.training"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    report = run_checks(
        out=args.out,
        iterations=args.iterations,
        models=models,
        profiles=args.profiles,
        flags=shlex.split(args.train_args),
        microbatches=args.memory_microbatches,
        dtype=args.dtype,
    )
    print(table(report), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if report["failed"] else 0
