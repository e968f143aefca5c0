"""Benchmark DIP against Megatron-Core's own stock schedules, measured in one run.

    python tools/measure_overhead.py --preset vlm-s --out overheads.json   # once per machine
    python tools/bench_schedules.py --preset vlm-s --mixture mixed --iterations 4 \
        --host-overheads overheads.json --out bench/

For a preset (`megatron_dip.benchmark.bench.BENCH_PRESETS`: VLM-S, T2V-S and omni-S at PP=4,
VLM-L at PP=8), launches the training entry point with torchrun (gloo) once per schedule on the
same seeded stream of synthetic batches:

* Megatron-Core's stock 1F1B and interleaved 1F1B, each in the strongest configuration a
  Megatron user could set whose activations fit on every calibration batch, by simulation
  (`strongest_stock`: LLaVA-style / one layer list cut by parameters / by cost, x Megatron's
  recompute flags: none, selective, full, `--recompute-method block|uniform
  --recompute-num-layers N`);
* DIP (planner process with lookahead, searched plans, calibration frozen) at the planner's own
  granularity: with --host-overheads the planner trades segments and sub-microbatch sizes
  against the measured host time per instruction, batch and message, and every run's
  prediction charges it (`--dip-host-overheads`). `--dip-flags` passes explicit DIP flags.

By default the cluster is emulated (`--dip-emulate-compute`): chunks sleep the cost model's time
for their real input at the paper's scale, messages take the cost model's transfer time, and
the scale is chosen so that the shortest instruction of DIP's finest plan (no host overheads)
lasts --min-op-ms. Each schedule also runs once with zero sleep: the overhead floor of the
machine. Prints one table whose headline is the elapsed iteration a user waits (median / p90,
planning waits included; speedup over stock 1F1B and over the strongest stock schedule by it),
then the schedule time alone and the plan wait (medians), the simulator's prediction of the
schedule and its error, the bubble-free bound, inline fallbacks), and writes `results.json` and `bench.png` (bar chart, and the measured DIP
timeline of the last iteration) under --out.

With --real the same comparison runs real compute (GPUs; add launcher flags with
--torchrun-args, e.g. "--nnodes 4 --rdzv-backend c10d --rdzv-endpoint host:29500").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dip.benchmark.bench import (
    BENCH_PRESETS,
    BenchPreset,
    RunSummary,
    auto_scale,
    dip_run_flags,
    strongest_stock,
    summarize,
)

logger = logging.getLogger("bench_schedules")
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="vlm-s", choices=sorted(BENCH_PRESETS))
    p.add_argument("--mixture", default=None, help="synthetic mixture (default: the preset's)")
    p.add_argument("--iterations", type=int, default=4, help="measured iterations per schedule")
    p.add_argument("--warmup", type=int, default=1, help="iterations left out of the statistics")
    p.add_argument("--schedules", default="1f1b,interleaved,dip")
    p.add_argument("--scale", type=float, default=None, help="emulation scale (default: auto)")
    p.add_argument("--min-op-ms", type=float, default=50.0, help="auto scale: shortest DIP op")
    p.add_argument("--no-floor", action="store_true", help="skip the zero-sleep floor runs")
    p.add_argument("--search-time-ms", type=float, default=2000.0)
    p.add_argument("--calibration-batches", type=int, default=2, help="batches sizing choices")
    p.add_argument(
        "--host-overheads",
        type=Path,
        default=None,
        help="measured host overheads (tools/measure_overhead.py) for every run",
    )
    p.add_argument("--dip-flags", default="", help="explicit DIP flags (e.g. --dip-segments ...)")
    p.add_argument("--real", action="store_true", help="real compute instead of emulation")
    p.add_argument("--torchrun-args", default="--standalone", help="launcher flags")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per launched run")
    p.add_argument("--out", type=Path, default=Path("bench"))
    args = p.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        p.error("--iterations must be >= 1 and --warmup >= 0")
    unknown = set(args.schedules.split(",")) - {"1f1b", "interleaved", "dip"}
    if unknown:
        p.error(f"--schedules: unknown {sorted(unknown)}; use 1f1b, interleaved, dip")
    if args.scale is not None and not args.scale >= 0:
        p.error("--scale must be >= 0")
    return args


def plan_runs(args: argparse.Namespace, preset: BenchPreset) -> tuple[list[dict], float | None]:
    """(label, flags) of every schedule's run (its zero-sleep floor: the same flags at scale 0),
    and the emulation scale (None: --real)."""
    emulate = not args.real
    flags = preset.base_flags(args.mixture, emulate=emulate)
    world = preset.world_size(emulate=emulate)
    explicit = [*preset.dip_flags, *shlex.split(args.dip_flags)]
    scale = None
    if emulate:
        scale = args.scale
        if scale is None:  # DIP's finest plan: no overheads make it coarser
            scale = auto_scale(
                flags + explicit,
                world_size=world,
                batches=args.calibration_batches,
                min_op_s=args.min_op_ms / 1e3,
                share=preset.short_op_share,
            )
        flags += ["--dip-emulate-scale", repr(scale)]
    if args.host_overheads is not None:
        flags += ["--dip-host-overheads", str(args.host_overheads)]
    stock = [s for s in args.schedules.split(",") if s != "dip"]
    runs = []
    for choice in strongest_stock(
        flags, world_size=world, batches=args.calibration_batches, schedules=stock
    ):
        runs.append(
            {
                "label": choice.label,
                "flags": flags + choice.flags(),
                "simulated": choice.simulated_s,
            }
        )
    if "dip" in args.schedules.split(","):
        searched = time.time()
        grain, spec = dip_run_flags(flags + explicit, world_size=world)
        search_s = time.time() - searched  # the run's own start-up would have taken this
        logger.info("DIP granularity (the planner's choice): %s", shlex.join(grain))
        dip = [*explicit, *grain, "--dip-schedule", "dip", "--dip-calibration-frozen"]
        dip += ["--dip-search-time-ms", str(args.search_time_ms)]
        runs.append(
            {
                "label": "dip",
                "flags": flags + dip,
                "simulated": None,
                "search_s": search_s,
                "granularity": {
                    "segments": spec.segments,
                    "sub_sizes": spec.sub_sizes,
                    "placement": spec.placement_name,
                },
            }
        )
    return runs, scale


def launch(
    args: argparse.Namespace, preset: BenchPreset, run: dict, *, scale: float | None, tag: str
) -> tuple[list[dict], float]:
    """One torchrun launch of the entry point; returns its per-iteration metrics lines and
    when it was launched (Unix seconds)."""
    out = args.out / f"{tag}.jsonl"
    out.unlink(missing_ok=True)
    total = args.warmup + args.iterations
    flags = [*run["flags"], "--train-iters", str(total), "--log-interval", "1"]
    flags += ["--dip-metrics-json", str(out)]
    if scale is not None:  # the last one wins: the floor's 0 overrides the run's scale
        flags += ["--dip-emulate-scale", repr(scale)]
    if run["label"] == "dip" and not tag.endswith("floor"):
        flags += [
            "--dip-trace-dir",
            str(args.out / "trace_dip"),
            "--dip-trace-interval",
            str(total),
        ]
    nproc = preset.world_size(emulate=not args.real)
    command = ["torchrun", *shlex.split(args.torchrun_args), "--nproc-per-node", str(nproc)]
    command += [str(ROOT / preset.script), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logger.info("launching %s: %s", tag, shlex.join(command))
    started = time.time()
    with (args.out / f"{tag}.log").open("w") as log:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=args.timeout_s,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{tag} failed (exit {done.returncode}); see {args.out / f'{tag}.log'}")
    logger.info("%s done in %.0f s", tag, time.time() - started)
    return [json.loads(line) for line in out.read_text().splitlines()], started


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def format_table(rows: list[dict]) -> str:
    """The comparison table (times in seconds). The headline is the elapsed iteration a user
    waits (planning waits included), compared against stock; next to it the schedule alone
    (which the simulator predicts) and the plan wait; last, `start`: from the launch to the end
    of the first iteration (for DIP with the start-up placement search, which this tool ran
    once for the run)."""
    base = next((r["summary"] for r in rows if r["label"].startswith("megatron-1f1b")), None)
    stock = [r["summary"].elapsed_s for r in rows if r["label"].startswith("megatron")]
    strongest = min(stock) if stock else None
    head = (
        f"{'schedule':44} {'elapsed':>8} {'p90':>8} {'vs 1F1B':>8} {'vs best':>8} "
        f"{'sched.':>8} {'wait':>7} {'sim':>8} {'err':>7} {'bound':>8} {'b.eff':>6} "
        f"{'floor':>7} {'inline':>6} {'start':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        s: RunSummary = r["summary"]
        err = f"{s.schedule_s / s.predicted_s - 1:+.1%}" if s.predicted_s else "n/a"
        eff = f"{s.bound_s / s.schedule_s:.1%}" if s.bound_s else "n/a"
        floor = f"{r['floor'].elapsed_s:.3f}" if r.get("floor") else "n/a"
        start = f"{s.first_iteration_s:.1f}" if s.first_iteration_s is not None else "n/a"
        lines.append(
            f"{r['label'][:44]:44} {s.elapsed_s:8.3f} {s.elapsed_p90_s:8.3f} "
            f"{_ratio(base.elapsed_s if base else None, s.elapsed_s):>8} "
            f"{_ratio(strongest, s.elapsed_s):>8} {s.schedule_s:8.3f} {s.plan_wait_s:7.3f} "
            f"{(s.predicted_s or float('nan')):8.3f} {err:>7} {(s.bound_s or float('nan')):8.3f} "
            f"{eff:>6} {floor:>7} {s.inline_plans:>3}/{s.iterations:<2} {start:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    preset = BENCH_PRESETS[args.preset]
    args.out.mkdir(parents=True, exist_ok=True)
    runs, scale = plan_runs(args, preset)
    if scale is not None:
        why = (
            "given" if args.scale is not None else f"shortest DIP instruction {args.min_op_ms:g} ms"
        )
        if args.scale is None and preset.short_op_share:
            why += f", leaving out the shortest holding {preset.short_op_share:.0%} of compute"
        logger.info("emulation scale %.4g (%s)", scale, why)
    rows = []
    for i, run in enumerate(runs):
        tag = f"run{i}_{run['label'].split(' ')[0]}"
        row = {"label": run["label"], "flags": run["flags"], "simulated_choices": run["simulated"],
               "granularity": run.get("granularity")}  # fmt: skip
        records, launched_at = launch(args, preset, run, scale=scale, tag=tag)
        row["summary"] = summarize(
            run["label"],
            records,
            warmup=args.warmup,
            launched_at=launched_at,
            spared_s=run.get("search_s", 0.0),
        )
        if scale is not None and not args.no_floor:
            floor, _ = launch(args, preset, run, scale=0.0, tag=f"{tag}_floor")
            row["floor"] = summarize(run["label"], floor, warmup=args.warmup)
        rows.append(row)
    table = format_table(rows)
    sys.stdout.write(
        f"{preset.description}; mixture {args.mixture or preset.mixture}; scale {scale}\n{table}\n"
    )
    write_outputs(args, preset, rows, scale, table)
    return 0


def write_outputs(args, preset: BenchPreset, rows: list[dict], scale, table: str) -> None:
    """results.json and bench.png under --out."""
    from dataclasses import asdict

    from megatron_dip.benchmark.plots import draw_bench

    result = {
        "preset": preset.name, "mixture": args.mixture or preset.mixture, "scale": scale,
        "emulated": not args.real, "warmup": args.warmup, "iterations": args.iterations,
        "table": table,
        "rows": [
            {k: (asdict(v) if k in ("summary", "floor") else v) for k, v in r.items()}
            for r in rows
        ],
    }  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    traces = sorted((args.out / "trace_dip").glob("iteration_*.json"))
    draw_bench(
        rows, traces[-1] if traces else None, args.out / "bench.png", title=preset.description
    )
    logger.info("wrote %s and %s", args.out / "results.json", args.out / "bench.png")


if __name__ == "__main__":
    sys.exit(main())
