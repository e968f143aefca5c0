"""Measure the runtime's host overheads on this machine and write them for --dip-host-overheads.

    python tools/measure_overhead.py --preset vlm-s --out overheads.json

Runs the training's own step (DIP's executor through `DipStep`; Megatron-Core's stock 1F1B and
interleaved schedules through `run_stock`) on emulated chunks that sleep nothing, on one gloo
process per pipeline rank (torchrun), for DIP at several granularities (segments / sub-microbatch
sizes: different numbers of instructions, batches and messages) and the stock schedules at two
batch sizes. Then takes the seconds per compute instruction from the compute handlers' own spans and fits
the seconds per posted p2p batch and per message (and a constant per iteration) by least
squares against the simulator's zero-compute prediction of the same plans (`megatron_dip.benchmark.overhead.fit_overheads`), separately for DIP and for stock
Megatron, prints both with each plan's measured and fitted time, and writes the JSON
(`megatron-dip-host-overheads/1`) that `--dip-host-overheads` and `tools/bench_schedules.py
--host-overheads` load. `--profile-rank R --profile-dir D` also writes cProfile statistics of
rank R's measured iterations, one file per case.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dip.benchmark.bench import BENCH_PRESETS
from megatron_dip.benchmark.overhead import (
    OverheadCase,
    fit_overheads,
    make_case,
    measure_rank,
    plan_counts,
)
from megatron_dip.planner.overheads import OverheadsFile, save_overheads
from megatron_dip.planner.submicrobatch import split_modules
from megatron_dip.training.config.presets import get_run_preset

logger = logging.getLogger("measure_overhead")
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="vlm-s", choices=sorted(BENCH_PRESETS))
    p.add_argument("--mixture", default=None, help="synthetic mixture (default: the preset's)")
    p.add_argument("--global-batch-size", type=int, default=8, help="microbatches per plan")
    p.add_argument("--batches", type=int, default=2, help="plans (batches) per case")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per plan (median)")
    p.add_argument(
        "--granularity",
        action="append",
        default=None,
        metavar="SEGMENTS/SIZES",
        help="a DIP case, e.g. 'vit=1,llm=1/vit=32' (repeatable; default: coarse, medium and "
        "the cost model's own choice)",
    )
    p.add_argument("--no-stock", action="store_true", help="measure DIP only")
    p.add_argument("--profile-rank", type=int, default=None)
    p.add_argument("--profile-dir", type=Path, default=None)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--out", type=Path, default=Path("overheads.json"))
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def case_flags(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, flags) of every case: DIP at each granularity, then the stock schedules at the
    batch size and twice it."""
    preset = BENCH_PRESETS[args.preset]
    base = preset.base_flags(args.mixture)
    base += ["--dip-calibration-frozen", "--dip-lookahead", "0", "--dip-search-time-ms", "0"]
    gbs = args.global_batch_size
    model = get_run_preset(preset.name).model()
    grains = args.granularity or [
        f"{_every(model.modules, 1)}/{_every(split_modules(model), 32)}",
        f"{_every(model.modules, 2)}/{_every(split_modules(model), 8)}",
        "",  # the cost model's own choice
    ]
    out = []
    for grain in grains:
        segments, _, sizes = grain.partition("/")
        flags = [*base, "--global-batch-size", str(gbs), "--dip-schedule", "dip"]
        flags += ["--dip-segments", segments] if segments else []
        flags += ["--dip-sub-microbatch-size", sizes] if sizes else []
        out.append((f"dip {grain or 'automatic'}", flags))
    if not args.no_stock:
        for schedule in ("1f1b", "interleaved"):
            for size in (gbs, 2 * gbs):
                flags = [*base, "--global-batch-size", str(size), "--dip-schedule", schedule]
                out.append((f"{schedule} gbs={size}", flags))
    return out


def _every(modules, value: int) -> str:
    """ "vit=V,llm=V" for these modules."""
    return ",".join(f"{m.name}={value}" for m in modules)


