"""Benchmark presets and the in-process steps of `tools/bench_schedules.py`.

A `BenchPreset` names a paper setup as an emulated cluster: one process per pipeline rank (the
paper's TP is folded into the cost model) and the data mixture. DIP runs the planner's own
granularity (segments, sub-microbatch sizes): `dip_run_flags` resolves the DIP run once (its start-up placement search), with the
measured host overheads (--dip-host-overheads) when given, and hands its choice to the run and to
its zero-sleep floor; `dip_flags` are only for explicit overrides. Before launching,
`strongest_stock` picks, for each stock schedule, the strongest configuration a Megatron user could
set (static placement x Megatron's recompute flags, partial block / uniform N included:
`planner.stock_configs`) whose activations fit on every one of the run's first batches, by
simulating them; `auto_scale` sizes the emulation scale from the shortest DIP instruction.
`summarize` turns the runs' metrics lines into the table's numbers.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.simulator import stage_costs
from megatron_dip.planner.stock_configs import mode_label, strongest
from megatron_dip.schedule.engine import single_channel
from megatron_dip.schedule.ir import MemoryPolicy, Plan

logger = logging.getLogger(__name__)

STOCK_PLACEMENTS = ("llava", "params", "cost")


@dataclass(frozen=True)
class BenchPreset:
    """An emulated benchmark run: entry point, sizes and the flags every schedule shares."""

    name: str
    script: str
    shape: ParallelShape  # the paper's run (TP, PP, sequence parallelism) the preset stands for
    mixture: str
    dip_flags: tuple[str, ...] = ()  # explicit DIP overrides (none: the planner's own choice)
    shared_flags: tuple[str, ...] = ()
    description: str = ""
    # Auto scale: DIP's shortest instruction lasts --min-op-ms, ignoring the shortest ones that
    # together hold at most this share of the compute (T2V: the frozen text encoder's ~1 ms
    # forwards, a few percent of the time, would otherwise force a 50x scale).
    short_op_share: float = 0.0

    def world_size(self, *, emulate: bool) -> int:
        """Processes of one run: a pipeline's ranks when emulating (TP folded), else TP x PP."""
        return self.shape.pp if emulate else self.shape.world_size

    def base_flags(self, mixture: str | None = None, *, emulate: bool = True) -> list[str]:
        """Flags of every run of this preset (schedule-specific ones are added per run)."""
        return [
            *(["--dip-emulate-compute"] if emulate else []),
            "--model", self.name,
            "--tensor-model-parallel-size", str(self.shape.tp),
            "--pipeline-model-parallel-size", str(self.shape.pp),
            *(["--sequence-parallel"] if self.shape.sp else []),
            "--dip-data", f"synthetic-{mixture or self.mixture}",
            "--lr", "1e-4", "--train-iters", "1",  # runs append their own --train-iters
            *self.shared_flags,
        ]  # fmt: skip


BENCH_PRESETS: dict[str, BenchPreset] = {
    "tiny-vlm": BenchPreset(
        name="tiny-vlm",
        script="pretrain_vlm_dip.py",
        shape=ParallelShape(pp=2),
        mixture="mixed",
        shared_flags=("--global-batch-size", "4"),
        description="tiny-vlm on 2 emulated ranks (smoke test of the benchmark, seconds)",
    ),
    "vlm-s": BenchPreset(
        name="vlm-s",
        script="pretrain_vlm_dip.py",
        shape=ParallelShape(tp=4, pp=4, sp=True),
        mixture="mixed",
        description="VLM-S (ViT-5B + Llama-3-8B), TP4 x PP4 of the paper as 4 emulated ranks",
    ),
    "t2v-s": BenchPreset(
        name="t2v-s",
        script="pretrain_diffusion_dip.py",
        shape=ParallelShape(tp=4, pp=4, sp=True),
        mixture="t2v",
        description="T2V-S (Llama-3-8B text encoder + DiT-5B), TP4 x PP4 as 4 emulated ranks",
        short_op_share=0.05,
    ),
    "omni-s": BenchPreset(
        name="omni-s",
        script="pretrain_vlm_dip.py",
        shape=ParallelShape(tp=4, pp=4, sp=True),
        mixture="omni",
        description="ViT-5B + Whisper-large + Llama-3-8B, TP4 x PP4 as 4 emulated ranks",
        short_op_share=0.05,
    ),
    "vlm-l": BenchPreset(
        name="vlm-l",
        script="pretrain_vlm_dip.py",
        shape=ParallelShape(tp=8, pp=8, sp=True),
        mixture="mixed",
        description="VLM-L (ViT-22B + Qwen2-72B), PP8 of the paper as 8 emulated ranks (TP folded)",
    ),
}


