"""Simulate the paper's setups: stock Megatron baselines vs DIP and its ablation steps.

    python tools/simulate_paper.py --setups vlm-s --mixtures mixed --batches 50 --json out.json

For every setup (docs/design.md, "Paper setups") and data mixture, draws seeded synthetic global batches,
plans each one with every schedule on the same microbatches, packing and data-parallel shards,
simulates the plans with the cost model, and prints one table per setup and mixture. The stock
rows are every static placement x schedule, each with its fastest Megatron recompute setting
that fits on every batch (none, selective, full, block N, uniform N); the strongest of them is
the baseline (marked *). Columns: median and p90 iteration time, speedup over the baseline,
iteration / balanced bound (the batch's total compute without recompute / pipeline ranks),
bound efficiency (the plan's busiest-rank compute / iteration time), whether activations fit,
the recompute setting, and planner time per batch. Below the stock rows, the Zero-Bubble peer:
ZB-H1 (Megatron's 1F1B order with split backwards, weight gradients in the bubbles, within
1F1B's activation peak) on each static 1F1B placement; never the baseline (Megatron users do not
run it), its best row compared with DIP in the last line.
Deterministic by seed (the search runs a fixed number of rollouts). Two what-ifs change the
modelled machine to ask what a goal would need, and mark the table's title: `--memory-scale`
(every activation limit times this) and `--gemm-half-rows` (the GEMM efficiency knee; 0 prices
every sub-microbatch as efficiently as its whole microbatch). `--placement` fixes DIP's
placement to one the table printed (a row's "DIP placement"), skipping the start-up search:

    python tools/simulate_paper.py --setups vlm-l --mixtures mixed --batches 3 --calibration-batches 2 \
        --placement "static cost-split v2 cut 4/4/3/5/5/5/5/4/5/5/6/15/15/16/16/15"
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dip.batching import resplit
from megatron_dip.modelspec import PAPER_SETUPS
from megatron_dip.planner.bounds import module_bounds
from megatron_dip.planner.candidate_pool import usable_cores
from megatron_dip.planner.gap import decompose_gap, format_gap
from megatron_dip.planner.paper import check_names, mixtures_for, paper_comparison
from megatron_dip.planner.search import SearchConfig
from megatron_dip.planner.study import Study, format_table

logger = logging.getLogger("simulate_paper")

# DIP's steps `--gap` decomposes: its fused plan and its plan with split backwards.
GAP_STEPS = ("dip: +memory", "dip: +B/W split (full DIP)")


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
        help="comma list, or 'auto' (every preset the model suits but t2v-mixed)",
    )
    p.add_argument("--batches", type=int, default=50)
    p.add_argument(
        "--calibration-batches", type=int, default=8, help="batches that size the static placements"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="H800")
    p.add_argument("--search-rollouts", type=int, default=64)
    p.add_argument(
        "--search-time-ms",
        type=float,
        default=None,
        help="also stop each search after this much wall time (default: never, so a row depends "
        "on its seed and rollouts only, not on the machine's load)",
    )
    p.add_argument(
        "--placement",
        help="DIP's placement as the table names it (e.g. 'static cost-split v2 cut "
        "4/4/3/5/5/5/5/4/5/5/6/15/15/16/16/15' or 'vit=1,llm=3'), instead of the start-up "
        "search's choice (minutes to most of an hour); one setup only",
    )
    p.add_argument(
        "--startup-workers",
        type=int,
        default=0,
        help="processes scoring the start-up search's placement candidates, as training's "
        "--dip-startup-workers (0: one per usable CPU core; the same choice for any count)",
    )
    whatif = p.add_argument_group(
        "what-ifs", "change the modelled machine, to ask what a goal would need (not a benchmark)"
    )
    whatif.add_argument(
        "--memory-scale",
        type=float,
        default=1.0,
        help="every rank's activation limit times this, for DIP and the stock grid alike",
    )
    whatif.add_argument(
        "--gemm-half-rows",
        type=int,
        default=None,
        help="the cost model's GEMM efficiency knee in rows (default 512; 0: every GEMM at the "
        "device's cap, so sub-microbatches cost no granularity)",
    )
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument(
        "--gap",
        action="store_true",
        help="print each batch's gap to the balanced bound per rank for DIP's fused and split "
        "plans (planner/gap.py)",
    )
    args = p.parse_args(argv)
    error = check_names(args.setups, args.mixtures)
    if error:
        p.error(error)
    if args.batches < 1:
        p.error("--batches must be >= 1")
    if args.startup_workers < 0:
        p.error("--startup-workers must be >= 0 (0: one per usable CPU core)")
    if not args.memory_scale > 0:
        p.error("--memory-scale must be > 0")
    if args.gemm_half_rows is not None and args.gemm_half_rows < 0:
        p.error("--gemm-half-rows must be >= 0")
    if args.placement is not None and "," in args.setups:
        p.error("--placement names the placement of one setup: give one --setups")
    return args


def search_config(args: argparse.Namespace) -> SearchConfig:
    """Every order search of the study: `--search-rollouts` for `--seed`, capped in wall time
    only where `--search-time-ms` asks (a row must not depend on the machine's load)."""
    wall = math.inf if args.search_time_ms is None else args.search_time_ms / 1e3
    return SearchConfig(max_rollouts=args.search_rollouts, time_budget_s=wall, seed=args.seed)


def run(setup_name: str, mixture: str, args: argparse.Namespace) -> tuple[dict, Study]:
    """Simulate `args.batches` batches of one setup and mixture; returns the summary and study."""
    search = search_config(args)
    started = time.perf_counter()
    try:
        cmp, stream = paper_comparison(
            setup_name,
            mixture,
            device=args.device,
            seed=args.seed,
            calibration_batches=args.calibration_batches,
            search=search,
            placement=args.placement,
            workers=args.startup_workers or usable_cores(),
            memory_scale=args.memory_scale,
            gemm_half_rows=args.gemm_half_rows,
        )
    except ValueError as err:
        if args.placement is None:
            raise
        sys.exit(f"simulate_paper.py: --placement {args.placement!r}: {err}")
    sizing_seconds = time.perf_counter() - started  # the start-up placement search, mostly
    study = Study()
    for _ in range(args.batches):
        batch = next(stream)
        result = cmp.run_batch(batch)
        study.add(result)
        if args.gap:
            print_gaps(cmp, batch, result, f"{setup_name}/{mixture}")
    summary = {
        "setup": setup_name,
        "mixture": mixture,
        "dip_placement": cmp.dip.name,
        "placement_scores": cmp.placement_scores,
        "tie_scores": cmp.tie_scores,
        "sizing_seconds": sizing_seconds,
        "sub_sizes": cmp.sub_sizes,
        "what_if": what_if_label(args).strip(),
        **study.summary(),
        "rows": [r.as_dict() for r in [*study.stock_rows(), *study.peer_rows(), *study.dip_rows()]],
    }
    return summary, study


def print_gaps(cmp, batch, result, title: str) -> None:
    """The gap decomposition (`planner.gap`) of the batch's fused and split DIP plans, with
    each module's share of the balanced bound (on the whole modules, as `compare` prices it)."""
    planner = cmp.planner()
    layout = planner.layout(batch)
    whole = planner.layout_config.with_whole_modules()
    for outcome in result.dip:
        if outcome.name not in GAP_STEPS or outcome.plan is None:
            continue
        replica = resplit(cmp.setup.model, layout.replicas[outcome.plan.replica], whole)
        shares = module_bounds(
            cmp.cost_model, replica.submicrobatches, num_ranks=cmp.setup.pipeline_parallel
        )
        gap = decompose_gap(
            outcome.plan,
            outcome.sim,
            cmp.cost_model,
            result.balanced_bound,
            cmp.dip_channel,
            shares,
            whole=replica.submicrobatches,
        )
        name = f"{title} iteration {result.iteration} {outcome.name}"
        print(format_gap(name, gap) + "\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The ablation steps without the memory pass overcommit by design; the table's "fits"
    # column reports it instead of one warning per plan.
    logging.getLogger("megatron_dip.planner.dip").setLevel(logging.ERROR)
    args = parse_args(argv)
    results = []
    for setup_name in args.setups.split(","):
        for mixture in mixtures_for(setup_name, args.mixtures):
            started = time.perf_counter()
            result, study = run(setup_name, mixture, args)
            result["wall_seconds"] = time.perf_counter() - started
            results.append(result)
            title = (
                f"== {setup_name} / {mixture}  (DIP placement {result['dip_placement']}, "
                f"sub-microbatch sizes {result['sub_sizes']}){what_if_label(args)}"
            )
            print(format_table(title, study), flush=True)
            if result["vs_zb_h1"] is not None:
                print(f"   DIP vs the ZB-H1 peer: {result['vs_zb_h1']:.2f}x", flush=True)
            print(
                f"   ({args.batches} batches, {result['wall_seconds']:.0f} s; placement search "
                f"{result['sizing_seconds']:.0f} s, {len(result['placement_scores'])} "
                f"candidates scored{_ties(result['tie_scores'])})\n",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def what_if_label(args: argparse.Namespace) -> str:
    """The title's mark of a what-if run (empty for the modelled machine itself)."""
    changes = []
    if args.memory_scale != 1.0:
        changes.append(f"activation limits x {args.memory_scale:g}")
    if args.gemm_half_rows is not None:
        changes.append(f"GEMM knee {args.gemm_half_rows} rows")
    return f"  WHAT-IF: {', '.join(changes)}" if changes else ""


def _ties(tie_scores: dict[str, float]) -> str:
    """The near-ties the run's plans settled (`placement_ties`), for the summary line."""
    if not tie_scores:
        return ""
    planned = ", ".join(f"{name}: {s:.3f} s" for name, s in tie_scores.items())
    return f"; near-ties planned again: {planned}"


if __name__ == "__main__":
    sys.exit(main())
