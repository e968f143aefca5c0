"""Static, modality-aware placement: separated segments of every module over all pipeline ranks.

Module i gets K_i = floor(T_i / T_1) pipeline segments (T sorted ascending: per-sample latency of
the module, from the cost model), and is cut into P * K_i chunks of consecutive layers, chunk c on
rank c mod P. Layer counts are balanced by cost, the embedding / projector / output head included
(they are charged to the first and last chunk by the cost model, so those chunks get fewer layers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache

from ..modelspec import ModuleSpec, MultimodalSpec
from ..schedule.ir import ChunkSpec, ModuleLayout, Placement, SubMicrobatch

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
) -> dict[str, int]:
    """K_i = floor(T_i / T_min) for every module, unless `override` names it."""
    override = dict(override or {})
    unknown = set(override) - {m.name for m in model.modules}
    if unknown:
        raise ValueError(
            f"--dip-segments names unknown module(s) {sorted(unknown)}; "
            f"the model has {[m.name for m in model.modules]}"
        )
    t_min = min(per_sample_time[m.name] for m in model.modules)
    if t_min <= 0:
        raise ValueError(f"per-sample module times must be positive, got {dict(per_sample_time)}")
    return {
        m.name: override.get(m.name, max(1, math.floor(per_sample_time[m.name] / t_min + 1e-9)))
        for m in model.modules
    }


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


def _representative_sub(module: ModuleSpec, work: ModuleWorkload) -> SubMicrobatch:
    return SubMicrobatch(module.name, 0, 0, 0, max(1, work.instances), work.tokens, work.tokens)


def build_dip_placement(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    workload: Mapping[str, ModuleWorkload],
    segments: Mapping[str, int] | None = None,
) -> tuple[Placement, PlacementReport]:
    """DIP's separated, interleaved placement of every module over all `num_ranks` ranks."""
    per_sample = {
        m.name: cost_model.module_time(
            m.name, instances=workload[m.name].instances, tokens=workload[m.name].tokens
        )
        / max(1, workload[m.name].instances)
        for m in model.modules
    }
    k = segments_per_module(model, per_sample, override=segments)
    layouts = []
    for m in model.modules:
        n_chunks = num_ranks * k[m.name]
        if m.num_layers < n_chunks:
            raise ValueError(
                f"module {m.name!r} has {m.num_layers} layers, fewer than the {n_chunks} chunks of "
                f"{k[m.name]} segment(s) over {num_ranks} pipeline ranks; lower "
                "--pipeline-model-parallel-size or --dip-segments"
            )
        sub = _representative_sub(m, workload[m.name])

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
        sub = SubMicrobatch(layout.name, 0, 0, 0, max(1, work.instances), work.tokens, work.tokens)
        for c in layout.chunks:
            params[c.rank] += cost_model.chunk_params(c)
            if layout.trainable:
                acts[c.rank] += cost_model.stage_cost(c, sub).activation_bytes
    seg = dict(segments or {m.name: m.num_chunks // placement.num_ranks for m in placement.modules})
    return PlacementReport(tuple(params), tuple(acts), seg)