def resolve_run(flags: Sequence[str], *, world_size: int):
    """The `RunSpec` a run with `flags` would have (no process group is created)."""
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.validate import resolve

    return resolve(parse_config(list(flags)), world_size=world_size, cuda=False)


def first_batches(spec, count: int) -> list:
    """The run's first `count` global batches (metadata), as its training stream draws them."""
    from megatron_dip.training.config.data_source import make_stream

    t = spec.training
    stream = make_stream(
        spec.data,
        spec.model,
        seed=t.seed,
        global_batch_size=t.global_batch_size,
        limits=spec.limits,
    )
    return stream.peek(count)


def stock_results(spec, batches: Sequence) -> list[list]:
    """Every recompute setting of `spec`'s stock placement and schedule (`stock_configs`),
    simulated on each of `batches` (replica 0, as Megatron packs and shares it), with whether
    its activations fit the device (the memory left after weights, gradients and optimizer
    state, as for DIP's plans)."""
    from megatron_dip.batching import layout_batch
    from megatron_dip.planner.sizing import activation_limits
    from megatron_dip.planner.static_baselines import StaticPipeline
    from megatron_dip.planner.stock_configs import StockWork, evaluate_stock, recompute_modes
    from megatron_dip.training.iteration.planning import make_planner

    planner = make_planner(spec)
    pipe = StaticPipeline(
        spec.stock_placement,
        spec.placement,
        spec.stage_units,
        len(spec.stage_units[0]),
    )
    limits = activation_limits(spec.placement, spec.cost_model, device=spec.device)
    # The emulated stock run takes Megatron's recompute flags (`recompute_flags`), which do not
    # carry `--recompute-modules`: the grid without Megatron's "layernorm" module here.
    modes = [m for m in recompute_modes(pipe.placement) if not m.modules]
    out = []
    for b in batches:
        layout = layout_batch(spec.model, b, planner.layout_config.with_whole_modules())
        mine = layout.replicas[0]
        work = StockWork(
            mine.submicrobatches, mine.dependencies, mine.infos, layout.totals, b.iteration
        )
        tensors = planner.shapes.for_lookup(mine.sub_of().__getitem__)
        out.append(
            evaluate_stock(
                pipe,
                work,
                cost_model=spec.cost_model,
                tensors=tensors,
                limits=limits,
                modes=modes,
                channel=single_channel,
            )
        )
    return out


