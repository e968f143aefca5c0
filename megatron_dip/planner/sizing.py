"""The sizing decisions of a run, made once before it starts: how many segments each module is
cut into (`automatic_segments`, the latency rule), how much memory each rank has for activations
(`activation_limits`, `activation_budget`) and how much the largest stage needs even under full
recomputation (`activation_need`), from the average work of a few calibration microbatches
(`average_workload`). Training's start-up sizing (`training.config.layout`) and the studies
(`compare`) decide with these."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..batching import MicrobatchWork
from ..modelspec import MultimodalSpec
from ..schedule.ir import MemoryPolicy, Placement, Recompute
from .devices import DeviceSpec
from .placement import ModuleWorkload, segments_per_module

logger = logging.getLogger(__name__)

BYTES_PER_PARAM = 18  # bf16 weight + fp32 grad + fp32 master + two fp32 Adam moments
FROZEN_BYTES_PER_PARAM = 2  # a frozen module keeps its bf16 weights only


def average_workload(
    model: MultimodalSpec, works: Sequence[MicrobatchWork]
) -> dict[str, ModuleWorkload]:
    """Average per-microbatch instances and tokens of every module (sizes static placements)."""
    out = {}
    for m in model.modules:
        subs = [s for w in works for s in w.submicrobatches if s.module == m.name]
        n = max(1, len(works))
        out[m.name] = ModuleWorkload(
            round(sum(s.num_instances for s in subs) / n), round(sum(s.tokens for s in subs) / n)
        )
    return out


def activation_limits(
    placement: Placement,
    cost_model,
    *,
    device: DeviceSpec,
    reserve: float = 0.1,
) -> list[float]:
    """Per-rank activation budget: device memory minus weights/grads/optimizer and a reserve.
    A rank holds its tensor-parallel shard of each chunk's parameters (the TP size of the
    cost model's `shape`, which prices that rank)."""
    tp = cost_model.shape.tp
    static = [0.0] * placement.num_ranks
    for m in placement.modules:
        per_param = BYTES_PER_PARAM if m.trainable else FROZEN_BYTES_PER_PARAM
        for c in m.chunks:
            static[c.rank] += cost_model.chunk_params(c) / tp * per_param
    return [device.memory_bytes * (1 - reserve) - s for s in static]


def automatic_segments(model: MultimodalSpec, cost_model, workload, pp: int) -> dict[str, int]:
    """K_i = floor(T_i / T_min) per module (the paper's rule), capped so that each of the
    P * K_i chunks keeps at least one layer (logged when the cap applies)."""
    per_sample = {
        m.name: cost_model.module_time(
            m.name, instances=workload[m.name].instances, tokens=workload[m.name].tokens
        )
        / max(1, workload[m.name].instances)
        for m in model.modules
    }
    wanted = segments_per_module(model, per_sample)
    capped = {m.name: max(1, min(wanted[m.name], m.num_layers // pp)) for m in model.modules}
    if capped != wanted:
        logger.info(
            "segments per module %s capped to %s: %d pipeline ranks need a layer per chunk",
            wanted,
            capped,
            pp,
        )
    return capped


def activation_need(
    placement: Placement, cost_model, works: list[MicrobatchWork], model: MultimodalSpec
) -> tuple[float, str]:
    """Bytes the largest stage holds even under full recomputation: no plan needs less on its
    rank. Returns (bytes, which stage)."""
    best, where = 0.0, ""
    trainable = {m.name for m in model.modules if m.trainable}
    for layout in placement.modules:
        if layout.name not in trainable:
            continue
        subs = [s for w in works for s in w.submicrobatches if s.module == layout.name]
        for chunk in layout.chunks:
            for sub in subs:
                need = cost_model.chunk_activation_bytes(chunk, sub, MemoryPolicy(Recompute.FULL))
                if need > best:
                    best, where = need, f"{layout.name} chunk {chunk.index} on rank {chunk.rank}"
    return best, where


class MemoryBudgetError(ValueError):
    """No plan fits: the largest stage needs `need` bytes (`where`) even under full
    recomputation, more than the `budget` bytes a rank has for activations (`given`: a budget
    the user set; otherwise what the device leaves after weights and optimizer state)."""

    def __init__(self, *, need: float, where: str, budget: float, given: bool) -> None:
        super().__init__(f"{where} needs {need:.0f} bytes of activations, {budget:.0f} are left")
        self.need, self.where, self.budget, self.given = need, where, budget, given


def activation_budget(
    placement: Placement,
    cost_model,
    works: list[MicrobatchWork],
    model: MultimodalSpec,
    *,
    given_bytes: float | None,
    device: DeviceSpec | None,
) -> list[float] | None:
    """Each rank's activation memory limit: `given_bytes` on every rank when set, else the
    device's `activation_limits` (None without a device: no limit); `MemoryBudgetError` when
    the largest stage cannot fit even under full recomputation."""
    need, where = activation_need(placement, cost_model, works, model)
    if given_bytes is not None:
        if given_bytes < need:
            raise MemoryBudgetError(need=need, where=where, budget=given_bytes, given=True)
        return [given_bytes] * placement.num_ranks
    if device is None:
        return None
    limit = activation_limits(placement, cost_model, device=device)
    if min(limit) < need:
        raise MemoryBudgetError(need=need, where=where, budget=min(limit), given=False)
    return limit