def launch(args: argparse.Namespace, cases: list[OverheadCase], world: int) -> list[list]:
    """Run `measure_rank` on `world` torchrun processes; returns the measured (wall, CPU)
    seconds per case and plan."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "cases.pkl"
        job.write_bytes(
            pickle.dumps(
                {
                    "cases": cases,
                    "repeats": args.repeats,
                    "profile_rank": args.profile_rank,
                    "profile_dir": str(args.profile_dir) if args.profile_dir else None,
                }
            )
        )
        command = ["torchrun", "--standalone", "--nproc-per-node", str(world)]
        command += [str(Path(__file__).resolve()), "--worker", str(job)]
        logger.info("launching %s", shlex.join(command))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(command, cwd=ROOT, env=env, timeout=args.timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the measurement failed (exit {done.returncode})")
        return json.loads(job.with_suffix(".json").read_text())


def worker(job: Path) -> int:
    """Inside torchrun: measure every case on this rank; rank 0 writes the seconds."""
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron_dip").setLevel(logging.WARNING)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    task = pickle.loads(job.read_bytes())
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        seconds = measure_rank(
            rank=rank,
            world_size=dist.get_world_size(),
            cases=task["cases"],
            repeats=task["repeats"],
            profile_rank=task["profile_rank"],
            profile_dir=task["profile_dir"],
        )
        if rank == 0:
            job.with_suffix(".json").write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()
    return 0


def report(cases: list[OverheadCase], seconds: list[list]) -> tuple[dict, OverheadsFile]:
    """Fit DIP's and stock Megatron's overheads; the table lines and the file to write."""
    lines, details, fits = [], {"cases": []}, {}
    for kind in ("dip", "stock"):
        mine = [(c, s) for c, s in zip(cases, seconds) if c.stock == (kind == "stock")]
        points = [(p, c.channel, t[0]) for c, s in mine for p, t in zip(c.plans, s)]
        if len(points) < 2:
            continue
        # The compute handlers' own time, measured directly (median over the plans).
        per_instruction = statistics.median(t[2] for _, s in mine for t in s)
        fit = fits[kind] = fit_overheads(points, instruction=per_instruction)
        o = fit.overheads
        lines.append(
            f"{kind}: {o.instruction * 1e3:.3f} ms per compute instruction, {o.batch * 1e3:.3f} "
            f"ms per posted batch, {o.message * 1e3:.3f} ms per message, "
            f"{fit.constant * 1e3:.1f} ms per iteration; rms error {fit.rms_relative_error:.1%}"
        )
        k = 0
        for case, measured in mine:
            for plan, (t, cpu, _) in zip(case.plans, measured):
                counts = plan_counts(plan)
                per = 1e3 * cpu / max(1, counts["compute"])
                lines.append(
                    f"  {case.label:34} compute {counts['compute']:5d} p2p {counts['p2p']:5d}  "
                    f"measured {t:7.3f} s  fitted {fit.fitted[k]:7.3f} s "
                    f"({fit.relative_errors[k]:+.1%})  cpu {cpu:6.3f} s = {per:.2f} ms/compute"
                )
                details["cases"].append(
                    {
                        "label": case.label,
                        "kind": kind,
                        **counts,
                        "measured_s": t,
                        "fitted_s": fit.fitted[k],
                        "cpu_s": cpu,
                    }
                )
                k += 1
        details[f"{kind}_constant_s"] = fit.constant
        details[f"{kind}_rms_error"] = fit.rms_relative_error
    if "dip" not in fits:
        raise ValueError("no DIP case measured: nothing to write")
    stock = fits["stock"].overheads if "stock" in fits else None
    return {"lines": lines}, OverheadsFile(fits["dip"].overheads, stock, details)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    preset = BENCH_PRESETS[args.preset]
    world = preset.world_size(emulate=True)
    cases = [
        make_case(label, flags, world_size=world, batches=args.batches)
        for label, flags in case_flags(args)
    ]
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    seconds = launch(args, cases, world)
    table, result = report(cases, seconds)
    result.details.update(
        preset=args.preset,
        mixture=args.mixture or preset.mixture,
        ranks=world,
        global_batch_size=args.global_batch_size,
        repeats=args.repeats,
        command=shlex.join(["python", "tools/measure_overhead.py", *(argv or sys.argv[1:])]),
    )
    sys.stdout.write("\n".join(table["lines"]) + "\n")
    save_overheads(args.out, result)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