@dataclass(frozen=True)
class StockChoice:
    """The placement and recompute setting picked for one stock schedule (the fastest that fits
    on every calibration batch), and the mean simulated time of every combination tried
    ("placement/recompute" -> seconds; None: its activations do not fit on some batch)."""

    schedule: str
    placement: str
    mode: MemoryPolicy
    simulated_s: dict[str, float | None] = field(default_factory=dict)
    virtual_stages: int | None = None  # --num-virtual-stages-per-pipeline-rank (None: default)

    @property
    def recompute(self) -> str:
        """Megatron's name of the recompute setting ("none", "selective", "block 4", ...)."""
        return mode_label(self.mode)

    @property
    def label(self) -> str:
        """E.g. "megatron-interleaved v4 (cost, block 2)", as the benchmark's table names it."""
        chunks = f" v{self.virtual_stages}" if self.virtual_stages is not None else ""
        return f"megatron-{self.schedule}{chunks} ({self.placement}, {self.recompute})"

    @property
    def key(self) -> str:
        """Its entry in `simulated_s` (`simulated_key`)."""
        return simulated_key(self.placement, self.virtual_stages, self.mode)

    def flags(self) -> list[str]:
        """The run's flags: schedule, placement, virtual stages and Megatron's recompute flags."""
        from megatron_dip.training.config.recompute_flags import recompute_flags

        out = ["--dip-schedule", self.schedule, "--dip-stock-placement", self.placement]
        if self.virtual_stages is not None:
            out += ["--num-virtual-stages-per-pipeline-rank", str(self.virtual_stages)]
        return out + recompute_flags(self.mode)


def simulated_key(placement: str, virtual_stages: int | None, mode: MemoryPolicy) -> str:
    """A stock configuration's name in `StockChoice.simulated_s`: "cost/block 2", or with
    --num-virtual-stages-per-pipeline-rank "cost v4/block 2"."""
    chunks = f" v{virtual_stages}" if virtual_stages is not None else ""
    return f"{placement}{chunks}/{mode_label(mode)}"


def stock_variants(schedule: str) -> list[tuple[str, int | None]]:
    """(placement, virtual stages) a Megatron user tunes for `schedule`, as the study's grid
    (`static_baselines.static_pipelines`): the interleaved cost cut over each of
    `INTERLEAVED_CHUNKS` per rank, the other placements at Megatron's usual 2 (None: the
    flag's default)."""
    from megatron_dip.planner.static_baselines import INTERLEAVED_CHUNKS

    out: list[tuple[str, int | None]] = []
    for placement in STOCK_PLACEMENTS:
        if schedule == "interleaved" and placement == "cost":
            out += [(placement, v) for v in INTERLEAVED_CHUNKS]
        else:
            out.append((placement, None))
    return out


def strongest_stock(
    flags: Sequence[str], *, world_size: int, batches: int, schedules: Sequence[str]
) -> list[StockChoice]:
    """For each stock schedule, the strongest configuration (placement x recompute setting,
    `stock_configs.strongest`) whose activations fit on each of the run's first `batches`
    batches: what a Megatron user would tune, simulated."""
    from megatron_dip.training.config.validate import ConfigError

    choices = []
    for schedule in schedules:
        per_batch: list[list] = [[] for _ in range(batches)]
        chunks: dict[tuple[str, str], int | None] = {}  # (placement, schedule name) -> flag
        for placement, virtual in stock_variants(schedule):
            run = [*flags, "--dip-schedule", schedule, "--dip-stock-placement", placement]
            if virtual is not None:
                run += ["--num-virtual-stages-per-pipeline-rank", str(virtual)]
            try:
                spec = resolve_run(run, world_size=world_size)
            except ConfigError as e:
                logger.info("%s / %s placement not possible: %s", schedule, placement, e)
                continue
            for mine, results in zip(per_batch, stock_results(spec, first_batches(spec, batches))):
                mine.extend(results)
                chunks.update({(r.pipeline, r.schedule): virtual for r in results})
        best = strongest(per_batch)
        if best is None:
            raise ValueError(f"no stock configuration of --dip-schedule {schedule} fits in memory")
        virtual = chunks[best[0], best[1]]
        times = _mean_times(per_batch, chunks)
        choices.append(StockChoice(schedule, best[0], best[2], times, virtual))
    return choices


def _mean_times(
    per_batch: Sequence[Sequence], chunks: Mapping[tuple[str, str], int | None]
) -> dict[str, float | None]:
    """`simulated_key` -> mean simulated seconds over the batches (None: does not fit on some
    batch); `chunks`: (placement, schedule) -> its virtual stages flag."""
    times: dict[str, list[float]] = {}
    fitting: dict[str, bool] = {}
    for results in per_batch:
        for r in results:
            key = simulated_key(r.pipeline, chunks[r.pipeline, r.schedule], r.mode)
            times.setdefault(key, []).append(r.sim.iteration_time)
            fitting[key] = fitting.get(key, True) and r.fits
    return {k: (sum(v) / len(v) if fitting[k] else None) for k, v in times.items()}


