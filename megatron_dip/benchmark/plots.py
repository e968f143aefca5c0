"""The benchmark's PNG: iteration times per schedule, and one measured DIP timeline."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def measured_spans(trace_path: Path) -> dict[int, list[tuple[str, bool, float, float]]]:
    """(module, is_forward, start s, end s) per rank of the "measured rank" processes of a
    Chrome trace written by the training loop (--dip-trace-dir)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    rows: dict[int, list] = {}
    for e in events:
        name = names.get(e.get("pid"), "")
        if e.get("ph") != "X" or not name.startswith("measured rank"):
            continue
        rank = int(name.rsplit(" ", 1)[1])
        start = e["ts"] / 1e6
        rows.setdefault(rank, []).append(
            (e["args"]["module"], e["cat"] == "fwd", start, start + e["dur"] / 1e6)
        )
    return rows


def _bars(ax, rows: Sequence[dict]) -> None:
    labels = [r["label"] for r in rows]
    medians = [r["summary"].elapsed_s for r in rows]
    p90 = [r["summary"].elapsed_p90_s - r["summary"].elapsed_s for r in rows]
    colours = ["#2ca02c" if lab == "dip" else "#7f7f7f" for lab in labels]
    ax.barh(range(len(rows)), medians, xerr=p90, color=colours)
    for i, r in enumerate(rows):
        ax.plot([r["summary"].schedule_s] * 2, [i - 0.4, i + 0.4], "b-", linewidth=1)
        if r["summary"].predicted_s:
            ax.plot([r["summary"].predicted_s] * 2, [i - 0.4, i + 0.4], "k--", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(
        "elapsed iteration (s): median, p90 whisker; blue: schedule time; dashed: simulated"
    )


def _timeline(ax, spans: dict[int, list]) -> None:
    modules = sorted({m for row in spans.values() for m, *_ in row})
    zero = min(s for row in spans.values() for _, _, s, _ in row)
    for rank, row in spans.items():
        for module, forward, start, end in row:
            colour = _PALETTE[modules.index(module) % len(_PALETTE)]
            ax.broken_barh(
                [(start - zero, end - start)],
                (rank - 0.4, 0.8),
                facecolors=colour,
                alpha=0.45 if forward else 1.0,
                linewidth=0,
            )
    ax.set_yticks(sorted(spans), [f"rank {r}" for r in sorted(spans)])
    ax.invert_yaxis()
    ax.set_xlabel(
        "time (s); light: forward, dark: backward; "
        + ", ".join(f"{m}: {_PALETTE[i % len(_PALETTE)]}" for i, m in enumerate(modules))
    )
    ax.set_title("measured DIP timeline (last iteration)", fontsize=10)


def draw_bench(rows: Sequence[dict], trace: Path | None, path: Path, *, title: str) -> Path:
    """Bar chart of the schedules' iteration times, and the measured DIP timeline of `trace`."""
    spans = measured_spans(trace) if trace is not None else {}
    panels = 2 if spans else 1
    fig, axes = plt.subplots(panels, 1, figsize=(13, 2.5 + 2.5 * panels), squeeze=False)
    _bars(axes[0, 0], rows)
    axes[0, 0].set_title(title, fontsize=10)
    if spans:
        _timeline(axes[1, 0], spans)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
