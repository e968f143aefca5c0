"""Where a plan's iteration goes above the balanced bound: the gap, decomposed per rank.

For each pipeline rank r of a simulated plan (makespan T, balanced bound L of its batch,
`bounds.balanced_bound`), the gap T - L is the sum of

* `fill`: idle before the rank's first backward (the pipeline's warm-up bubble);
* `steady`: idle between its first backward and the end of its last forward;
* `drain`: idle after the end of its last forward (the backward tail and the wait for the
  slowest rank), up to the end of the iteration's last compute;
* `reduction`: the data-parallel gradient reduction exposed after the last compute (the same
  for every rank);
* `imbalance`: the rank's compute above the mean over ranks (negative on light ranks);
* `overhead`: the mean compute above the bound, the same for every rank, split into
  `granularity` (the plan's stages without recomputation and host time, against the bound's whole
  modules: sub-microbatches and chunk cuts run smaller GEMMs), `recompute` (its memory policies'
  recomputation) and `host` (per-instruction host time); given each module's share of the bound
  (`bounds.module_bounds`), `granularity_by_module` says which module's cuts cost it.

Per rank, `compute` splits the busy time the same way (`RankCompute`): the rank's stages priced
on whole modules (given the whole-module split of the batch), plus its own granularity,
recomputation and host time, so the busiest rank's makeup reads directly.

Idle spent posting messages is part of the idle terms. `free_communication` is a counterfactual:
what the plan would gain if every message took no time (same programs, transfers at 0 s), so a
large value says communication sits on the critical path. The rank order of spans is time order
(`simulator.SimResult.execution`), so every term is exact for the simulation it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from ..schedule.ir import Backward, BackwardWeight, Forward, Plan, SubMicrobatch
from .bounds import rank_loads
from .simulator import PlanTiming, SimResult, stage_costs

__all__ = ["GapDecomposition", "RankCompute", "RankGap", "decompose_gap", "format_gap"]

IDLE_TERMS = ("fill", "steady", "drain", "reduction")


@dataclass(frozen=True)
class RankGap:
    """One rank's share of makespan - bound, in seconds (module docstring)."""

    fill: float
    steady: float
    drain: float
    reduction: float
    imbalance: float
    overhead: float

    @property
    def total(self) -> float:
        """makespan - bound, whatever the rank."""
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class RankCompute:
    """One rank's busy seconds, built up: `whole` (its layers on whole modules, as the bound
    prices them; None where no whole-module split was given), `plain` (the plan's stages without
    recomputation or host time), `recomputed` (with its memory policies) and `busy` (with host
    time: what the simulation ran)."""

    whole: float | None
    plain: float
    recomputed: float
    busy: float

    def shares(self, bound: float) -> dict[str, float | None]:
        """The build-up as shares of `bound`: whole, + granularity, + recompute, + host."""
        return {
            "whole": None if self.whole is None else self.whole / bound,
            "granularity": None if self.whole is None else (self.plain - self.whole) / bound,
            "recompute": (self.recomputed - self.plain) / bound,
            "host": (self.busy - self.recomputed) / bound,
        }


@dataclass(frozen=True)
class GapDecomposition:
    """A plan's gap to the balanced bound: per-rank terms and the shared overhead's parts."""

    makespan: float
    bound: float
    ranks: tuple[RankGap, ...]
    granularity: float
    recompute: float
    host: float
    free_communication: float
    granularity_by_module: dict[str, float] = field(default_factory=dict)
    compute: tuple[RankCompute, ...] = ()

    def mean(self, term: str) -> float:
        """The mean over ranks of one `RankGap` term."""
        return sum(getattr(r, term) for r in self.ranks) / len(self.ranks)


def _rank_idle(spans, program, compute_end: float) -> tuple[float, float, float]:
    """(fill, steady, drain) idle of one rank up to `compute_end` (module docstring)."""
    first_b = next(
        (s for i, s, _ in spans if isinstance(program.instructions[i], Backward | BackwardWeight)),
        compute_end,
    )
    last_f = max(
        (e for i, _, e in spans if isinstance(program.instructions[i], Forward)), default=0.0
    )
    cuts = (first_b, max(first_b, last_f), compute_end)
    idle = [0.0, 0.0, 0.0]
    clock = 0.0
    for _, start, end in [*spans, (None, compute_end, compute_end)]:
        for part, (lo, hi) in enumerate(zip((0.0, *cuts[:2]), cuts)):
            idle[part] += max(0.0, min(start, hi) - max(clock, lo))
        clock = max(clock, end)
    return idle[0], idle[1], idle[2]


