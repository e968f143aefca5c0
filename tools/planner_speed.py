"""Planner speed in the training configuration: what a run's planner costs per batch, per pass.

    python tools/measure_overhead.py --preset vlm-s --out o.json      # once per machine
    python tools/planner_speed.py --presets vlm-s,vlm-l,t2v-s --host-overheads o.json

For each benchmark preset (`megatron_dip.benchmark.bench.BENCH_PRESETS`: the emulated runs of
`tools/bench_schedules.py`), the tool resolves the DIP run exactly as training does
(`training.config.validate.resolve`: the start-up sizing and placement search, the sub-microbatch sizes
it picks, the memory limit, the host overheads priced in, Megatron's recompute flags as the
starting mode) and builds the planner with the run's own factory (`training.iteration.planning.
planner_factory`), then plans the run's first batches three ways:

* *fallback*: `DipPlanner.fallback_plan`, what rank 0 plans when the planner process has nothing
  ready (Megatron's order on the placement, or one list schedule);
* *greedy*: `plan_batch(batch, search=False)`, the planner process's first plan of a batch;
* *full*: `plan_batch(batch)`, the same plus the order search; here the run's rollout budget
  (`--search-rollouts`, the training default) ends it, never the clock, so the numbers and plans
  are the same on any machine (training also stops it at --dip-search-time-ms).

Times are CPU seconds of this process (`time.process_time()`: the planner is single-threaded
and a shared machine does not distort CPU time), medians over the batches; the start-up column
is the CPU time of the whole sizing step (`resolve`). The second table gives each pass's share of
the full plans' CPU time (`DipPlanner.pass_seconds`: layout, search, list schedule, memory pass
with its own list schedules, communication, validation, Megatron-order candidates).
Goals: full plan < 2 s CPU (VLM-L: < 5 s). `--profile FILE` writes a cProfile of the timed plans.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import logging
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dip.benchmark.bench import BENCH_PRESETS, first_batches, resolve_run
from megatron_dip.planner.search import SearchConfig
from megatron_dip.schedule.serialize import plan_to_bytes
from megatron_dip.training.iteration.planning import planner_factory

logger = logging.getLogger("planner_speed")

FULL_GOAL_S = {"vlm-l": 5.0}  # others: DEFAULT_FULL_GOAL_S
DEFAULT_FULL_GOAL_S = 2.0
PASSES = (
    "layout", "search", "list schedule", "memory pass", "communication", "validation",
    "candidates", "backward split",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--presets", default="vlm-s,vlm-l,t2v-s", help="comma list of bench presets")
    p.add_argument("--mixture", default=None, help="synthetic mixture (default: each preset's)")
    p.add_argument("--batches", type=int, default=3, help="timed batches per preset")
    p.add_argument("--host-overheads", type=Path, default=None, help="tools/measure_overhead.py")
    p.add_argument(
        "--search-rollouts",
        type=int,
        default=SearchConfig().max_rollouts,
        help="the search's rollout budget (default: the training run's)",
    )
    p.add_argument("--flags", default="", help="extra training flags (e.g. --dip-segments ...)")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--profile", type=Path, help="write a cProfile of the timed plans here")
    p.add_argument(
        "--digest", action="store_true", help="also print sha256 of the plans (equivalence checks)"
    )
    args = p.parse_args(argv)
    unknown = [n for n in args.presets.split(",") if n not in BENCH_PRESETS]
    if unknown:
        p.error(f"--presets: unknown {unknown}; known: {', '.join(sorted(BENCH_PRESETS))}")
    if args.batches < 1 or args.search_rollouts < 1:
        p.error("--batches and --search-rollouts must be >= 1")
    return args


def training_planner(name: str, args: argparse.Namespace):
    """(planner, spec, start-up CPU seconds) of the DIP run of preset `name`, built as
    training builds it; the search ended by `--search-rollouts` alone."""
    preset = BENCH_PRESETS[name]
    flags = [*preset.base_flags(args.mixture), "--dip-schedule", "dip", *args.flags.split()]
    if args.host_overheads is not None:
        flags += ["--dip-host-overheads", str(args.host_overheads)]
    started = time.process_time()
    spec = resolve_run(flags, world_size=preset.world_size(emulate=True))
    startup = time.process_time() - started
    search = replace(
        spec.planner.search, max_rollouts=args.search_rollouts, time_budget_s=1e9, workers=1
    )
    spec = replace(spec, planner=replace(spec.planner, search=search))
    return planner_factory(spec)(), spec, startup


def _cpu(fn) -> tuple[object, float]:
    started = time.process_time()
    out = fn()
    return out, time.process_time() - started


def measure(name: str, args, profiler: cProfile.Profile | None) -> dict:
    """Medians of fallback / greedy / full CPU seconds over `args.batches` batches of a preset,
    and each pass's share of the full plans."""
    planner, spec, startup = training_planner(name, args)
    rows: dict[str, list[float]] = {k: [] for k in ("fallback", "greedy", "full", "ins")}
    shares: Counter[str] = Counter()
    digest = hashlib.sha256()
    for batch in first_batches(spec, args.batches):
        if profiler is not None:
            profiler.enable()
        layout = planner.layout(batch)
        fallbacks, fb = _cpu(
            lambda lay=layout: [planner.fallback_plan(lay, r) for r in range(spec.shape.dp)]
        )
        greedy, g = _cpu(lambda b=batch: planner.plan_batch(b, search=False))
        planner.pass_seconds.clear()
        full, f = _cpu(lambda b=batch: planner.plan_batch(b))
        shares.update(planner.pass_seconds)
        if profiler is not None:
            profiler.disable()
        rows["fallback"].append(fb)
        rows["greedy"].append(g)
        rows["full"].append(f)
        rows["ins"].append(sum(len(p) for rp in full for p in rp.plan.programs))
        for plan in (*fallbacks, *(rp.plan for rp in (*greedy, *full))):
            digest.update(plan_to_bytes(plan))
    out: dict = {k: statistics.median(v) for k, v in rows.items()}
    total = sum(shares.values()) or 1.0
    out.update(
        preset=name,
        mixture=args.mixture or BENCH_PRESETS[name].mixture,
        batches=args.batches,
        startup=startup,
        shares={k: shares[k] / total for k in PASSES},
        placement=spec.stage_units is not None and "static" or "dip",
        sub_sizes=spec.sub_sizes,
        memory_limited=spec.planner.memory_limit_bytes is not None,
    )
    out["goal_s"] = FULL_GOAL_S.get(name, DEFAULT_FULL_GOAL_S)
    out["goal_met"] = out["full"] < out["goal_s"]
    out["digest"] = digest.hexdigest()[:16]
    return out


