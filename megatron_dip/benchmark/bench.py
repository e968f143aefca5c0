"""Benchmark presets and the in-process steps of `tools/bench_schedules.py`.

A `BenchPreset` names a paper setup as an emulated cluster: one process per pipeline rank (the
paper's TP is folded into the cost model), DIP's segments and sub-microbatch sizes coarse enough
that every emulated instruction lasts >= 50 ms at a scale where an iteration takes seconds (two
cores' scheduling noise is ~1 ms per operation, EMULATION.md), and the data mixture. Before
launching, `best_stock_placements` picks, for each stock schedule, the static placement a
Megatron user would choose (LLaVA-style, or one layer list cut by parameters or by cost) by
simulating the run's first batches; `auto_scale` sizes the emulation scale from the shortest
DIP instruction. `summarize` turns the runs' metrics lines into the table's numbers.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megatron_dip.planner.simulator import stage_costs
from megatron_dip.schedule.engine import single_channel
from megatron_dip.schedule.ir import Plan

logger = logging.getLogger(__name__)

STOCK_PLACEMENTS = ("llava", "params", "cost")


@dataclass(frozen=True)
class BenchPreset:
    """An emulated benchmark run: entry point, sizes and the flags every schedule shares."""

    name: str
    script: str
    pipeline_parallel: int
    tensor_parallel: int
    mixture: str
    dip_flags: tuple[str, ...] = ()
    shared_flags: tuple[str, ...] = ()
    description: str = ""
    # Auto scale: DIP's shortest instruction lasts --min-op-ms, ignoring the shortest ones that
    # together hold at most this share of the compute (T2V: the frozen text encoder's ~1 ms
    # forwards, a few percent of the time, would otherwise force a 50x scale).
    short_op_share: float = 0.0

    def world_size(self, *, emulate: bool) -> int:
        """Processes of one run: a pipeline's ranks when emulating (TP folded), else TP x PP."""
        return self.pipeline_parallel * (1 if emulate else self.tensor_parallel)

    def base_flags(self, mixture: str | None = None, *, emulate: bool = True) -> list[str]:
        """Flags of every run of this preset (schedule-specific ones are added per run)."""
        return [
            *(["--dip-emulate-compute"] if emulate else []),
            "--model", self.name,
            "--tensor-model-parallel-size", str(self.tensor_parallel),
            "--pipeline-model-parallel-size", str(self.pipeline_parallel),
            "--dip-data", f"synthetic-{mixture or self.mixture}",
            "--lr", "1e-4", "--train-iters", "1",  # runs append their own --train-iters
            *self.shared_flags,
        ]  # fmt: skip


BENCH_PRESETS: dict[str, BenchPreset] = {
    "vlm-s": BenchPreset(
        name="vlm-s",
        script="pretrain_vlm_dip.py",
        pipeline_parallel=4,
        tensor_parallel=4,
        mixture="mixed",
        dip_flags=("--dip-segments", "vit=2,llm=2", "--dip-sub-microbatch-size", "vit=16"),
        shared_flags=("--sequence-parallel",),
        description="VLM-S (ViT-H 0.6B + 7B LLM), TP4 x PP4 of the paper as 4 emulated ranks",
    ),
    "t2v-s": BenchPreset(
        name="t2v-s",
        script="pretrain_diffusion_dip.py",
        pipeline_parallel=4,
        tensor_parallel=4,
        mixture="t2v",
        dip_flags=("--dip-segments", "text=1,dit=1", "--dip-sub-microbatch-size", "dit=2"),
        shared_flags=("--sequence-parallel",),
        description="T2V-S (T5 text encoder + DiT), TP4 x PP4 as 4 emulated ranks",
        short_op_share=0.05,
    ),
    "omni-s": BenchPreset(
        name="omni-s",
        script="pretrain_vlm_dip.py",
        pipeline_parallel=4,
        tensor_parallel=4,
        mixture="omni",
        dip_flags=(
            "--dip-segments",
            "vit=2,audio=1,llm=2",
            "--dip-sub-microbatch-size",
            "vit=16,audio=8",
        ),  # fmt: skip
        shared_flags=("--sequence-parallel",),
        description="ViT-5B + Whisper-large + Llama-3-8B, TP4 x PP4 as 4 emulated ranks",
        short_op_share=0.05,
    ),
    "vlm-l": BenchPreset(
        name="vlm-l",
        script="pretrain_vlm_dip.py",
        pipeline_parallel=8,
        tensor_parallel=8,
        mixture="mixed",
        dip_flags=("--dip-segments", "vit=2,llm=2", "--dip-sub-microbatch-size", "vit=16"),
        shared_flags=("--sequence-parallel",),
        description="VLM-L, PP8 of the paper as 8 emulated ranks (TP folded)",
    ),
}


def resolve_run(flags: Sequence[str], *, world_size: int):
    """The `RunSpec` a run with `flags` would have (no process group is created)."""
    from megatron_dip.training.arguments import parse_config
    from megatron_dip.training.validate import resolve

    return resolve(parse_config(list(flags)), world_size=world_size, cuda=False)


def first_batches(spec, count: int) -> list:
    """The run's first `count` global batches (metadata), as its training stream draws them."""
    from megatron_dip.training.data_source import make_stream

    t = spec.config.train
    stream = make_stream(
        spec.data, spec.model, seed=t.seed, global_batch_size=t.global_batch_size,
        limits=spec.limits,
    )  # fmt: skip
    return stream.peek(count)


