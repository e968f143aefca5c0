"""Static pipeline placements a Megatron user could choose, for honest baselines.

* `stock`: Megatron-Core's LLaVA-style placement: the encoder (ViT / text encoder) whole on the
  first pipeline stage, together with the first slice of the LLM/DiT, whose layers are split so
  that the *average* batch is balanced (the best tuning Megatron's uneven-first-stage flags allow).
* `params`: encoder and LLM layers as one list, cut into P*V stages by parameter count (the
  paper's Megatron-LM baseline).
* `cost`: the same list cut by cost on the average batch (the strongest static pipeline), with
  one model chunk per rank and with each of `INTERLEAVED_CHUNKS` (Megatron's virtual pipeline
  sizes: more chunks shorten the interleaved schedule's fill and drain and send more messages;
  which wins depends on the model, e.g. 8 on VLM-M mixed, 4 on VLM-L mixed).

Each returns the `Placement` and the per-rank virtual-stage units for
`schedule.baselines.build_megatron_plan`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ..modelspec import MultimodalSpec
from ..schedule.ir import ChunkSpec, ModuleLayout, Placement
from .placement import ModuleWorkload, balanced_layer_split, representative_sub

logger = logging.getLogger(__name__)

# The model chunks per rank of the interleaved cost-split placements (`static_pipelines`): the
# virtual pipeline sizes a Megatron expert tries. Against 2 chunks, simulated on VLM-M mixed 3
# chunks gave -2.6%, 4: -1.5%, 5: -0.1%, 6: -3.9%, 8: -8.3%, 12: -3.4%, 16: +2.2%; on VLM-L mixed
# (batch 0) 3: -3.9%, 4: -4.6%, 6: +0.8%, 8: -1.9%.
INTERLEAVED_CHUNKS = (2, 3, 4, 6, 8)

Units = list[list[list[tuple[str, int]]]]  # [rank][virtual stage] -> (module, chunk) units


@dataclass(frozen=True)
class StaticPipeline:
    """A static placement with Megatron's virtual-stage structure."""

    name: str
    placement: Placement
    stage_units: Units
    num_model_chunks: int


def _layer_weights(
    model: MultimodalSpec, cost_model, workload: Mapping[str, ModuleWorkload], by: str
) -> list[tuple[str, int, float]]:
    items = []
    for m in model.modules:
        w = workload[m.name]
        sub = representative_sub(m.name, w)
        for layer in range(m.num_layers):
            chunk = ChunkSpec(m.name, 0, 0, layer, layer + 1)
            if by == "params":
                weight = float(cost_model.chunk_params(chunk))
            else:
                c = cost_model.stage_cost(chunk, sub)
                weight = c.forward + (c.backward if m.trainable else 0.0)
            items.append((m.name, layer, weight))
    return items


def pipeline_from_cuts(
    name: str,
    model: MultimodalSpec,
    items: list[tuple[str, int, float]],
    cuts: list[tuple[int, int]],
    num_ranks: int,
    v: int,
) -> StaticPipeline:
    """The pipeline whose stage i holds the `items` (module, layer, weight) in `cuts[i]`,
    stage i on rank i mod `num_ranks` as its virtual stage i // `num_ranks` (of `v`)."""
    runs: dict[str, list[tuple[int, int, int]]] = {
        m.name: [] for m in model.modules
    }  # (stage, start, end)
    for stage, (s, e) in enumerate(cuts):
        for m in model.modules:
            layers = [layer for (mod, layer, _) in items[s:e] if mod == m.name]
            if layers:
                runs[m.name].append((stage, layers[0], layers[-1] + 1))
    units: Units = [[[] for _ in range(v)] for _ in range(num_ranks)]
    layouts = []
    for m in model.modules:
        chunks = []
        for index, (stage, start, end) in enumerate(runs[m.name]):
            rank = stage % num_ranks
            chunks.append(ChunkSpec(m.name, index, rank, start, end))
            units[rank][stage // num_ranks].append((m.name, index))
        layouts.append(ModuleLayout(m.name, m.num_layers, m.trainable, tuple(chunks)))
    return StaticPipeline(name, Placement(num_ranks, tuple(layouts)), units, v)


def one_list_pipeline(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    num_model_chunks: int,
    workload: Mapping[str, ModuleWorkload],
    by: str,
) -> StaticPipeline:
    """All modules' layers as one list cut into P*V stages balanced by `by` ("params"|"cost")."""
    if by not in ("params", "cost"):
        raise ValueError(f"split by 'params' or 'cost', not {by!r}")
    items = _layer_weights(model, cost_model, workload, by)
    stages = num_ranks * num_model_chunks
    cuts = balanced_layer_split(len(items), stages, lambda i, s, e: sum(w for *_, w in items[s:e]))
    return pipeline_from_cuts(f"{by}-split", model, items, cuts, num_ranks, num_model_chunks)


def stock_pipeline(
    model: MultimodalSpec,
    cost_model,
    *,
    num_ranks: int,
    num_model_chunks: int,
    workload: Mapping[str, ModuleWorkload],
) -> StaticPipeline:
    """Encoders whole on the first stage; the loss module's layers split for the average batch."""
    items = _layer_weights(model, cost_model, workload, "cost")
    loss = model.loss_module.name
    encoder_cost = sum(w for mod, _, w in items if mod != loss)
    tail = [(mod, layer, w) for mod, layer, w in items if mod == loss]
    stages = num_ranks * num_model_chunks

    def cost(i: int, s: int, e: int) -> float:
        return sum(w for *_, w in tail[s:e]) + (encoder_cost if i == 0 else 0.0)

    tail_cuts = balanced_layer_split(len(tail), stages, cost)
    offset = len(items) - len(tail)
    cuts = [(0 if i == 0 else s + offset, e + offset) for i, (s, e) in enumerate(tail_cuts)]
    return pipeline_from_cuts("stock", model, items, cuts, num_ranks, num_model_chunks)


def static_pipelines(
    model: MultimodalSpec, cost_model, *, num_ranks: int, workload: Mapping[str, ModuleWorkload]
) -> list[StaticPipeline]:
    """The static placements a Megatron user can build: encoder on the first stage, with one
    and two model chunks per rank (1F1B, interleaved); one layer list cut by cost, with one and
    with each of `INTERLEAVED_CHUNKS`; one list cut by parameters (interleaved). Those the
    model's layers cannot fill (fewer layers than stages) are left out."""
    kwargs = {"num_ranks": num_ranks, "workload": workload}
    builders = [
        (stock_pipeline, {"num_model_chunks": 1}),
        (stock_pipeline, {"num_model_chunks": 2}),
        (one_list_pipeline, {"num_model_chunks": 1, "by": "cost"}),
        (one_list_pipeline, {"num_model_chunks": 2, "by": "params"}),
        *((one_list_pipeline, {"num_model_chunks": v, "by": "cost"}) for v in INTERLEAVED_CHUNKS),
    ]
    out = []
    for build, options in builders:
        if options["num_model_chunks"] > 1 and num_ranks < 2:
            continue  # interleaving needs a pipeline
        try:
            out.append(build(model, cost_model, **options, **kwargs))
        except ValueError as e:  # too few layers for the stages
            logger.debug("static placement %s %s left out: %s", build.__name__, options, e)
    return out
