"""Draw pipeline timelines as a PNG: one row per rank, colour per module, forward light, backward dark.

    python tools/draw_timeline.py --schedule both --ranks 4 --microbatches 8 --chunks 2 --out timeline.png

builds Megatron's 1F1B and interleaved 1F1B plans, simulates them with uniform stage costs
(backward = 2x forward, the same total work per microbatch in both) and draws them one above the
other on a common time axis. Other tools reuse `draw_timeline(results, path)`.
"""

from __future__ import annotations

import argparse
import colorsys
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dip.planner.simulator import SimResult, UniformCost, simulate
from megatron_dip.schedule.baselines import build_1f1b_plan, build_interleaved_plan
from megatron_dip.schedule.ir import Plan

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def _colour(base: str, segment: int, segments: int, is_forward: bool) -> tuple[float, float, float]:
    """Module hue; a rank's later chunks (segments) darker; forwards much lighter than backwards."""
    hue, light, sat = colorsys.rgb_to_hls(*to_rgb(base))
    light = light * (1.0 - 0.5 * segment / max(1, segments))
    if is_forward:
        light = light + (1.0 - light) * 0.55
    return colorsys.hls_to_rgb(hue, min(light, 0.95), sat)


def _draw_one(ax: plt.Axes, title: str, result: SimResult, plan: Plan, scale: float) -> None:
    modules = [m.name for m in plan.placement.modules]
    p = plan.num_ranks
    segments = {m.name: -(-m.num_chunks // p) for m in plan.placement.modules}
    for rank, spans in enumerate(result.timeline):
        for span in spans:
            start, width = span.start * scale, (span.end - span.start) * scale
            base = _PALETTE[modules.index(span.module) % len(_PALETTE)]
            colour = _colour(base, span.chunk // p, segments[span.module], span.is_forward)
            ax.broken_barh(
                [(start, width)],
                (rank - 0.4, 0.8),
                facecolors=colour,
                edgecolor="black",
                linewidth=0.4,
            )
            text = str(span.microbatch) if span.sub == 0 else f"{span.microbatch}.{span.sub}"
            ink = "black" if span.is_forward else "white"
            ax.text(
                start + width / 2,
                rank,
                text,
                ha="center",
                va="center",
                fontsize=7,
                color=ink,
                clip_on=True,
            )
    ax.set_yticks(range(result.num_ranks), [f"rank {r}" for r in range(result.num_ranks)])
    ax.set_ylim(result.num_ranks - 0.5, -0.5)
    ax.set_title(
        f"{title}: iteration {result.iteration_time * scale:.2f} ms, "
        f"bubbles {result.bubble_fraction:.1%}, {result.num_messages} messages",
        fontsize=10,
    )


def draw_timeline(
    results: Sequence[tuple[str, SimResult, Plan]],
    path: str | Path,
    *,
    seconds_per_unit: float = 1e-3,
) -> Path:
    """Draw each (title, simulation, plan) as one panel of `path` (PNG), times in milliseconds
    (`seconds_per_unit` seconds per axis unit), panels sharing the time axis. Returns the path."""
    if not results:
        raise ValueError("nothing to draw")
    rows = sum(r.num_ranks for _, r, _ in results)
    fig, axes = plt.subplots(
        len(results),
        1,
        sharex=True,
        squeeze=False,
        figsize=(14, 1.0 + 0.45 * rows + 0.5 * len(results)),
    )
    scale = 1.0 / seconds_per_unit
    for ax, (title, result, plan) in zip(axes[:, 0], results):
        _draw_one(ax, title, result, plan, scale)
    axes[-1, 0].set_xlabel(
        "time (ms)" if seconds_per_unit == 1e-3 else f"time (x {seconds_per_unit:g} s)"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def baseline_results(
    *, schedule: str, ranks: int, microbatches: int, chunks: int, forward_ms: float
) -> list[tuple[str, SimResult, Plan]]:
    """Simulated Megatron baselines with uniform costs: a microbatch's whole forward pass costs
    `ranks * chunks * forward_ms` in both schedules (a 1F1B stage holds `chunks` layers)."""
    out = []
    f = forward_ms * 1e-3
    if schedule in ("1f1b", "both"):
        plan = build_1f1b_plan(num_ranks=ranks, num_microbatches=microbatches)
        cost = UniformCost(forward=chunks * f, backward=2 * chunks * f)
        out.append((f"1F1B P={ranks} M={microbatches}", simulate(plan, cost), plan))
    if schedule in ("interleaved", "both"):
        plan = build_interleaved_plan(
            num_ranks=ranks, num_model_chunks=chunks, num_microbatches=microbatches
        )
        cost = UniformCost(forward=f, backward=2 * f)
        title = f"interleaved 1F1B P={ranks} V={chunks} M={microbatches}"
        out.append((title, simulate(plan, cost), plan))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=("1f1b", "interleaved", "both"), default="both")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank (interleaved)")
    parser.add_argument("--forward-ms", type=float, default=1.0, help="forward time of one chunk")
    parser.add_argument("--out", type=Path, default=Path("timeline.png"))
    args = parser.parse_args(argv)
    try:
        results = baseline_results(
            schedule=args.schedule,
            ranks=args.ranks,
            microbatches=args.microbatches,
            chunks=args.chunks,
            forward_ms=args.forward_ms,
        )
    except ValueError as exc:
        parser.error(str(exc))
    draw_timeline(results, args.out)
    for title, result, _ in results:
        print(f"{title}: {result.summary()}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