def stock_outcome(spec, batches: Sequence) -> tuple[float, bool]:
    """Mean simulated iteration time of Megatron's schedule on `spec`'s stock placement and
    recompute, and whether its activations fit the device (the memory left after weights,
    gradients and optimizer state, as for DIP's plans)."""
    from megatron_dip.planner.compare import activation_limits
    from megatron_dip.planner.simulator import simulate
    from megatron_dip.training.planning import stock_plan

    limits = activation_limits(
        spec.placement, spec.cost_model, device=spec.device,
        tensor_parallel=spec.planner.tensor_parallel,
    )  # fmt: skip
    times, fits = [], True
    for b in batches:
        sim = simulate(stock_plan(spec, b, 0), spec.cost_model, channel=single_channel)
        times.append(sim.iteration_time)
        fits &= all(p <= lim for p, lim in zip(sim.peak_activation_bytes, limits))
    return sum(times) / len(times), fits


@dataclass(frozen=True)
class StockChoice:
    """The placement and recompute picked for one stock schedule, and the simulated time of
    every combination tried ("placement/recompute" -> seconds; None: activations do not fit)."""

    schedule: str
    placement: str
    recompute: str | None
    simulated_s: dict[str, float | None] = field(default_factory=dict)

    def flags(self) -> list[str]:
        out = ["--dip-schedule", self.schedule, "--dip-stock-placement", self.placement]
        return out + (["--recompute-granularity", self.recompute] if self.recompute else [])


def best_stock_placements(
    flags: Sequence[str], *, world_size: int, batches: int, schedules: Sequence[str]
) -> list[StockChoice]:
    """For each stock schedule, the fastest (placement, uniform recompute) whose activations
    fit, by simulating the run's first batches (what a Megatron user would tune)."""
    from megatron_dip.training.validate import ConfigError

    choices = []
    for schedule in schedules:
        times: dict[str, float | None] = {}
        best: tuple[float, str, str | None] | None = None
        for placement in STOCK_PLACEMENTS:
            for recompute in (None, "selective", "full"):
                run = [*flags, "--dip-schedule", schedule, "--dip-stock-placement", placement]
                run += ["--recompute-granularity", recompute] if recompute else []
                try:
                    spec = resolve_run(run, world_size=world_size)
                except ConfigError as e:
                    logger.info("%s / %s placement not possible: %s", schedule, placement, e)
                    break
                seconds, fits = stock_outcome(spec, first_batches(spec, batches))
                times[f"{placement}/{recompute or 'none'}"] = seconds if fits else None
                if fits and (best is None or seconds < best[0]):
                    best = (seconds, placement, recompute)
        if best is None:
            raise ValueError(f"no stock placement of --dip-schedule {schedule} fits in memory")
        choices.append(StockChoice(schedule, best[1], best[2], times))
    return choices


def instruction_seconds(plan: Plan, cost_model) -> list[float]:
    """Cost-model seconds of every compute instruction of `plan` (recompute as planned)."""
    costs, has_backward = stage_costs(plan, cost_model)
    return [c.forward for c in costs.values()] + [costs[s].backward for s in has_backward]


def shortest_kept(durations: Sequence[float], *, share: float) -> float:
    """The shortest of `durations` once the shortest ones holding at most `share` of their sum
    are left out (share 0: the shortest positive one)."""
    ordered = sorted(d for d in durations if d > 0)
    if not ordered:
        raise ValueError("no instruction takes any time")
    budget, dropped = share * sum(ordered), 0.0
    for d in ordered:
        dropped += d
        if dropped > budget:
            return d
    return ordered[-1]


def auto_scale(
    flags: Sequence[str], *, world_size: int, batches: int, min_op_s: float, share: float = 0.0
) -> float:
    """The emulation scale at which DIP's shortest instruction of the first batches (greedy
    plans; `shortest_kept` with `share`) lasts `min_op_s` (stock instructions are whole
    microbatches: longer)."""
    from megatron_dip.training.planning import make_planner, replica_plan

    spec = resolve_run([*flags, "--dip-schedule", "dip"], world_size=world_size)
    planner = make_planner(spec)
    shortest = min(
        shortest_kept(
            instruction_seconds(replica_plan(planner, b, 0).plan, spec.cost_model), share=share
        )
        for b in first_batches(spec, batches)
    )
    return min_op_s / shortest


@dataclass(frozen=True)
class RunSummary:
    """One schedule's measured and predicted numbers over the measured iterations."""

    label: str
    median_s: float
    p90_s: float
    predicted_s: float | None
    bound_s: float | None
    inline_plans: int
    iterations: int


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def summarize(label: str, records: Sequence[Mapping], *, warmup: int) -> RunSummary:
    """Median / p90 schedule time of the iterations after `warmup`, with the simulator's
    prediction and bound (medians) and the plans that fell back to inline planning."""
    measured = [r for r in records if r["iteration"] > warmup]
    if not measured:
        raise ValueError(f"{label}: no iteration after the {warmup} warm-up iterations")
    times = [r["schedule_seconds"] for r in measured]
    predicted = [r["predicted_s"] for r in measured if "predicted_s" in r]
    bounds = [r["bound_s"] for r in measured if "bound_s" in r]
    return RunSummary(
        label=label,
        median_s=statistics.median(times),
        p90_s=_p90(times),
        predicted_s=statistics.median(predicted) if predicted else None,
        bound_s=statistics.median(bounds) if bounds else None,
        inline_plans=sum(r.get("variant") == "inline" for r in measured),
        iterations=len(measured),
    )
