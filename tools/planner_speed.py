"""Planner speed per setup and mixture: greedy and full plan times on one core.

    python tools/planner_speed.py --setups vlm-s,vlm-l --mixtures mixed --batches 3

Builds the planner as `tools/simulate_paper.py` does (cost model, DIP placement chosen from
calibration batches, `Comparison.planner()`), then times `planner.plan_batch(batch, search=False)`
(greedy: list schedule, memory pass, communication, validation, Megatron-order candidate) and
`planner.plan_batch(batch)` (full: the same with the MCTS order search of `--search-rollouts`
rollouts, the clock never ending it) on the same batches. Times are CPU seconds of this process
(`time.process_time()`: the planner is single-threaded, and CPU time is what a shared machine
does not distort) and wall seconds; the table prints the median over the batches, the
instructions per plan, and whether the goals (greedy < 0.5 s, full < 2 s CPU) are met.
`--profile FILE` writes a cProfile of all timed plans (view with `python -m pstats FILE`).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.planner.paper import check_names, mixtures_for, paper_comparison
from megatron_dip.planner.search import SearchConfig
from megatron_dip.schedule.serialize import plan_to_bytes

logger = logging.getLogger("planner_speed")

GREEDY_GOAL_S = 0.5
FULL_GOAL_S = 2.0
SPEED_MIXTURES = ("mixed", "laion", "obelics", "text-only", "omni", "t2v", "t2i")  # no blends


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--setups", default=",".join(PAPER_SETUPS), help="comma list of setups")
    p.add_argument("--mixtures", default="auto", help="comma list, or 'auto' (every fitting one)")
    p.add_argument("--batches", type=int, default=3, help="timed batches per setup and mixture")
    p.add_argument("--calibration-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="H800")
    p.add_argument("--search-rollouts", type=int, default=64)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--profile", type=Path, help="write a cProfile of the timed plans here")
    p.add_argument(
        "--digest", action="store_true", help="also print sha256 of the plans (equivalence checks)"
    )
    args = p.parse_args(argv)
    error = check_names(args.setups, args.mixtures)
    if error:
        p.error(error)
    if args.batches < 1:
        p.error("--batches must be >= 1")
    return args


def build_planner(setup_name: str, mixture: str, args: argparse.Namespace):
    """(planner, batch stream) as `tools/simulate_paper.py` builds them."""
    # The rollout budget, never the clock, ends the search: the same plans on any machine.
    search = SearchConfig(max_rollouts=args.search_rollouts, time_budget_s=1e9, seed=args.seed)
    cmp, stream = paper_comparison(
        setup_name, mixture, device=args.device, seed=args.seed,
        calibration_batches=args.calibration_batches, search=search,
    )  # fmt: skip
    return cmp.planner(), stream


def _timed(fn) -> tuple[object, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def measure(setup_name: str, mixture: str, args, profiler: cProfile.Profile | None) -> dict:
    """Median greedy/full CPU and wall seconds over `args.batches` batches of one setup."""
    planner, stream = build_planner(setup_name, mixture, args)
    rows: dict[str, list[float]] = {k: [] for k in ("g_cpu", "g_wall", "f_cpu", "f_wall", "ins")}
    digest = hashlib.sha256()
    for _ in range(args.batches):
        batch = next(stream)
        if profiler is not None:
            profiler.enable()
        greedy, g_cpu, g_wall = _timed(lambda b=batch: planner.plan_batch(b, search=False))
        full, f_cpu, f_wall = _timed(lambda b=batch: planner.plan_batch(b))
        if profiler is not None:
            profiler.disable()
        rows["g_cpu"].append(g_cpu)
        rows["g_wall"].append(g_wall)
        rows["f_cpu"].append(f_cpu)
        rows["f_wall"].append(f_wall)
        rows["ins"].append(sum(len(p) for rp in greedy for p in rp.plan.programs))
        for rp in (*greedy, *full):
            digest.update(plan_to_bytes(rp.plan))
    out = {k: statistics.median(v) for k, v in rows.items()}
    out.update(setup=setup_name, mixture=mixture, batches=args.batches)
    out["goals_met"] = out["g_cpu"] < GREEDY_GOAL_S and out["f_cpu"] < FULL_GOAL_S
    out["digest"] = digest.hexdigest()[:16]
    return out


def format_row(row: dict) -> str:
    return (
        f"{row['setup']:7s} {row['mixture']:10s} {row['g_cpu']:8.3f} {row['g_wall']:8.3f} "
        f"{row['f_cpu']:8.3f} {row['f_wall']:8.3f} {row['ins']:8.0f} "
        f"{'yes' if row['goals_met'] else 'NO':>5s}"
    )


HEADER = (
    f"{'setup':7s} {'mixture':10s} {'greedy':>8s} {'(wall)':>8s} {'full':>8s} {'(wall)':>8s} "
    f"{'instr':>8s} {'goals':>5s}\n"
    f"{'':18s} {'CPU s':>8s} {'s':>8s} {'CPU s':>8s} {'s':>8s} {'/plan':>8s}"
)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    profiler = cProfile.Profile() if args.profile else None
    results = []
    print(HEADER, flush=True)
    for setup_name in args.setups.split(","):
        for mixture in mixtures_for(setup_name, args.mixtures, auto=SPEED_MIXTURES):
            row = measure(setup_name, mixture, args, profiler)
            results.append(row)
            line = format_row(row) + (f"  {row['digest']}" if args.digest else "")
            print(line, flush=True)
    if profiler is not None:
        profiler.dump_stats(str(args.profile))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