def _compute_totals(plan: Plan, cost_model) -> tuple[dict[str, float], list[float], list[float]]:
    """(per module, seconds of the plan's stages without recomputation; per rank, the same; per
    rank, with its memory policies), every forward and backward of every rank, no host time."""
    costs, has_backward = stage_costs(plan, cost_model)
    by_module: dict[str, float] = {}
    plain = [0.0] * plan.num_ranks
    recomputed = [0.0] * plan.num_ranks
    for stage, cost in costs.items():
        chunk = plan.placement.module(stage.module).chunks[stage.chunk]
        bare = cost_model.stage_cost(chunk, plan.submicrobatch(stage.work))
        backward = stage in has_backward
        seconds = bare.forward + (bare.backward if backward else 0.0)
        by_module[stage.module] = by_module.get(stage.module, 0.0) + seconds
        plain[chunk.rank] += seconds
        recomputed[chunk.rank] += cost.forward + (cost.backward if backward else 0.0)
    return by_module, plain, recomputed


class _FreeMessages:
    """`cost_model` with every message free: the counterfactual of `free_communication`."""

    def __init__(self, cost_model) -> None:
        self._inner = cost_model

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def transfer_time(self, nbytes: int) -> float:
        """No message takes time."""
        return 0.0


def decompose_gap(
    plan: Plan,
    sim: SimResult,
    cost_model,
    bound: float,
    channel,
    module_bounds: Mapping[str, float] | None = None,
    whole: Iterable[SubMicrobatch] | None = None,
) -> GapDecomposition:
    """The decomposition of `sim` (`plan`'s simulation under `cost_model` and `channel`)
    against the balanced bound `bound` (of which each module's share: `module_bounds`);
    `whole`: the batch's sub-microbatches on whole modules, which price each rank's share of
    the bound (`RankCompute.whole`)."""
    execution = sim.execution
    ranks = len(plan.programs)
    compute_end = max((s[-1][2] for s in execution.spans if s), default=0.0)
    mean_busy = sum(sim.busy) / ranks
    by_module, plain, recomputed = _compute_totals(plan, cost_model)
    loads = None if whole is None else rank_loads(cost_model, plan.placement, whole)
    rows = []
    for program, spans, busy in zip(plan.programs, execution.spans, sim.busy):
        fill, steady, drain = _rank_idle(spans, program, compute_end)
        rows.append(
            RankGap(
                fill,
                steady,
                drain,
                sim.iteration_time - compute_end,
                busy - mean_busy,
                mean_busy - bound,
            )  # fmt: skip
        )
    free = PlanTiming(plan, _FreeMessages(cost_model), message_latency=0.0).run(
        plan.programs, channel
    )
    return GapDecomposition(
        makespan=sim.iteration_time,
        bound=bound,
        ranks=tuple(rows),
        granularity=sum(plain) / ranks - bound,
        recompute=(sum(recomputed) - sum(plain)) / ranks,
        host=mean_busy - sum(recomputed) / ranks,
        free_communication=sim.iteration_time - free.makespan,
        granularity_by_module={
            m: by_module.get(m, 0.0) / ranks - b for m, b in (module_bounds or {}).items()
        },
        compute=tuple(
            RankCompute(None if loads is None else loads[r], plain[r], recomputed[r], sim.busy[r])
            for r in range(ranks)
        ),
    )


def format_gap(title: str, gap: GapDecomposition) -> str:
    """A table: one row per rank and the mean, seconds and share of the bound."""
    names = [f.name for f in fields(RankGap)]
    lines = [
        f"{title}: makespan {gap.makespan:.3f} s, balanced bound {gap.bound:.3f} s, "
        f"ratio {gap.makespan / gap.bound:.3f}",
        "rank  " + "  ".join(f"{n:>9}" for n in [*names, "total"]),
    ]
    rows: Sequence[tuple[str, list[float]]] = [
        *((str(r), [getattr(g, n) for n in names]) for r, g in enumerate(gap.ranks)),
        ("mean", [gap.mean(n) for n in names]),
    ]
    for label, values in rows:
        lines.append(f"{label:>4}  " + "  ".join(f"{v:9.3f}" for v in [*values, sum(values)]))
    b = gap.bound
    lines.append(
        "mean as share of the bound: "
        + ", ".join(f"{n} {gap.mean(n) / b:+.1%}" for n in names if n != "imbalance")
        + f"; overhead = granularity {gap.granularity / b:+.1%} + recompute "
        f"{gap.recompute / b:+.1%} + host {gap.host / b:+.1%}; "
        f"free communication would save {gap.free_communication:.3f} s "
        f"({gap.free_communication / b:.1%})"
    )
    if gap.granularity_by_module:
        lines.append(
            "granularity by module: "
            + ", ".join(f"{m} {s / b:+.1%}" for m, s in gap.granularity_by_module.items())
        )
    lines.extend(_compute_lines(gap))
    return "\n".join(lines)


def _compute_lines(gap: GapDecomposition) -> list[str]:
    """Each rank's busy time built up, as shares of the bound (`RankCompute.shares`)."""
    if not gap.compute:
        return []
    lines = ["rank busy, share of the bound: whole + granularity + recompute + host = busy"]
    for r, c in enumerate(gap.compute):
        parts = c.shares(gap.bound)
        text = "  ".join(
            f"{n} {'n/a' if v is None else format(v, '+.1%' if n != 'whole' else '.1%')}"
            for n, v in parts.items()
        )
        lines.append(f"{r:>4}  {text}  busy {c.busy / gap.bound:.1%}")
    return lines
