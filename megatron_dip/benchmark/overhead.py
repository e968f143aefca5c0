"""Measuring the runtime's host overheads: zero-sleep emulated iterations, fitted by least squares.

A *case* is one emulated run (`--dip-emulate-compute` flags of a preset at some granularity, or a
stock schedule) with its plans, made here once: DIP's greedy plans of the run's first batches, or
Megatron's order for the stock schedules. `measure_rank` runs on every rank of a gloo world (the
tool launches it with torchrun): for each case it builds the training's own step on emulated
chunks that sleep nothing (`EmulatedCompute` at scale 0: DIP's `DipStep` on the DDP-wrapped
chunks with its span recorder, or `run_stock`, Megatron-Core's own schedule), warms up the
pipeline, and times every plan `repeats` times (the slowest rank's schedule, as the training's
metrics do). What is left is host time.

`fit_overheads` then finds the `HostOverheads` (per compute instruction, per posted batch, per
message) and a per-iteration constant that make the simulator's zero-compute prediction of each
plan match its measured time in the least-squares sense. The simulated time is piecewise linear
in the three terms (a max over paths of counts times terms), so the fit is Gauss-Newton: at the
current terms, each plan's critical-path counts are the simulator's finite differences, a
non-negative least-squares solve gives new terms, repeated until they settle. The fit is of the
model the planner uses, so its residual is the prediction error the simulator will have.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_dip.planner.cost_model import StageCost
from megatron_dip.planner.overheads import HostOverheads
from megatron_dip.planner.simulator import simulate
from megatron_dip.schedule.engine import ChannelFn, per_peer_channel, single_channel
from megatron_dip.schedule.ir import Backward, Forward, Plan, Recv, Send

logger = logging.getLogger(__name__)


@dataclass
class OverheadCase:
    """One emulated run to measure: its label, flags and resolved spec, and its plans."""

    label: str
    flags: list[str]
    spec: object  # training.config.validate.RunSpec
    plans: list[Plan] = field(default_factory=list)
    batches: list = field(default_factory=list)  # BatchMeta of each plan

    @property
    def stock(self) -> bool:
        return self.spec.is_stock

    @property
    def channel(self) -> ChannelFn:
        """DIP's executor gives each rank pair its own communicator; Megatron's schedules use
        one per pipeline (what each run's timing is simulated on)."""
        return single_channel if self.stock else per_peer_channel


def make_case(label: str, flags: Sequence[str], *, world_size: int, batches: int) -> OverheadCase:
    """Resolve `flags` (forced to zero sleep) and plan the run's first `batches` batches."""
    from megatron_dip.training.iteration.planning import StockPlans, make_planner, replica_plan

    from .bench import first_batches, resolve_run

    run = [*flags, "--dip-emulate-scale", "0"]
    spec = resolve_run(run, world_size=world_size)
    metas = first_batches(spec, batches)
    if spec.is_stock:
        stock = StockPlans(spec)
        plans = [stock.plan(b, 0) for b in metas]
    else:
        planner = make_planner(spec)
        plans = [replica_plan(planner, b, 0, search=False).plan for b in metas]
    return OverheadCase(label, run, spec, plans, list(metas))


def plan_counts(plan: Plan) -> dict[str, int]:
    """Compute instructions, Send/Recv instructions and messages of the busiest rank."""
    best = {"compute": 0, "p2p": 0}
    for program in plan.programs:
        compute = sum(isinstance(i, (Forward, Backward)) for i in program.instructions)
        p2p = sum(isinstance(i, (Send, Recv)) for i in program.instructions)
        if compute > best["compute"]:
            best = {"compute": compute, "p2p": p2p}
    return best


# -- on every rank -----------------------------------------------------------------------------


def _runner(spec, ctx):
    """(model, step function (plan, samples) -> StepResult, backend) of the training's step."""
    from megatron_dip.training.assembly.backend import select_backend
    from megatron_dip.training.assembly.build import build_model
    from megatron_dip.training.iteration.step import DipStep, run_stock

    backend = select_backend(spec)
    model = build_model(spec, ctx, backend=backend)
    if spec.is_stock:
        return backend, lambda plan, samples: run_stock(spec, ctx, model, backend, plan, samples)
    step = DipStep(spec, ctx, model, backend)
    return backend, step.run


def _measure_case(
    case: OverheadCase, *, repeats: int, profile: str | None
) -> list[tuple[float, float, float]]:
    """(wall, CPU, compute) seconds per plan, medians of `repeats` runs: the slowest rank's
    schedule, its CPU seconds (the process's, gloo's threads included: what a loaded
    machine's other processes disturb least, the figure to compare executor versions by), and
    the mean time of one compute instruction (its handler's span, over every rank)."""
    import torch
    import torch.distributed as dist

    from megatron_dip.training.assembly.setup import initialize, pipeline_peers, warm_up_pipeline

    spec = case.spec
    ctx = initialize(spec)
    try:
        backend, step = _runner(spec, ctx)
        warm_up_pipeline(ctx, pipeline_peers(spec.placement, ctx.pp_rank))
        out = []
        for plan, batch in zip(case.plans, case.batches):
            samples = backend.samples_for(None, batch, plan)
            step(plan, samples)  # warm-up: allocation, lazy initialisation
            runs = []
            for _ in range(repeats):
                dist.barrier()
                cpu = time.process_time()
                result = _profiled(step, plan, samples, profile) if profile else step(plan, samples)
                cpu = time.process_time() - cpu
                local = torch.tensor([result.ended - result.started, cpu], dtype=torch.float64)
                dist.all_reduce(local, op=dist.ReduceOp.MAX)
                spans = torch.tensor([result.busy, len(result.spans)], dtype=torch.float64)
                dist.all_reduce(spans)
                runs.append((float(local[0]), float(local[1]), float(spans[0] / spans[1])))
            out.append(tuple(statistics.median(r[i] for r in runs) for i in range(3)))
        return out
    finally:
        ctx.destroy()


def _profiled(step, plan, samples, path: str):
    """`step(plan, samples)` under cProfile, the statistics dumped to `path` (appended runs
    overwrite: the last one is kept)."""
    import cProfile

    profiler = cProfile.Profile()
    result = profiler.runcall(step, plan, samples)
    profiler.dump_stats(path)
    return result


def measure_rank(
    *,
    rank: int,
    world_size: int,
    cases: Sequence[OverheadCase],
    repeats: int = 3,
    profile_rank: int | None = None,
    profile_dir: str | None = None,
) -> list[list[tuple[float, float, float]]]:
    """Run every case's plans on this rank (module docstring); every rank returns the same
    measured (wall, CPU, compute instruction) seconds, per case and plan. `profile_rank` / `profile_dir`: cProfile that rank's
    iterations into `profile_dir/<label>.prof`."""
    del world_size
    out = []
    for case in cases:
        started = time.time()
        profile = None
        if profile_rank == rank and profile_dir is not None:
            profile = f"{profile_dir}/{case.label.replace(' ', '_').replace('/', '_')}.prof"
        out.append(_measure_case(case, repeats=repeats, profile=profile))
        if rank == 0:
            logger.info("%s: %s s (%.0f s)", case.label, out[-1], time.time() - started)
    return out


# -- the fit -----------------------------------------------------------------------------------


class HostOnlyCost:
    """A cost model of no compute and no transfer time: only `overheads` (what a zero-sleep
    emulated run takes, in the simulator's model)."""

    def __init__(self, overheads: HostOverheads) -> None:
        self.overheads = overheads

    def stage_cost(self, chunk, sub, memory=None) -> StageCost:
        return StageCost(0.0, 0.0, 0)

    def transfer_time(self, nbytes: int) -> float:
        return 0.0


def predicted(plan: Plan, overheads: HostOverheads, channel: ChannelFn) -> float:
    """The simulator's iteration time of `plan` with host overheads only."""
    return simulate(plan, HostOnlyCost(overheads), channel=channel).iteration_time


@dataclass(frozen=True)
class OverheadFit:
    """Fitted overheads, the per-iteration constant, and each point's measured and fitted time."""

    overheads: HostOverheads
    constant: float
    measured: tuple[float, ...]
    fitted: tuple[float, ...]

    @property
    def relative_errors(self) -> tuple[float, ...]:
        return tuple(f / m - 1 for f, m in zip(self.fitted, self.measured))

    @property
    def rms_relative_error(self) -> float:
        errors = self.relative_errors
        return float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0


def _counts(plan: Plan, at: np.ndarray, channel: ChannelFn) -> np.ndarray:
    """Critical-path counts (d time / d term) of `plan` at the terms `at`, by finite
    differences: the simulated time is piecewise linear in the terms."""
    base = predicted(plan, HostOverheads(*at), channel)
    out = np.zeros(3)
    for i in range(3):
        step = max(1e-6, 1e-3 * at[i])
        bumped = at.copy()
        bumped[i] += step
        out[i] = (predicted(plan, HostOverheads(*bumped), channel) - base) / step
    return out


_START = HostOverheads(1e-3, 1e-3, 1e-3)  # a millisecond each: where Gauss-Newton starts


def fit_overheads(
    points: Sequence[tuple[Plan, ChannelFn, float]],
    *,
    instruction: float | None = None,
    start: HostOverheads = _START,
    iterations: int = 8,
) -> OverheadFit:
    """Least-squares `HostOverheads` (and a constant per iteration, both >= 0) such that
    `predicted(plan) + constant` matches the measured seconds of each (plan, channel, seconds)
    point (module docstring). `instruction`: the per-instruction term as measured directly
    (the compute handlers' spans); then only the other terms are fitted. In plans with about
    one batch and one message per compute instruction the three terms are nearly collinear:
    the direct measurement pins the one that is observable on its own."""
    from scipy.optimize import nnls

    if len(points) < 2:
        raise ValueError("fitting host overheads needs at least two measured plans")
    y = np.array([s for *_, s in points], dtype=float)
    terms = np.array([start.instruction, start.batch, start.message], dtype=float)
    if instruction is not None:
        terms[0] = instruction
    free = [0, 1, 2] if instruction is None else [1, 2]
    best: OverheadFit | None = None
    for _ in range(iterations):
        counts = np.array([_counts(plan, terms, ch) for plan, ch, _ in points])
        known = counts[:, 0] * terms[0] if instruction is not None else 0.0
        rows = np.column_stack([counts[:, free], np.ones(len(points))])
        # Relative least squares: every plan counts alike, whatever its length.
        solution, _ = nnls(rows / y[:, None], (y - known) / y)
        new = terms.copy()
        new[free] = solution[:-1]
        settled = np.allclose(new, terms, rtol=1e-3, atol=1e-7)
        terms = new
        fit = _evaluated(points, HostOverheads(*map(float, terms)), float(solution[-1]), y)
        # New terms move the critical paths, and Gauss-Newton on a piecewise-linear model can
        # cycle between them: keep the best iterate.
        if best is None or fit.rms_relative_error < best.rms_relative_error:
            best = fit
        if settled:
            break
    return best


def _evaluated(points, overheads: HostOverheads, constant: float, y: np.ndarray) -> OverheadFit:
    fitted = tuple(predicted(p, overheads, ch) + constant for p, ch, _ in points)
    return OverheadFit(overheads, constant, tuple(map(float, y)), fitted)


__all__ = [
    "HostOnlyCost",
    "OverheadCase",
    "OverheadFit",
    "fit_overheads",
    "make_case",
    "measure_rank",
    "plan_counts",
    "predicted",
]
