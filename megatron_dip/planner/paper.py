"""The paper's setups as the simulation tools study them (`tools/simulate_paper.py`,
`tools/planner_speed.py`): names checked, the mixtures that suit a setup, and the comparison
(cost model, seeded batch stream, placements sized on calibration batches) built one way."""

from __future__ import annotations

from collections.abc import Sequence

from ..data.stream import BatchStream, StreamConfig
from ..data.synthetic import MIXTURES, SyntheticSource
from ..modelspec import PAPER_SETUPS
from .compare import Comparison, packing_limits
from .cost_model import CostModel
from .devices import get_device
from .search import SearchConfig

# Every mixture a setup is studied on by default ("auto"), where its model suits it.
AUTO_MIXTURES = (
    "mixed",
    "mixed-blend",
    "laion",
    "obelics",
    "text-only",
    "omni",
    "t2v",
    "t2i",
    "t2v-blend",
)


def check_names(setups: str, mixtures: str) -> str | None:
    """The error for comma lists naming an unknown setup or mixture ("auto" is known); None
    when every name is known."""
    for name in setups.split(","):
        if name not in PAPER_SETUPS:
            return f"--setups: unknown setup {name!r}; known: {', '.join(PAPER_SETUPS)}"
    if mixtures != "auto":
        for name in mixtures.split(","):
            if name not in MIXTURES:
                return f"--mixtures: unknown mixture {name!r}; known: {', '.join(MIXTURES)}"
    return None


def mixtures_for(setup_name: str, arg: str, *, auto: Sequence[str] = AUTO_MIXTURES) -> list[str]:
    """The mixtures of `arg` that suit the setup's model ("auto": those of `auto` that do)."""
    model = PAPER_SETUPS[setup_name].model
    if arg == "auto":
        return [m for m in auto if MIXTURES[m].suits(model)]
    return [m for m in arg.split(",") if MIXTURES[m].suits(model)]


def paper_comparison(
    setup_name: str,
    mixture: str,
    *,
    device: str,
    seed: int,
    calibration_batches: int,
    search: SearchConfig,
    placement: str | None = None,
    workers: int = 1,
    memory_scale: float = 1.0,
    gemm_half_rows: int | None = None,
) -> tuple[Comparison, BatchStream]:
    """The `Comparison` of one setup and mixture (placements sized on the stream's first
    `calibration_batches`; DIP's the start-up search's choice, scored on `workers` processes,
    or the one `placement` names, `Comparison.named`) and the seeded batch stream it draws from
    (not advanced). Two what-ifs: `memory_scale` multiplies every activation limit,
    `gemm_half_rows` replaces the cost model's GEMM efficiency knee (0: every GEMM at the
    device's cap, so no sub-microbatch is less efficient than its whole microbatch)."""
    setup = PAPER_SETUPS[setup_name]
    spec = get_device(device)
    knee = {} if gemm_half_rows is None else {"gemm_half_rows": gemm_half_rows}
    cost = CostModel(setup.model, spec, shape=setup.shape, **knee)
    limits = packing_limits(setup.model, setup.seq_length)
    stream = BatchStream(
        SyntheticSource(mixture, model=setup.model, seed=seed),
        config=StreamConfig(
            seed=seed, batch_microbatches=setup.global_batch_microbatches, limits=limits
        ),
    )
    calibration = stream.peek(calibration_batches)
    cmp = Comparison.create(
        setup,
        cost,
        device=spec,
        calibration=calibration,
        search=search,
        placement=placement,
        workers=workers,
        memory_scale=memory_scale,
    )
    return cmp, stream


__all__ = ["AUTO_MIXTURES", "check_names", "mixtures_for", "paper_comparison"]
