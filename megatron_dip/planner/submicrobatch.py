"""Choosing sub-microbatch sizes: the smallest size that keeps the device efficient.

The paper's rule picks, per module, the smallest size whose efficiency keeps 95% of the peak. The
runtime's host time per instruction (`overheads.HostOverheads`) computes nothing, so it is
counted as lost efficiency: a sub-microbatch's pass through a module of C chunks runs 2C compute
instructions (C without backward), each next to about one posted batch of messages; the smaller
the size, the larger that share, and with large overheads the choice grows.

The split itself (sub-microbatches and their dependencies, from metadata) is
`batching.split`, shared with the runtime and the reference models.
"""

from __future__ import annotations

from collections.abc import Mapping

from .overheads import host_overheads


def choose_sub_size(
    cost_model,
    module: str,
    *,
    tokens_per_instance: int,
    max_size: int = 64,
    threshold: float = 0.95,
    host_seconds: float = 0.0,
) -> int:
    """Smallest sub-microbatch size whose efficiency keeps `threshold` of the peak efficiency;
    `host_seconds`: host time of one sub-microbatch's whole pass through the module, spread over
    its layers as time that computes nothing."""
    per_layer = host_seconds / cost_model.model.module(module).num_layers
    curve = [
        cost_model.efficiency(
            module, instances=b, tokens_per_instance=tokens_per_instance, host_seconds=per_layer
        )
        for b in range(1, max_size + 1)
    ]
    peak = max(curve)
    return next(b for b, e in enumerate(curve, start=1) if e >= threshold * peak)


def pass_host_seconds(cost_model, module: str, *, chunks: int) -> float:
    """Host seconds of one sub-microbatch's pass through `module` cut into `chunks` chunks
    (a forward and, where the module needs one, a backward instruction per chunk)."""
    per_chunk = 2 if cost_model.needs_backward(module) else 1
    return host_overheads(cost_model).per_pass(per_chunk * chunks)


def choose_sub_sizes(
    model,
    cost_model,
    workload: Mapping,
    *,
    given: Mapping[str, int] | None = None,
    chunks: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Sub-microbatch size of every split module (`split_modules`): `given` where named, else
    `choose_sub_size` on the module's average instance size (`workload[name]`: a
    `ModuleWorkload`), counting the host time of a pass through its `chunks[name]` chunks
    (none counted where `chunks` does not name it)."""
    sizes = dict(given or {})
    for m in split_modules(model):
        if m.name in sizes:
            continue
        per = max(1, workload[m.name].tokens // max(1, workload[m.name].instances))
        n = (chunks or {}).get(m.name, 0)
        host = pass_host_seconds(cost_model, m.name, chunks=n) if n else 0.0
        sizes[m.name] = choose_sub_size(
            cost_model, m.name, tokens_per_instance=per, host_seconds=host
        )
    return sizes


def split_modules(model) -> list:
    """The modules split into sub-microbatches of a chosen size (all but those whose modality
    runs the whole microbatch at once, the LLM)."""
    from ..modalities import modality_of

    return [m for m in model.modules if not modality_of(m).whole_microbatch]
