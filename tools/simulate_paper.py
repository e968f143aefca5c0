"""Simulate the paper's setups: stock Megatron baselines vs DIP and its ablation steps.

    python tools/simulate_paper.py --setups vlm-s --mixtures mixed --batches 50 --json out.json

For every setup (DESIGN.md section 3) and data mixture, draws seeded synthetic global batches,
plans each one with every schedule on the same microbatches, packing and data-parallel shards,
simulates the plans with the cost model, and prints one table per setup and mixture: median and
p90 iteration time, speedup over the strongest baseline, bound efficiency (busiest-rank compute
/ iteration time), estimated MFU, whether activations fit, and planner time per batch.
Deterministic by seed (the search runs a fixed number of rollouts).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dip.data.stream import BatchStream, StreamConfig
from megatron_dip.data.synthetic import MIXTURES, SyntheticSource
from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.planner.compare import (
    Comparison,
    model_flops,
    packing_limits,
    summarize,
)
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import get_device
from megatron_dip.planner.search import SearchConfig

logger = logging.getLogger("simulate_paper")

AUTO_MIXTURES = ("mixed", "laion", "obelics", "text-only", "omni", "t2v", "t2i")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--setups",
        default="vlm-s,vlm-m,vlm-l,t2v-s,t2v-l",
        help="comma list of " + ",".join(PAPER_SETUPS),
    )
    p.add_argument(
        "--mixtures",
        default="auto",
        help="comma list, or 'auto' (VLM: mixed,laion,obelics,text-only; T2V: t2v,t2i)",
    )
    p.add_argument("--batches", type=int, default=50)
    p.add_argument(
        "--calibration-batches", type=int, default=8, help="batches that size the static placements"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="H800")
    p.add_argument("--search-rollouts", type=int, default=64)
    p.add_argument("--search-time-ms", type=float, default=10000)
    p.add_argument("--json", type=Path, help="write all results here")
    args = p.parse_args(argv)
    for name in args.setups.split(","):
        if name not in PAPER_SETUPS:
            p.error(f"--setups: unknown setup {name!r}; known: {', '.join(PAPER_SETUPS)}")
    if args.mixtures != "auto":
        for name in args.mixtures.split(","):
            if name not in MIXTURES:
                p.error(f"--mixtures: unknown mixture {name!r}; known: {', '.join(MIXTURES)}")
    if args.batches < 1:
        p.error("--batches must be >= 1")
    return args


def mixtures_for(setup_name: str, arg: str) -> list[str]:
    """The mixtures of `arg` that fit the setup's model ("auto": the presets that do)."""
    model = PAPER_SETUPS[setup_name].model
    fitting = [m for m in AUTO_MIXTURES if MIXTURES[m].suits(model)]
    return list(fitting) if arg == "auto" else [m for m in arg.split(",") if m in fitting]


def run(setup_name: str, mixture: str, args: argparse.Namespace) -> dict:
    """Simulate `args.batches` batches of one setup and mixture; returns the result rows."""
    setup = PAPER_SETUPS[setup_name]
    device = get_device(args.device)
    cost = CostModel(
        setup.model,
        device,
        tensor_parallel=setup.tensor_parallel,
        sequence_parallel=setup.tensor_parallel > 1,
    )
    limits = packing_limits(setup.model, setup.seq_length)
    stream = BatchStream(
        SyntheticSource(mixture, model=setup.model, seed=args.seed),
        config=StreamConfig(
            seed=args.seed, batch_microbatches=setup.global_batch_microbatches, limits=limits
        ),
    )
    calibration = stream.peek(args.calibration_batches)
    search = SearchConfig(
        max_rollouts=args.search_rollouts, time_budget_s=args.search_time_ms / 1e3, seed=args.seed
    )
    cmp = Comparison.create(setup, cost, device=device, calibration=calibration, search=search)
    rows: dict[str, dict[str, list]] = {}
    for _ in range(args.batches):
        batch = next(stream)
        works = [w for r in cmp.planner().layout(batch).replicas for w in r.works]
        flops = model_flops(setup.model, cost, works)
        for o in cmp.run_batch(batch):
            row = rows.setdefault(
                o.name,
                {"time": [], "bound": [], "fits": [], "plan_s": [], "recompute": [], "mfu": []},
            )
            row["time"].append(o.sim.iteration_time)
            row["bound"].append(o.sim.lower_bound)
            row["fits"].append(o.fits)
            row["plan_s"].append(o.plan_seconds)
            row["recompute"].append(o.recompute)
            row["mfu"].append(flops / (setup.num_gpus * device.peak_flops * o.sim.iteration_time))
    return {
        "setup": setup_name,
        "mixture": mixture,
        "segments": {
            m.name: m.num_chunks // setup.pipeline_parallel for m in cmp.dip_placement.modules
        },
        "sub_sizes": cmp.sub_sizes,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    rows = result["rows"]
    baselines = [n for n in rows if n.startswith("megatron")]
    best_base = min(summarize(rows[n]["time"])[0] for n in baselines)
    lines = [
        f"== {result['setup']} / {result['mixture']}  (DIP segments {result['segments']}, sub-microbatch sizes {result['sub_sizes']})",
        f"{'schedule':40s} {'median s':>9s} {'p90 s':>8s} {'speedup':>8s} {'bound eff':>9s} {'MFU':>6s} {'fits':>5s} {'recompute':>10s} {'plan s':>7s}",
    ]
    for name, r in rows.items():
        med, p90 = summarize(r["time"])
        eff = summarize([b / t for b, t in zip(r["bound"], r["time"])])[0]
        mfu = summarize(r["mfu"])[0]
        fits = f"{sum(r['fits'])}/{len(r['fits'])}"
        rec = max(set(r["recompute"]), key=r["recompute"].count)
        plan_s = summarize(r["plan_s"])[0]
        lines.append(
            f"{name:40s} {med:9.3f} {p90:8.3f} {best_base / med:7.2f}x {eff:9.1%} {mfu:6.1%} {fits:>5s} {rec:>10s} {plan_s:7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    results = []
    for setup_name in args.setups.split(","):
        for mixture in mixtures_for(setup_name, args.mixtures):
            started = time.perf_counter()
            result = run(setup_name, mixture, args)
            result["wall_seconds"] = time.perf_counter() - started
            results.append(result)
            print(format_table(result), flush=True)
            print(f"   ({args.batches} batches, {result['wall_seconds']:.0f} s)\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
