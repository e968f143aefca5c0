"""Megatron's recompute flags and the memory policy they stand for, both ways: `recompute_mode`
reads `--recompute-granularity/--recompute-method/--recompute-num-layers` (refusing a combination
Megatron-LM refuses), `recompute_flags` writes a policy back as those flags (the emulated stock
runs of the benchmarks pass them)."""

from __future__ import annotations

from megatron_dip.schedule.ir import NO_RECOMPUTE, MemoryPolicy, Recompute

from .arguments import TrainConfig
from .arguments import fail as _fail


def recompute_mode(config: TrainConfig) -> MemoryPolicy:
    """The memory policy of Megatron's recompute flags: `--recompute-granularity selective`,
    `full` (the whole chunk), `full --recompute-method block|uniform --recompute-num-layers N`."""
    m = config.model
    if m.recompute_method is None:
        if m.recompute_num_layers is not None:
            raise _fail("--recompute-num-layers", "needs --recompute-method block|uniform")
        if not m.recompute_granularity:
            return NO_RECOMPUTE
        return MemoryPolicy(Recompute(m.recompute_granularity))
    if m.recompute_granularity != "full":
        raise _fail(
            "--recompute-method",
            f"needs --recompute-granularity full (got {m.recompute_granularity}), as in Megatron-LM",
        )
    layers = 1 if m.recompute_num_layers is None else m.recompute_num_layers
    if layers < 1:
        raise _fail("--recompute-num-layers", f"must be >= 1, got {layers}")
    return MemoryPolicy(Recompute(m.recompute_method), layers)


def recompute_flags(mode: MemoryPolicy) -> list[str]:
    """Megatron's flags that `recompute_mode` reads back as `mode` (the inverse); offload has
    no flag here (the stock runtime recomputes only)."""
    if mode.offload:
        raise ValueError(f"memory policy {mode.label}: offload has no Megatron recompute flag")
    method, layers = mode.method, mode.layers
    if method is Recompute.NONE:
        return []
    if method in (Recompute.SELECTIVE, Recompute.FULL):
        return ["--recompute-granularity", method.value]
    return [
        "--recompute-granularity", "full", "--recompute-method", method.value,
        "--recompute-num-layers", str(layers),
    ]  # fmt: skip
