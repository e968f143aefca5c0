"""Side-by-side planning of one batch under static Megatron pipelines and DIP (simulation).

Used by `tools/simulate_paper.py` and the benchmark: every schedule sees the same microbatches,
packing and data-parallel shards (`batching.layout_batch`, DIP's cost-balanced split), and every
static baseline gets its best uniform recompute setting (none / selective / full: the fastest
whose activations fit).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..batching import (
    BatchLayout,
    LayoutConfig,
    MicrobatchWork,
    ReplicaLayout,
    packing_limits,
    resplit,
    split_microbatches,
)
from ..data.packing import PackingLimits
from ..data.sample import BatchMeta
from ..modelspec import MultimodalSpec, Setup
from ..schedule.baselines import build_megatron_plan
from ..schedule.engine import ChannelFn, per_peer_channel
from ..schedule.ir import ChunkSpec, Forward, Placement, Plan, Program, Recompute
from .devices import DeviceSpec
from .dip import DipPlanner, PlannerConfig
from .placement import ModuleWorkload, build_dip_placement, choose_dip_placement
from .search import SearchConfig
from .simulator import SimResult, simulate
from .static_baselines import StaticPipeline, one_list_pipeline, stock_pipeline
from .submicrobatch import choose_sub_size, split_modules

__all__ = ["packing_limits"]  # re-exported: the one packing of every schedule

MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
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
    tensor_parallel: int,
    reserve: float = 0.1,
) -> list[float]:
    """Per-rank activation budget: device memory minus weights/grads/optimizer and a reserve."""
    static = [0.0] * placement.num_ranks
    for m in placement.modules:
        per_param = BYTES_PER_PARAM if m.trainable else FROZEN_BYTES_PER_PARAM
        for c in m.chunks:
            static[c.rank] += cost_model.chunk_params(c) / tensor_parallel * per_param
    return [device.memory_bytes * (1 - reserve) - s for s in static]


def with_recompute(plan: Plan, mode: Recompute) -> Plan:
    """`plan` with every forward using recompute `mode`."""
    programs = tuple(
        Program(
            p.rank,
            tuple(
                dataclasses.replace(i, recompute=mode) if isinstance(i, Forward) else i
                for i in p.instructions
            ),
        )
        for p in plan.programs
    )
    return dataclasses.replace(plan, programs=programs)


@dataclass(frozen=True)
class Outcome:
    """One schedule's simulated result on one batch."""

    name: str
    sim: SimResult
    fits: bool
    recompute: str
    plan_seconds: float = 0.0


def best_uniform_recompute(
    name: str,
    plan_for: Callable[[Recompute], Plan],
    cost_model,
    limits: Sequence[float],
) -> Outcome:
    """Simulate `plan_for(mode)` for every uniform recompute mode; the fastest that fits wins."""
    results = []
    for mode in MODES:
        sim = simulate(plan_for(mode), cost_model)
        fits = all(p <= lim for p, lim in zip(sim.peak_activation_bytes, limits))
        results.append(Outcome(name, sim, fits, mode.value))
    fitting = [r for r in results if r.fits]
    return min(fitting or results, key=lambda r: r.sim.iteration_time)


