"""Static, modality-aware placement: separated segments of every module over all pipeline ranks.

Module i gets K_i = floor(T_i / T_1) pipeline segments (T sorted ascending: per-sample latency of
the module, from the cost model), and is cut into P * K_i chunks of consecutive layers, chunk c on
rank c mod P. Layer counts are balanced by cost, the embedding / projector / output head included
(they are charged to the first and last chunk by the cost model, so those chunks get fewer layers).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from ..modelspec import ModuleSpec, MultimodalSpec
from ..schedule.ir import ChunkSpec, ModuleLayout, Placement, SubMicrobatch
from .candidate_pool import CandidateScorer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleWorkload:
    """A representative unit of work of one module, used to size placements: `instances` items of
    `tokens` tokens in total (e.g. the average microbatch's images and their patches)."""

    instances: int
    tokens: int


def parse_segments(text: str) -> dict[str, int]:
    """Parse a `--dip-segments` value such as ``vit=1,llm=2`` into {module: segments}."""
    result: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(
                f"--dip-segments: {part!r} is not MODULE=N with N >= 1 (example: vit=1,llm=2)"
            )
        result[name.strip()] = int(value)
    return result


def segments_per_module(
    model: MultimodalSpec,
    per_sample_time: Mapping[str, float],
    *,
    override: Mapping[str, int] | None = None,
    cap: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """K_i = floor(T_i / T_min) for every module, at most `cap[i]`, unless `override` names it.
    Modules without work (T_i = 0, e.g. a ViT on text-only data) get one segment."""
    override = dict(override or {})
    unknown = set(override) - {m.name for m in model.modules}
    if unknown:
        raise ValueError(
            f"--dip-segments names unknown module(s) {sorted(unknown)}; "
            f"the model has {[m.name for m in model.modules]}"
        )
    busy = [per_sample_time[m.name] for m in model.modules if per_sample_time[m.name] > 0]
    t_min = min(busy, default=1.0)
    cap = dict(cap or {})
    out = {}
    for m in model.modules:
        k = max(1, math.floor(per_sample_time[m.name] / t_min + 1e-9))
        out[m.name] = override.get(m.name, min(k, cap.get(m.name, k)))
    return out


def balanced_layer_split(
    num_layers: int, num_chunks: int, chunk_cost: Callable[[int, int, int], float]
) -> list[tuple[int, int]]:
    """Cut `num_layers` layers into `num_chunks` non-empty runs, as even in cost as possible.

    `chunk_cost(index, layer_start, layer_end)` is the cost of a chunk; it may charge extra work to
    the first and last chunk. Minimises the costliest chunk, then the sum of squared chunk costs
    (many splits share the same maximum; only the even ones keep every pipeline stage busy).
    Dynamic programme over (chunks, layers): sizes are small.
    """
    if num_chunks > num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_chunks} non-empty chunks")

    @cache
    def best(chunk: int, start: int) -> tuple[float, float, tuple[int, ...]]:
        # Best (max cost, sum of squares, cut points) for chunks chunk.. over layers start..
        remaining = num_chunks - chunk
        if remaining == 1:
            c = chunk_cost(chunk, start, num_layers)
            return c, c * c, (num_layers,)
        options = []
        for end in range(start + 1, num_layers - remaining + 2):
            here = chunk_cost(chunk, start, end)
            rest_max, rest_sq, cuts = best(chunk + 1, end)
            options.append((max(here, rest_max), here * here + rest_sq, (end, *cuts)))
        return min(options)

    *_, cuts = best(0, 0)
    starts = (0, *cuts[:-1])
    return list(zip(starts, cuts))


@dataclass(frozen=True)
class PlacementReport:
    """Per-rank parameter count and activation-memory estimate of a placement."""

    params_per_rank: tuple[int, ...]
    activation_bytes_per_rank: tuple[int, ...]
    segments: dict[str, int]

    def format(self) -> str:
        lines = [f"segments per module: {self.segments}"]
        for r, (p, a) in enumerate(zip(self.params_per_rank, self.activation_bytes_per_rank)):
            lines.append(
                f"  rank {r}: {p / 1e6:9.1f} M params, {a / 2**30:7.2f} GiB activations/mb"
            )
        return "\n".join(lines)


def representative_sub(module: str, work: ModuleWorkload) -> SubMicrobatch:
    """A sub-microbatch of the workload's size (costs placements and static splits)."""
    tokens = max(1, work.tokens)  # a module without work still splits by its weights' cost
    return SubMicrobatch(module, 0, 0, 0, max(1, work.instances), tokens, tokens)


def unit_time(
    cost_model,
    module: str,
    work: ModuleWorkload,
    unit_instances: int | None,
) -> float:
    """Time of one unit of work of a module: a sub-microbatch of `unit_instances` instances of the
    average size (the whole average microbatch when None)."""
    if work.instances <= 0 or work.tokens <= 0:
        return 0.0
    n = work.instances if unit_instances is None else min(work.instances, unit_instances)
    tokens = max(1, round(work.tokens * n / work.instances))
    return cost_model.module_time(module, instances=n, tokens=tokens)


def build_dip_placement(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    workload: Mapping[str, ModuleWorkload],
    segments: Mapping[str, int] | None = None,
    unit_instances: Mapping[str, int] | None = None,
) -> tuple[Placement, PlacementReport]:
    """DIP's separated, interleaved placement of every module over all `num_ranks` ranks.

    K_i = floor(T_i / T_min) where T_i is the time of one unit of module i's work: a
    sub-microbatch of `unit_instances[i]` instances (the LLM's unit is its packed sequence), so
    each module's chunks take about the same time per unit. `segments` overrides K_i.
    """
    units = dict(unit_instances or {})
    per_sample = {
        m.name: unit_time(cost_model, m.name, workload[m.name], units.get(m.name))
        for m in model.modules
    }
    caps = {m.name: max(1, m.num_layers // num_ranks) for m in model.modules}
    k = segments_per_module(model, per_sample, override=segments, cap=caps)
    layouts = []
    for m in model.modules:
        n_chunks = num_ranks * k[m.name]
        if m.num_layers < n_chunks:
            raise ValueError(
                f"module {m.name!r} has {m.num_layers} layers, fewer than the {n_chunks} chunks of "
                f"{k[m.name]} segment(s) over {num_ranks} pipeline ranks; lower "
                "--pipeline-model-parallel-size or --dip-segments"
            )
        sub = representative_sub(m.name, workload[m.name])

        def cost(
            i: int, start: int, end: int, m: ModuleSpec = m, sub: SubMicrobatch = sub
        ) -> float:
            c = cost_model.stage_cost(ChunkSpec(m.name, i, 0, start, end), sub)
            return c.forward + (c.backward if m.trainable else 0.0)

        cuts = balanced_layer_split(m.num_layers, n_chunks, cost)
        chunks = tuple(ChunkSpec(m.name, i, i % num_ranks, s, e) for i, (s, e) in enumerate(cuts))
        layouts.append(ModuleLayout(m.name, m.num_layers, m.trainable, chunks))
    placement = Placement(num_ranks, tuple(layouts))
    return placement, placement_report(placement, cost_model, workload=workload, segments=k)


def placement_report(
    placement: Placement,
    cost_model,
    *,
    workload: Mapping[str, ModuleWorkload],
    segments: Mapping[str, int] | None = None,
) -> PlacementReport:
    """Parameters and activation memory (one representative microbatch) held by each rank."""
    params = [0] * placement.num_ranks
    acts = [0] * placement.num_ranks
    for layout in placement.modules:
        work = workload[layout.name]
        sub = representative_sub(layout.name, work)
        for c in layout.chunks:
            params[c.rank] += cost_model.chunk_params(c)
            if layout.trainable:
                acts[c.rank] += cost_model.stage_cost(c, sub).activation_bytes
    seg = dict(segments or {m.name: m.num_chunks // placement.num_ranks for m in placement.modules})
    return PlacementReport(tuple(params), tuple(acts), seg)


def segment_candidates(
    model: MultimodalSpec, base: Mapping[str, int], *, num_ranks: int
) -> list[dict[str, int]]:
    """Segment counts worth evaluating: the latency rule's answer first, then each module's
    count among {1, 2, 4, K_i, 2 K_i} (capped by its layers), in a deterministic order."""
    options = []
    for m in model.modules:
        cap = max(1, m.num_layers // num_ranks)
        options.append(sorted({min(cap, k) for k in (1, 2, 4, base[m.name], 2 * base[m.name])}))
    out = [dict(base)]
    for combo in itertools.product(*options):
        cand = dict(zip((m.name for m in model.modules), combo))
        if cand not in out:
            out.append(cand)
    return out


@dataclass(frozen=True)
class PlacementCandidate:
    """A placement the start-up search may choose: DIP's separated segments, or a static
    Megatron placement with its virtual stages (`stage_units`, for Megatron's order on it)."""

    name: str
    placement: Placement
    stage_units: list | None = None
    # The rule a static candidate's layers were cut by ("stock", "cost-split", "params-split";
    # a cut the start-up search moved keeps its base's); None for DIP's own segments.
    family: str | None = None


def choose_dip_placement(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    workload: Mapping[str, ModuleWorkload],
    unit_instances: Mapping[str, int] | None,
    evaluate: Callable[[PlacementCandidate], float],
    segments: Mapping[str, int] | None = None,
    extra: Sequence[PlacementCandidate] = (),
    bound: Callable[[PlacementCandidate], float] | None = None,
    workers: int = 1,
    scored: dict[str, PlacementCandidate] | None = None,
) -> tuple[PlacementCandidate, dict[str, float]]:
    """The candidate that makes `evaluate` (e.g. the simulated iteration time of planned
    calibration batches) smallest: DIP placements of several segment counts (the latency rule
    K_i = floor(T_i / T_min) among them) and the `extra` ones (the static Megatron placements,
    so the choice is never slower on those batches than the strongest static one). An explicit
    `segments` (--dip-segments) skips the search. `bound(c)`: a lower bound on `evaluate(c)`;
    candidates are then scored in the order of their bounds and one whose bound exceeds the
    best score so far is not scored (it cannot win): the same choice for less work. `workers`
    processes score that many candidates at a time (`candidate_pool`; `evaluate` must then
    pickle): the same choice again, sooner. Returns the candidate and the scores of the
    candidates scored (for the log); `scored` gains those candidates by name (for
    `placement_ties`)."""
    if segments:
        return segments_candidate(
            model, cost_model, num_ranks=num_ranks, workload=workload, segments=segments
        ), {}
    candidates = _segment_candidates(model, cost_model, num_ranks, workload, unit_instances)
    candidates += list(extra)
    bounds = [0.0] * len(candidates)
    if bound is not None:  # stable: equal bounds keep the candidates' order
        bounds = [bound(c) for c in candidates]
        order = sorted(range(len(candidates)), key=bounds.__getitem__)
        candidates, bounds = [candidates[i] for i in order], [bounds[i] for i in order]
    scores: dict[str, float] = {}
    best: tuple[tuple[float, int, int], PlacementCandidate] | None = None

    def cannot_win(i: int) -> bool:  # bounds ascending: no later candidate can win either
        return best is not None and bounds[i] > best[0][0]

    with CandidateScorer(evaluate, candidates, workers=workers) as scorer:
        for i, score in scorer.scored(range(len(candidates)), stop=cannot_win):
            cand = candidates[i]
            scores[cand.name] = score
            if scored is not None:
                scored[cand.name] = cand
            # Ties go to fewer chunks (fewer messages on a real network), then to the earlier
            # candidate: the choice never depends on which worker finished first.
            key = (score, sum(m.num_chunks for m in cand.placement.modules), i)
            if best is None or key < best[0]:
                best = (key, cand)
    logger.info("placement candidates (segments -> score): %s", scores)
    return best[1], scores


def _segment_candidates(
    model: MultimodalSpec, cost_model, num_ranks: int, workload, unit_instances
) -> list[PlacementCandidate]:
    """DIP placements of the segment counts worth scoring (around the latency rule's)."""
    rule, _ = build_dip_placement(
        model, cost_model, num_ranks=num_ranks, workload=workload, unit_instances=unit_instances
    )
    base = {m.name: m.num_chunks // num_ranks for m in rule.modules}
    candidates = []
    for cand in segment_candidates(model, base, num_ranks=num_ranks):
        candidates.append(
            segments_candidate(
                model, cost_model, num_ranks=num_ranks, workload=workload, segments=cand
            )
        )
    return candidates


def segments_candidate(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    workload: Mapping[str, ModuleWorkload],
    segments: Mapping[str, int],
) -> PlacementCandidate:
    """DIP's placement of `segments` per module, named as the start-up search names it
    ("vit=1,llm=3")."""
    placement, _ = build_dip_placement(
        model, cost_model, num_ranks=num_ranks, workload=workload, segments=segments
    )
    return PlacementCandidate(_segments_name(segments), placement)


def _segments_name(segments: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in segments.items())