HEADER = (
    f"{'preset':7s} {'mixture':8s} {'start-up':>9s} {'fallback':>9s} {'greedy':>8s} "
    f"{'full':>8s} {'goal':>6s} {'instr':>8s}\n"
    f"{'':16s} {'CPU s':>9s} {'CPU s':>9s} {'CPU s':>8s} {'CPU s':>8s} {'':>6s} {'/plan':>8s}"
)


def format_row(row: dict) -> str:
    met = f"{'<' if row['goal_met'] else 'NO<'}{row['goal_s']:g}"
    return (
        f"{row['preset']:7s} {row['mixture']:8s} {row['startup']:9.2f} {row['fallback']:9.3f} "
        f"{row['greedy']:8.3f} {row['full']:8.3f} {met:>6s} {row['ins']:8.0f}"
    )


def format_shares(rows: list[dict]) -> str:
    """Each pass's share of the full plans' CPU time, one line per preset."""
    head = f"{'preset':7s} " + " ".join(f"{p:>13s}" for p in PASSES)
    lines = [head]
    for row in rows:
        lines.append(f"{row['preset']:7s} " + " ".join(f"{row['shares'][p]:13.1%}" for p in PASSES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    profiler = cProfile.Profile() if args.profile else None
    results = []
    print(HEADER, flush=True)
    for name in args.presets.split(","):
        row = measure(name, args, profiler)
        results.append(row)
        print(format_row(row) + (f"  {row['digest']}" if args.digest else ""), flush=True)
    print("\nshare of the full plan's CPU time per pass\n" + format_shares(results), flush=True)
    if profiler is not None:
        profiler.dump_stats(str(args.profile))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
