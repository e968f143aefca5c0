"""Neighbouring cuts of a static one-list placement: one stage boundary moved by one layer.

The static placements (`static_baselines`) cut the modules' layers, as one list, by the cost of
the *average* microbatch. One layer is a coarse unit (a ViT layer is about 5.5% of a rank on
VLM-S), and the batches DIP plans are not the average, so the cost rule's cut need not be the
best one for DIP's plans of those batches. The start-up search (`placement.choose_dip_placement`)
therefore also scores each static cut with one boundary moved by +-1 layer, with the same
virtual-stage structure (Megatron's order stays a candidate plan on it). These are DIP's
candidates only: the stock baselines DIP is compared against keep the cost rule's cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..modelspec import MultimodalSpec
from .placement import PlacementCandidate
from .placement_search import static_candidates
from .static_baselines import StaticPipeline, pipeline_from_cuts

# The static placements whose neighbours are searched: the one-list cuts (by cost, and by
# parameters); the stock placement's encoder is whole on the first stage by definition.
NEIGHBOUR_BASES = ("cost-split", "params-split")


def stage_cuts(pipeline: StaticPipeline) -> list[tuple[int, int]] | None:
    """Each pipeline stage's [start, end) in the modules' layers as one list (module order, then
    layer order), stage = virtual stage * ranks + rank; None if a stage is not one contiguous run
    or the stages do not cover the list in order (not a one-list cut)."""
    placement, p = pipeline.placement, pipeline.placement.num_ranks
    offsets, total = {}, 0
    for layout in placement.modules:
        offsets[layout.name], total = total, total + layout.num_layers
    chunks = {(m.name, c.index): c for m in placement.modules for c in m.chunks}
    cuts = []
    for stage in range(p * pipeline.num_model_chunks):
        units = pipeline.stage_units[stage % p][stage // p]
        runs = sorted(
            (offsets[m] + chunks[m, i].layer_start, offsets[m] + chunks[m, i].layer_end)
            for m, i in units
        )
        if not runs or any(a[1] != b[0] for a, b in zip(runs, runs[1:])):
            return None
        cuts.append((runs[0][0], runs[-1][1]))
    starts = [s for s, _ in cuts]
    ends = [e for _, e in cuts]
    if starts[0] != 0 or ends[-1] != total or starts[1:] != ends[:-1]:
        return None
    return cuts


def moved_boundaries(cuts: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`cuts` with one interior boundary moved by -1 or +1 layer, every stage kept non-empty;
    boundary by boundary, -1 before +1."""
    out = []
    for b in range(1, len(cuts)):
        for delta in (-1, 1):
            new = [list(c) for c in cuts]
            new[b - 1][1] += delta
            new[b][0] += delta
            if all(s < e for s, e in new):
                out.append([(s, e) for s, e in new])
    return out


def neighbour_pipelines(
    model: MultimodalSpec, pipeline: StaticPipeline
) -> list[tuple[str, StaticPipeline]]:
    """`pipeline` with each stage boundary moved by one layer (`moved_boundaries`), each with
    its layers per stage ("18/18/19/40"); none if it is not a one-list cut."""
    cuts = stage_cuts(pipeline)
    if cuts is None:
        return []
    items = [(m.name, layer, 0.0) for m in model.modules for layer in range(m.num_layers)]
    p, v = pipeline.placement.num_ranks, pipeline.num_model_chunks
    return [
        (
            "/".join(str(e - s) for s, e in new),
            pipeline_from_cuts(pipeline.name, model, items, new, p, v),
        )
        for new in moved_boundaries(cuts)
    ]


def neighbour_candidates(
    model: MultimodalSpec,
    static: Sequence[StaticPipeline],
    bases: Sequence[str] = NEIGHBOUR_BASES,
) -> list[PlacementCandidate]:
    """The neighbouring cuts of the static placements named in `bases`, as search candidates
    ("static cost-split v1 cut 18/18/19/40"), each with its virtual stages."""
    out = []
    for q in (q for q in static if q.name in bases):
        for sizes, n in neighbour_pipelines(model, q):
            name = f"static {q.name} v{q.num_model_chunks} cut {sizes}"
            out.append(PlacementCandidate(name, n.placement, n.stage_units))
    return out


def search_candidates(
    model: MultimodalSpec, static: Sequence[StaticPipeline]
) -> list[PlacementCandidate]:
    """The static candidates of the start-up search: the static placements, then their
    neighbouring cuts."""
    return static_candidates(static) + neighbour_candidates(model, static)


__all__ = [
    "NEIGHBOUR_BASES",
    "moved_boundaries",
    "neighbour_candidates",
    "neighbour_pipelines",
    "search_candidates",
    "stage_cuts",
]
