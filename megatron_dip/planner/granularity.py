"""Trading granularity against host overhead: how many segments, how large the sub-microbatches.

More segments and smaller sub-microbatches fill pipeline bubbles, but every extra instruction costs
the runtime host time (`overheads.HostOverheads`). Sub-microbatch sizes count that time as lost
efficiency (`submicrobatch.choose_sub_sizes`); for segments the trade depends on the schedule, so
the candidates (the latency rule's counts and every coarser combination, each module's count
halved towards one) are scored by simulating greedy plans of calibration batches under the cost
model, overheads included (`trade_segments`). A cost model without overheads keeps the rule's
answer unevaluated: then finer is never slower in the model, and nothing needs trading.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..data.sample import BatchMeta
from ..modelspec import MultimodalSpec
from ..schedule.engine import ChannelFn, per_peer_channel
from ..schedule.ir import Placement
from .overheads import host_overheads
from .placement import ModuleWorkload, build_dip_placement
from .simulator import simulate
from .stock_configs import fits
from .submicrobatch import choose_sub_sizes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Granularity:
    """Segments per module, sub-microbatch sizes of the split modules, and the placement."""

    segments: dict[str, int]
    sub_sizes: dict[str, int]
    placement: Placement

    @property
    def name(self) -> str:
        parts = [f"{k}={v}" for k, v in self.segments.items()]
        parts += [f"{k}/{v}" for k, v in self.sub_sizes.items()]
        return ",".join(parts)

    @property
    def num_chunks(self) -> int:
        return sum(m.num_chunks for m in self.placement.modules)


def granularity(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    workload: Mapping[str, ModuleWorkload],
    segments: Mapping[str, int],
    given_sizes: Mapping[str, int] | None = None,
) -> Granularity:
    """The placement of `segments` and the sub-microbatch sizes that go with it (the host time
    of a pass through each module's P x K chunks counted)."""
    chunks = {name: num_ranks * k for name, k in segments.items()}
    sizes = choose_sub_sizes(model, cost_model, workload, given=given_sizes, chunks=chunks)
    placement, _ = build_dip_placement(
        model, cost_model, num_ranks=num_ranks, workload=workload, segments=segments
    )
    return Granularity(dict(segments), sizes, placement)


def coarser_segments(segments: Mapping[str, int]) -> list[dict[str, int]]:
    """`segments` first, then every combination of each module's count halved (rounded down)
    towards one, finest first."""
    chains = []
    for k in segments.values():
        chain = [k]
        while chain[-1] > 1:
            chain.append(chain[-1] // 2)
        chains.append(chain)
    return [dict(zip(segments, combo)) for combo in itertools.product(*chains)]


def greedy_score(
    planner,
    batches: Sequence[BatchMeta],
    *,
    limits: Sequence[float] | None,
    channel: ChannelFn = per_peer_channel,
) -> float:
    """Mean simulated iteration time (cost model of `planner`, host overheads included) of the
    greedy plans of `batches` (replica 0); a plan whose activations exceed `limits` counts
    double."""
    times = []
    for batch in batches:
        plan = planner.plan_layout(planner.layout(batch), 0, search=False).plan
        sim = simulate(plan, planner.cost_model, channel=channel)
        times.append(sim.iteration_time * (1 if limits is None or fits(sim, limits) else 2))
    return sum(times) / len(times)


def trade_segments(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    workload: Mapping[str, ModuleWorkload],
    segments: Mapping[str, int],
    evaluate: Callable[[Granularity], float],
    given_sizes: Mapping[str, int] | None = None,
) -> tuple[Granularity, dict[str, float]]:
    """The fastest by `evaluate` (e.g. `greedy_score` of a planner on the candidate) of
    `segments` and its `coarser_segments`, each with its own sub-microbatch sizes; ties go to
    fewer chunks. Without host overheads in `cost_model`, `segments` as they are (no scores).
    Returns the choice and every candidate's score (for the log)."""
    make = dict(
        model=model, cost_model=cost_model, num_ranks=num_ranks, workload=workload,
        given_sizes=given_sizes,
    )  # fmt: skip
    if host_overheads(cost_model).is_zero:
        return granularity(segments=segments, **make), {}
    best, scores = None, {}
    for candidate in coarser_segments(segments):
        g = granularity(segments=candidate, **make)
        scores[g.name] = score = evaluate(g)
        if best is None or (score, g.num_chunks) < best[0]:
            best = ((score, g.num_chunks), g)
    logger.info("granularity candidates (simulated seconds): %s", scores)
    return best[1], scores


__all__ = ["Granularity", "coarser_segments", "granularity", "greedy_score", "trade_segments"]