@dataclass
class Comparison:
    """Everything fixed for one setup: model, cost model, placements, sub-microbatch sizes."""

    setup: Setup
    cost_model: object
    device: DeviceSpec
    limits: PackingLimits
    dip_placement: Placement
    sub_sizes: dict[str, int]
    static: list[StaticPipeline]
    search: SearchConfig
    # DIP's runtime gives each (sender, receiver) pair its own communicator; Megatron's stock
    # schedules share one per pipeline group.
    dip_channel: ChannelFn = per_peer_channel
    placement_scores: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def create(
        cls,
        setup: Setup,
        cost_model,
        *,
        device: DeviceSpec,
        calibration: Sequence[BatchMeta],
        search: SearchConfig,
    ) -> Comparison:
        """Size placements and sub-microbatch sizes from `calibration` batches (averages)."""
        model, p = setup.model, setup.pipeline_parallel
        limits = packing_limits(model, setup.seq_length)
        whole = LayoutConfig(seq_length=setup.seq_length, packing=limits)
        works = [
            w for b in calibration for w in split_microbatches(model, pack_all(b, limits), whole)
        ]
        workload = average_workload(model, works)
        sub_sizes = {}
        for m in split_modules(model):
            per = max(1, workload[m.name].tokens // max(1, workload[m.name].instances))
            sub_sizes[m.name] = choose_sub_size(cost_model, m.name, tokens_per_instance=per)
        rule, _ = build_dip_placement(
            model, cost_model, num_ranks=p, workload=workload, unit_instances=sub_sizes
        )
        static = [
            stock_pipeline(model, cost_model, num_ranks=p, num_model_chunks=1, workload=workload),
            stock_pipeline(model, cost_model, num_ranks=p, num_model_chunks=2, workload=workload),
            one_list_pipeline(
                model, cost_model, num_ranks=p, num_model_chunks=2, workload=workload, by="params"
            ),
            one_list_pipeline(
                model, cost_model, num_ranks=p, num_model_chunks=2, workload=workload, by="cost"
            ),
        ]
        cmp = cls(setup, cost_model, device, limits, rule, sub_sizes, static, search)
        cmp.dip_placement, _, cmp.placement_scores = choose_dip_placement(
            model,
            cost_model,
            num_ranks=p,
            workload=workload,
            unit_instances=sub_sizes,
            evaluate=functools.partial(cmp.score_placement, calibration[:2]),
        )
        return cmp

    def score_placement(self, batches: Sequence[BatchMeta], placement: Placement) -> float:
        """Mean simulated iteration time of greedy DIP plans of `batches` under `placement`
        (a plan whose activations do not fit counts double)."""
        trial = dataclasses.replace(self, dip_placement=placement)
        planner = trial.planner(use_search=False)
        limits = trial.memory(placement)
        times = []
        for b in batches:
            plan = planner.plan_layout(planner.layout(b), 0).plan
            sim = simulate(plan, self.cost_model, channel=self.dip_channel)
            fits = all(p <= lim for p, lim in zip(sim.peak_activation_bytes, limits))
            times.append(sim.iteration_time * (1 if fits else 2))
        return sum(times) / len(times)

    def memory(self, placement: Placement) -> list[float]:
        return activation_limits(
            placement,
            self.cost_model,
            device=self.device,
            tensor_parallel=self.setup.tensor_parallel,
        )

    def planner(self, **overrides: object) -> DipPlanner:
        config = PlannerConfig(
            seq_length=self.setup.seq_length,
            data_parallel=self.setup.data_parallel,
            sub_sizes=self.sub_sizes,
            search=self.search,
            memory_limit_bytes=self.memory(self.dip_placement),
            tensor_parallel=self.setup.tensor_parallel,
            sequence_parallel=self.setup.tensor_parallel > 1,
            dtype="bfloat16",
            packing=self.limits,
            strict_memory=False,  # plans that do not fit are scored as such, not raised
        )
        return DipPlanner(
            self.setup.model,
            self.cost_model,
            self.dip_placement,
            dataclasses.replace(config, **overrides),
        )

    # -- one batch ---------------------------------------------------------------------------

    def run_batch(self, batch: BatchMeta) -> list[Outcome]:
        """Baselines and DIP's ablation steps on the same replica shards and microbatches.
        With several replicas, the iteration time is the slowest replica's."""
        base = self.planner()
        layout = base.layout(batch)
        outcomes: dict[str, list[Outcome]] = {}
        for replica in layout.replicas:
            for o in self._replica(base, layout, replica):
                outcomes.setdefault(o.name, []).append(o)
        return [max(os, key=lambda o: o.sim.iteration_time) for os in outcomes.values()]

    def _replica(
        self, base: DipPlanner, layout: BatchLayout, replica: ReplicaLayout
    ) -> list[Outcome]:
        model, works, totals = self.setup.model, list(replica.works), layout.totals
        # Megatron runs every module's share of a microbatch at once.
        whole = resplit(model, replica, base.layout_config.with_whole_modules()).works
        out = [self._static(pipe, whole, totals, layout.iteration) for pipe in self.static]
        steps = [
            (
                "dip: separated",
                dict(
                    fill_bubbles=False,
                    use_search=False,
                    optimize_memory=False,
                    megatron_candidate=False,
                ),
            ),
            (
                "dip: +interleave",
                dict(use_search=False, optimize_memory=False, megatron_candidate=False),
            ),
            ("dip: +mcts", dict(optimize_memory=False, megatron_candidate=False)),
            ("dip: +memory (full DIP)", {}),  # also tries Megatron's order on its placement
        ]
        limits = self.memory(self.dip_placement)
        previous: Outcome | None = None
        for name, overrides in steps:
            outcome = self._dip(name, overrides, works, totals, layout.iteration, limits)
            # The planner evaluates each step's candidate against the previous one and keeps the
            # faster (both are valid plans it has in hand), so a step never loses.
            if (
                previous is not None
                and previous.fits
                and (not outcome.fits or previous.sim.iteration_time < outcome.sim.iteration_time)
            ):
                outcome = dataclasses.replace(
                    previous, name=name, plan_seconds=outcome.plan_seconds
                )
            out.append(outcome)
            previous = outcome
        return out

    def _static(self, pipe: StaticPipeline, works, totals, iteration: int) -> Outcome:
        """Megatron's order on a static placement, for each uniform recompute mode, with messages
        placed by the stage durations of that mode; the fastest that fits wins."""
        sub_of = {s.work: s for w in works for s in w.submicrobatches}
        name = "1f1b" if pipe.num_model_chunks == 1 else "interleaved"
        tensors = self.planner().shapes.for_lookup(sub_of.__getitem__)

        def duration(mode: Recompute, rank: int, ins) -> float:
            chunk = pipe.placement.module(ins.stage.module).chunks[ins.stage.chunk]
            c = self.cost_model.stage_cost(chunk, sub_of[ins.stage.work], mode)
            return max(c.forward if isinstance(ins, Forward) else c.backward, 1e-12)

        def plan_for(mode: Recompute) -> Plan:
            plan = build_megatron_plan(
                placement=pipe.placement,
                stage_units=pipe.stage_units,
                submicrobatches=[s for w in works for s in w.submicrobatches],
                dependencies=[d for w in works for d in w.dependencies],
                microbatches=[w.info for w in works],
                totals=totals,
                num_model_chunks=pipe.num_model_chunks,
                tensors=tensors,
                iteration=iteration,
                compute_time=functools.partial(duration, mode),
            )
            return with_recompute(plan, mode)

        return best_uniform_recompute(
            f"megatron {name} ({pipe.name})", plan_for, self.cost_model, self.memory(pipe.placement)
        )

    def _dip(
        self, name: str, overrides: dict, works, totals, iteration: int, limits: list[float]
    ) -> Outcome:
        best = None
        modes = (None,) if overrides.get("optimize_memory", True) else MODES
        for mode in modes:
            planner = self.planner(**overrides, uniform_recompute=mode)
            started = time.perf_counter()
            rp = planner.plan_replica(works, iteration=iteration, replica=0, totals=totals)
            seconds = time.perf_counter() - started
            sim = simulate(rp.plan, self.cost_model, channel=self.dip_channel)
            fits = all(p <= lim for p, lim in zip(sim.peak_activation_bytes, limits))
            o = Outcome(name, sim, fits, "per-chunk" if mode is None else mode.value, seconds)
            if best is None or (o.fits, -o.sim.iteration_time) > (
                best.fits,
                -best.sim.iteration_time,
            ):
                best = o
        return best


def pack_all(batch: BatchMeta, limits: PackingLimits) -> list[tuple]:
    """The whole batch packed once (the calibration's microbatches)."""
    from ..batching import pack

    return pack(list(batch.samples), limits)


def model_flops(model: MultimodalSpec, cost_model, works: Sequence[MicrobatchWork]) -> float:
    """6*N*D (2*N*D for forward-only modules) over the tokens each module processed; attention's
    quadratic term is left out, so MFU computed from it is an underestimate."""
    total = 0.0
    for m in model.modules:
        params = cost_model.chunk_params(ChunkSpec(m.name, 0, 0, 0, m.num_layers))
        tokens = sum(s.tokens for w in works for s in w.submicrobatches if s.module == m.name)
        total += (6 if m.trainable else 2) * params * tokens
    return total


def summarize(values: Sequence[float]) -> tuple[float, float]:
    """Median and 90th percentile."""
    arr = np.asarray(values, dtype=float)
    return float(np.median(arr)), float(np.percentile(arr, 90))
