"""Neighbouring cuts of a static one-list placement: one stage boundary moved by one layer.

The static placements (`static_baselines`) cut the modules' layers, as one list, by the cost of
the *average* microbatch. One layer is a coarse unit (a ViT layer is about 5.5% of a rank on
VLM-S), and the batches DIP plans are not the average, so the cost rule's cut need not be the
best one for DIP's plans of those batches. The start-up search therefore also tries the chosen
static cut with one boundary moved by +-1 layer (`placement_climb`), keeping the virtual-stage
structure (Megatron's order stays a candidate plan on it). These are DIP's candidates only: the
stock baselines DIP is compared against keep the cost rule's cut. A neighbour is named after its
base and its layers per stage, "static cost-split v1 cut 18/19/19/39" (module order, then layer
order), which is all `cut_candidate` needs to build it again from the base.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..modelspec import MultimodalSpec
from ..schedule.ir import Placement
from .placement import PlacementCandidate
from .static_baselines import pipeline_from_cuts

# The static placements whose cuts are searched: the one-list cuts (by cost, and by parameters);
# the stock placement's encoder is whole on the first stage by definition.
NEIGHBOUR_BASES = ("cost-split", "params-split")
CUT = " cut "  # between a base's name and the layers per stage


def stage_cuts(placement: Placement, stage_units: list) -> list[tuple[int, int]] | None:
    """Each pipeline stage's [start, end) in the modules' layers as one list (module order, then
    layer order), stage = virtual stage * ranks + rank; None if a stage is not one contiguous run
    or the stages do not cover the list in order (not a one-list cut)."""
    p = placement.num_ranks
    offsets, total = {}, 0
    for layout in placement.modules:
        offsets[layout.name], total = total, total + layout.num_layers
    chunks = {(m.name, c.index): c for m in placement.modules for c in m.chunks}
    cuts = []
    for stage in range(p * len(stage_units[0])):
        runs = sorted(
            (offsets[m] + chunks[m, i].layer_start, offsets[m] + chunks[m, i].layer_end)
            for m, i in stage_units[stage % p][stage // p]
        )
        if not runs or any(a[1] != b[0] for a, b in zip(runs, runs[1:])):
            return None
        cuts.append((runs[0][0], runs[-1][1]))
    starts, ends = [s for s, _ in cuts], [e for _, e in cuts]
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


def base_name(cand: PlacementCandidate) -> str:
    """The static candidate a cut was moved from, "static cost-split v1" (for itself and for
    its moved cuts), from its family and virtual stages."""
    return f"static {cand.family} v{len(cand.stage_units[0])}"


def searched(cand: PlacementCandidate, bases: Sequence[str] = NEIGHBOUR_BASES) -> bool:
    """Whether `cand` is a static one-list placement whose cut the search moves."""
    return cand.stage_units is not None and cand.family in bases


def cut_candidate(
    model: MultimodalSpec, base: PlacementCandidate, sizes: Sequence[int]
) -> PlacementCandidate:
    """`base` (a static one-list candidate) with `sizes[i]` layers on stage i, same ranks and
    virtual stages; ValueError if the sizes do not fit its stages and layers."""
    stages = base.placement.num_ranks * len(base.stage_units[0])
    total = sum(m.num_layers for m in model.modules)
    if len(sizes) != stages or sum(sizes) != total or min(sizes) < 1:
        raise ValueError(
            f"a cut of {base_name(base)!r} needs {stages} positive stage sizes adding up to "
            f"{total} layers, not {'/'.join(map(str, sizes))}"
        )
    ends = [sum(sizes[: i + 1]) for i in range(stages)]
    cuts = list(zip([0, *ends[:-1]], ends))
    items = [(m.name, layer, 0.0) for m in model.modules for layer in range(m.num_layers)]
    p = base.placement.num_ranks
    built = pipeline_from_cuts("", model, items, cuts, p, stages // p)
    name = f"{base_name(base)}{CUT}{'/'.join(map(str, sizes))}"
    return PlacementCandidate(name, built.placement, built.stage_units, family=base.family)


def named_cut(
    model: MultimodalSpec,
    known: Mapping[str, PlacementCandidate],
    name: str,
    *,
    marker: str = CUT,
) -> PlacementCandidate:
    """The candidate `name` names: one of `known` (by its key), or "KEY{marker}SIZES", that
    one's cut with SIZES ("18/19/19/39") layers per stage (`cut_candidate`). KeyError naming
    the known keys for an unknown one, ValueError for sizes that do not fit its stages."""
    head, moved, sizes = name.partition(marker)
    if head not in known:
        raise KeyError(f"unknown static placement {name!r}; known: {', '.join(known)}")
    if not moved:
        return known[head]
    try:
        layers = [int(x) for x in sizes.split("/")]
    except ValueError:
        raise ValueError(f"the layers per stage are not numbers: {sizes!r}") from None
    return cut_candidate(model, known[head], layers)


def neighbour_candidates(
    model: MultimodalSpec, cand: PlacementCandidate
) -> list[PlacementCandidate]:
    """`cand`'s cut with each stage boundary moved by one layer (`moved_boundaries`), none if
    it is not a searched one-list cut (`searched`)."""
    if not searched(cand):
        return []
    cuts = stage_cuts(cand.placement, cand.stage_units)
    if cuts is None:
        return []
    return [cut_candidate(model, cand, [e - s for s, e in new]) for new in moved_boundaries(cuts)]


__all__ = [
    "NEIGHBOUR_BASES",
    "base_name",
    "cut_candidate",
    "moved_boundaries",
    "neighbour_candidates",
    "searched",
    "stage_cuts",
]
