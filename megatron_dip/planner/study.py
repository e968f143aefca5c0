"""Aggregating a simulation study over batches: the honest comparison table.

`Study` collects `compare.BatchResult`s of one setup and mixture. The baseline is the strongest
stock configuration of the run (`stock_configs.strongest`: the fastest placement x schedule x
recompute setting whose activations fit on every batch, as a Megatron user fixes them for a
run); every row also shows its iteration over the batch's balanced bound (`bounds`) and over its
own placement's bound (busiest rank's compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .compare import BatchResult
from .stock_configs import StockResult, mode_label, strongest


def summarize(values: Sequence[float]) -> tuple[float, float]:
    """Median and 90th percentile."""
    arr = np.asarray(values, dtype=float)
    return float(np.median(arr)), float(np.percentile(arr, 90))


@dataclass
class Row:
    """One schedule over the study's batches."""

    name: str
    time: list[float] = field(default_factory=list)
    balanced: list[float] = field(default_factory=list)  # the batch's balanced bound
    bound: list[float] = field(default_factory=list)  # busiest rank's compute of this plan
    fits: list[bool] = field(default_factory=list)
    recompute: list[str] = field(default_factory=list)
    plan_s: list[float] = field(default_factory=list)

    def add(
        self,
        *,
        time: float,
        balanced: float,
        bound: float,
        fits: bool,
        recompute: str,
        plan_s: float = 0.0,
    ) -> None:
        self.time.append(time)
        self.balanced.append(balanced)
        self.bound.append(bound)
        self.fits.append(fits)
        self.recompute.append(recompute)
        self.plan_s.append(plan_s)

    @property
    def median(self) -> float:
        return summarize(self.time)[0]

    def as_dict(self) -> dict:
        med, p90 = summarize(self.time)
        return {
            "name": self.name,
            "median_s": med,
            "p90_s": p90,
            "over_balanced": summarize([t / b for t, b in zip(self.time, self.balanced)])[0],
            "bound_efficiency": summarize([b / t for b, t in zip(self.bound, self.time)])[0],
            "fits": f"{sum(self.fits)}/{len(self.fits)}",
            "recompute": max(set(self.recompute), key=self.recompute.count),
            "plan_s": summarize(self.plan_s)[0],
        }