def dip_run_flags(flags: Sequence[str], *, world_size: int) -> tuple[list[str], object]:
    """The planner's own granularity of the DIP run with `flags` (resolved once: with host
    overheads the candidates are simulated), as explicit flags for the run and its floor, and
    the resolved spec."""
    spec = resolve_run([*flags, "--dip-schedule", "dip"], world_size=world_size)
    # The search's choice as flags (a static placement too), as a checkpoint records them: the
    # runs do not search again.
    recorded = spec.layout_flags
    out = ["--dip-segments", recorded["segments"]]
    sizes = recorded["sub_sizes"]
    return (out + ["--dip-sub-microbatch-size", sizes] if sizes else out), spec


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
    from megatron_dip.training.iteration.planning import make_planner, replica_plan

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
    """One schedule's measured and predicted numbers over the measured iterations.

    `elapsed_s` is what a user waits per iteration (the training loop's own clock: plan fetch
    and any planning wait, data, schedule, optimizer); `schedule_s` the forward/backward
    schedule alone; `plan_wait_s` the wait for the plan. Medians; p90 of the elapsed time.
    `first_iteration_s`: from the launch to the end of the first iteration (warm-up included),
    with any start-up search the run was spared (`summarize`'s `spared_s`)."""

    label: str
    elapsed_s: float
    elapsed_p90_s: float
    schedule_s: float
    plan_wait_s: float
    predicted_s: float | None
    bound_s: float | None
    inline_plans: int
    iterations: int
    # Process start to the end of the first iteration (None: not measured).
    first_iteration_s: float | None = None

    @property
    def median_s(self) -> float:
        """The headline: the elapsed iteration."""
        return self.elapsed_s


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def summarize(
    label: str,
    records: Sequence[Mapping],
    *,
    warmup: int,
    launched_at: float | None = None,
    spared_s: float = 0.0,
) -> RunSummary:
    """Medians of the elapsed iteration, its schedule and plan wait over the iterations after
    `warmup` (p90 of the elapsed one), with the simulator's prediction and bound (medians) and
    the plans that fell back to inline planning. `launched_at` (Unix seconds): when the run was
    launched, for the time to its first iteration's end, to which `spared_s` is added (the
    start-up placement search the launcher did for it: the run would have done it)."""
    measured = [r for r in records if r["iteration"] > warmup]
    if not measured:
        raise ValueError(f"{label}: no iteration after the {warmup} warm-up iterations")
    elapsed = [r["seconds"] for r in measured]
    predicted = [r["predicted_s"] for r in measured if "predicted_s" in r]
    bounds = [r["bound_s"] for r in measured if "bound_s" in r]
    return RunSummary(
        label=label,
        elapsed_s=statistics.median(elapsed),
        elapsed_p90_s=_p90(elapsed),
        schedule_s=statistics.median(r["schedule_seconds"] for r in measured),
        plan_wait_s=statistics.median(r.get("plan_wait_seconds", 0.0) for r in measured),
        predicted_s=statistics.median(predicted) if predicted else None,
        bound_s=statistics.median(bounds) if bounds else None,
        inline_plans=sum(r.get("variant") == "inline" for r in measured),
        iterations=len(measured),
        first_iteration_s=_first_iteration_s(records, launched_at, spared_s),
    )


def _first_iteration_s(
    records: Sequence[Mapping], launched_at: float | None, spared_s: float
) -> float | None:
    first = min(records, key=lambda r: r["iteration"], default=None)
    if launched_at is None or first is None or "end_time" not in first:
        return None
    return first["end_time"] - launched_at + spared_s