@dataclass
class Study:
    """The batches of one setup and mixture."""

    batches: list[BatchResult] = field(default_factory=list)

    def add(self, result: BatchResult) -> None:
        self.batches.append(result)

    def baseline(self) -> tuple[str, str, tuple] | None:
        """The strongest stock configuration fitting on every batch (None: none fits)."""
        return strongest([b.stock for b in self.batches])

    def stock_rows(self) -> list[Row]:
        """For each placement x schedule, its best configuration over the run: the fastest
        recompute setting that fits on every batch (or the fastest of all when none fits)."""
        return self._best_rows([b.stock for b in self.batches])

    def peer_rows(self) -> list[Row]:
        """The literature's schedules on the static placements (ZB-H1), a row per placement and
        schedule, fastest first. Each batch's peer runs under that batch's fastest fitting 1F1B
        recompute setting (`compare.Comparison._zero_bubble`), which may differ between batches:
        the row then says "recompute per batch" (grouping by setting, as `stock_rows` does,
        would drop the row). A row some batch lacks is left out."""
        by_group: dict[tuple[str, str], list[StockResult]] = {}
        for b in self.batches:
            for r in b.peers:
                by_group.setdefault((r.pipeline, r.schedule), []).append(r)
        rows = []
        for (pipeline, schedule), results in by_group.items():
            if len(results) < len(self.batches):
                continue
            settings = {mode_label(r.mode) for r in results}
            setting = settings.pop() if len(settings) == 1 else "recompute per batch"
            rows.append(self._row(f"{schedule} ({pipeline}), {setting}", results))
        return sorted(rows, key=lambda r: (not all(r.fits), sum(r.time), r.name))

    def _best_rows(self, per_batch: list) -> list[Row]:
        by_key: dict[tuple, list[StockResult]] = {}
        for results in per_batch:
            for r in results:
                by_key.setdefault(r.key, []).append(r)
        best: dict[tuple[str, str], tuple] = {}
        for key, results in by_key.items():
            if len(results) < len(self.batches):
                continue  # Megatron cannot run it on some batch (too few microbatches)
            total = sum(r.sim.iteration_time for r in results)
            rank = (not all(r.fits for r in results), total, key[2].layers)
            group = key[:2]
            if group not in best or rank < best[group][0]:
                best[group] = (rank, key)
        return [self._row(by_key[key][0].label, by_key[key]) for _, key in sorted(best.values())]

    def _row(self, name: str, results: Sequence[StockResult]) -> Row:
        """The row `name` of one stock configuration's (or peer's) result on each batch."""
        row = Row(name)
        for b, r in zip(self.batches, results):
            row.add(
                time=r.sim.iteration_time,
                balanced=b.balanced_bound,
                bound=r.sim.lower_bound,
                fits=r.fits,
                recompute=mode_label(r.mode),
            )
        return row

    def dip_rows(self) -> list[Row]:
        rows: dict[str, Row] = {}
        for b in self.batches:
            for o in b.dip:
                rows.setdefault(o.name, Row(o.name)).add(
                    time=o.sim.iteration_time,
                    balanced=b.balanced_bound,
                    bound=o.sim.lower_bound,
                    fits=o.fits,
                    recompute=o.recompute,
                    plan_s=o.plan_seconds,
                )
        return list(rows.values())

    def summary(self) -> dict:
        """The honest-table row: strongest fitting stock (named), DIP, speedup, DIP / balanced
        bound, planner seconds."""
        stock = self.stock_rows()
        key = self.baseline()
        dip = self.dip_rows()[-1]
        base = next((r for r in stock if key is not None and r.name == _label_of(key)), None)
        out = {"dip": dip.as_dict(), "baseline": base.as_dict() if base else None}
        out["speedup"] = base.median / dip.median if base else None
        peers = self.peer_rows()
        peer = min(peers, key=lambda r: r.median) if peers else None
        out["zb_h1"] = peer.as_dict() if peer else None
        out["vs_zb_h1"] = peer.median / dip.median if peer else None
        return out


def _label_of(key: tuple) -> str:
    pipeline, schedule, mode = key
    return f"megatron {schedule} ({pipeline}), {mode_label(mode)}"


def format_table(title: str, study: Study) -> str:
    """The study's rows as one text table (stock rows first, the baseline marked)."""
    key = study.baseline()
    stock, dip = study.stock_rows() + study.peer_rows(), study.dip_rows()
    base = next((r for r in stock if key is not None and r.name == _label_of(key)), None)
    ref = base.median if base else min(r.median for r in [*stock, *dip])
    head = (
        f"{'schedule':52s} {'median s':>9s} {'p90 s':>8s} {'speedup':>8s} {'/balanced':>9s} "
        f"{'bound eff':>9s} {'fits':>5s} {'recompute':>13s} {'plan s':>7s}"
    )
    lines = [title, head]
    for row in [*stock, *dip]:
        d = row.as_dict()
        mark = "*" if row is base else " "
        lines.append(
            f"{mark}{row.name[:51]:51s} {d['median_s']:9.3f} {d['p90_s']:8.3f} "
            f"{ref / d['median_s']:7.2f}x {d['over_balanced']:8.3f}x {d['bound_efficiency']:9.1%} "
            f"{d['fits']:>5s} {d['recompute']:>13s} {d['plan_s']:7.2f}"
        )
    if base is None:
        lines.append("  (no stock configuration fits on every batch: speedups vs the fastest)")
    else:
        lines.append(
            "  * the strongest stock configuration that fits on every batch (the baseline)"
        )
    return "\n".join(lines)
