"""Side-by-side planning of one batch under static Megatron configurations and DIP (simulation).

Used by `tools/simulate_paper.py` and the benchmark: every schedule sees the same microbatches,
packing and data-parallel shards (`batching.layout_batch`, DIP's cost-balanced split). Every
static Megatron configuration a user could tune (`stock_configs`: placement x schedule x
Megatron's recompute flags, partial recomputation included) is simulated on each batch, so the
study can pick the strongest one that fits on every batch; DIP runs its ablation steps. Each
batch also reports its balanced bound (`bounds.balanced_bound`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
from ..schedule.engine import ChannelFn, per_peer_channel
from ..schedule.ir import RECOMPUTE_MODULES, ChunkSpec, MemoryPolicy, Placement, Plan, Recompute
from ..schedule.passes import RECEIVE_LEAD
from .bounds import balanced_bound
from .config import COARSER_SUB_SIZES, planner_config
from .devices import DeviceSpec
from .dip import DipPlanner
from .placement import (
    ModuleWorkload,
    PlacementCandidate,
    build_dip_placement,
    parse_segments,
    segments_candidate,
)
from .placement_neighbours import named_cut
from .placement_search import (
    rank_load_bound,
    search_placement,
    simulated_score,
    static_candidates,
)
from .search import SearchConfig
from .simulator import SimResult, simulate
from .sizing import activation_limits, average_workload
from .static_baselines import StaticPipeline, static_pipelines
from .stock_configs import (
    StockResult,
    StockWork,
    evaluate_stock,
    fastest,
    fits,
    megatron_plan,
)
from .submicrobatch import choose_sub_sizes

__all__ = ["packing_limits"]  # re-exported: the one packing of every schedule

MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)  # the ablation steps' uniform modes
# The full DIP also plans each batch at 1.5 and 2 times the sub-microbatch sizes
# (`sub_size_choice`, training's --dip-coarser-sub-microbatches); the ablation steps before the
# memory pass plan at the configured sizes only.
SUB_SIZE_SCALES = COARSER_SUB_SIZES


@dataclass(frozen=True)
class Outcome:
    """One DIP schedule's simulated result on one batch."""

    name: str
    sim: SimResult
    fits: bool
    recompute: str
    plan_seconds: float = 0.0
    plan: Plan | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BatchResult:
    """Everything simulated on one batch; with several replicas each result is the slowest
    replica's and fits only where every replica fits."""

    iteration: int
    stock: tuple[StockResult, ...]  # every static configuration
    dip: tuple[Outcome, ...]  # DIP's ablation steps, the full DIP last
    balanced_bound: float  # the slowest replica's total compute without recompute / P
    # Schedules of the literature on the static placements, not run by Megatron users (never
    # the baseline): ZB-H1 (`weight_fill`) per 1F1B placement.
    peers: tuple[StockResult, ...] = ()


@dataclass
class Comparison:
    """Everything fixed for one setup: model, cost model, placements, sub-microbatch sizes.

    `dip` is the placement DIP's start-up search chose among its own segment counts and the
    static placements (`stage_units` set when a static one won)."""

    setup: Setup
    cost_model: object
    device: DeviceSpec
    limits: PackingLimits
    dip: PlacementCandidate
    sub_sizes: dict[str, int]
    static: list[StaticPipeline]
    search: SearchConfig
    # DIP's runtime gives each (sender, receiver) pair its own communicator; Megatron's stock
    # schedules share one per pipeline group.
    dip_channel: ChannelFn = per_peer_channel
    placement_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    tie_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    # A what-if knob: every rank's activation limit times this, for DIP and the stock grid alike.
    memory_scale: float = 1.0

    @property
    def dip_placement(self) -> Placement:
        return self.dip.placement

    @classmethod
    def create(
        cls,
        setup: Setup,
        cost_model,
        *,
        device: DeviceSpec,
        calibration: Sequence[BatchMeta],
        search: SearchConfig,
        placement: str | None = None,
        workers: int = 1,
        memory_scale: float = 1.0,
    ) -> Comparison:
        """Size placements and sub-microbatch sizes from `calibration` batches (averages).
        `placement`: DIP's placement by the name the study prints for it (`named`), instead of
        the start-up search's choice; `workers`: processes scoring the search's candidates (the
        same choice for any count, `candidate_pool`); `memory_scale`: every activation limit
        times this (a what-if, `memory`)."""
        if not memory_scale > 0:
            raise ValueError(f"memory_scale must be > 0, got {memory_scale}")
        model, p = setup.model, setup.pipeline_parallel
        limits = packing_limits(model, setup.seq_length)
        whole = LayoutConfig(seq_length=setup.seq_length, packing=limits)
        works = [
            w for b in calibration for w in split_microbatches(model, pack_all(b, limits), whole)
        ]
        workload = average_workload(model, works)
        # The latency rule's segments on the sizes without host time, then the sizes that pay
        # for the host time of a pass through those chunks.
        first = choose_sub_sizes(model, cost_model, workload)
        rule, _ = build_dip_placement(
            model, cost_model, num_ranks=p, workload=workload, unit_instances=first
        )
        chunks = {m.name: m.num_chunks for m in rule.modules}
        sub_sizes = choose_sub_sizes(model, cost_model, workload, chunks=chunks)
        static = static_pipelines(model, cost_model, num_ranks=p, workload=workload)
        rule_candidate = PlacementCandidate("rule", rule)
        cmp = cls(
            setup,
            cost_model,
            device,
            limits,
            rule_candidate,
            sub_sizes,
            static,
            search,
            memory_scale=memory_scale,
        )
        if placement is None:
            cmp.dip = cmp.searched(calibration, workload, workers=workers)
        else:
            cmp.dip = cmp.named(placement, workload)
        return cmp

    def searched(
        self,
        calibration: Sequence[BatchMeta],
        workload: Mapping[str, ModuleWorkload],
        *,
        workers: int = 1,
    ) -> PlacementCandidate:
        """The start-up search's placement, scored on the first two `calibration` batches:
        DIP's segment counts and the static placements, then a one-list cut moved a layer at a
        time while that scores lower, then the near-ties settled by the run's own plans
        (`placement_search.search_placement`; `placement_scores` gets every greedy score,
        `tie_scores` the finalists' planned ones)."""
        batches = calibration[:2]
        chosen, self.placement_scores, self.tie_scores = search_placement(
            self.setup.model,
            self.cost_model,
            num_ranks=self.setup.pipeline_parallel,
            workload=workload,
            unit_instances=self.sub_sizes,
            static=self.static,
            score=functools.partial(self.score_placement, batches),
            plan_score=functools.partial(self.plan_placement, batches),
            bound=functools.partial(self.bound_placement, batches),
            workers=workers,
        )
        return chosen

    def named(self, name: str, workload: Mapping[str, ModuleWorkload]) -> PlacementCandidate:
        """The placement `name` names, as the study prints DIP's: a static one ("static
        cost-split v2"), or such a cut moved ("static cost-split v1 cut 18/19/19/39"), or DIP's
        segments per module ("vit=1,llm=3"); no search. ValueError for a name that is none of
        those (an unknown static one: naming the static ones)."""
        model = self.setup.model
        if not name.startswith("static "):
            return segments_candidate(
                model,
                self.cost_model,
                num_ranks=self.setup.pipeline_parallel,
                workload=workload,
                segments=parse_segments(name),
            )
        known = {c.name: c for c in static_candidates(self.static)}
        try:
            return named_cut(model, known, name)
        except KeyError as err:
            raise ValueError(err.args[0]) from None

    def score_placement(self, batches: Sequence[BatchMeta], cand: PlacementCandidate) -> float:
        """`placement_search.simulated_score` of `batches` under the candidate (its plans without
        the other sub-microbatch cuts and offload offers: each would plan the batch again)."""
        return self._simulated(
            batches, cand, use_search=False, sub_size_scales=(), offload_offer_candidates=()
        )

    def plan_placement(self, batches: Sequence[BatchMeta], cand: PlacementCandidate) -> float:
        """`simulated_score`'s measure of the candidate's plans as the study's DIP plans them
        (every candidate of the planner, the split backward among them) but without the search
        (so the score is a function of the batches): the near-ties' score."""
        return self._simulated(batches, cand, use_search=False, split_backward=True)

    def _simulated(
        self, batches: Sequence[BatchMeta], cand: PlacementCandidate, **overrides: object
    ) -> float:
        """`simulated_score` of `batches` by this study's planner, with `overrides`, on `cand`."""
        trial = dataclasses.replace(self, dip=cand)
        limits = trial.memory(cand.placement)
        planner = trial.planner(**overrides)
        return simulated_score(planner, batches, limits=limits, channel=self.dip_channel)

    def bound_placement(self, batches: Sequence[BatchMeta], cand: PlacementCandidate) -> float:
        """`placement_search.rank_load_bound` of `batches` under the candidate: no
        `score_placement` of it is lower, so the search need not score a candidate whose bound
        exceeds the best score (the same choice for less work)."""
        trial = dataclasses.replace(self, dip=cand)
        return rank_load_bound(trial.planner(use_search=False, sub_size_scales=()), batches)

    def memory(self, placement: Placement) -> list[float]:
        """Each rank's activation limit under `placement` (times `memory_scale`)."""
        limits = activation_limits(placement, self.cost_model, device=self.device)
        return [limit * self.memory_scale for limit in limits]

    def planner(self, **overrides: object) -> DipPlanner:
        config = planner_config(
            shape=self.setup.shape,
            packing=self.limits,
            search=self.search,
            sub_sizes=self.sub_sizes,
            memory_limit=self.memory(self.dip_placement),
            offload_activations=True,
            recompute_modules=RECOMPUTE_MODULES,  # the norms' and MLP activation's outputs
            sub_size_scales=SUB_SIZE_SCALES,
            receive_lead=RECEIVE_LEAD,  # on `dip_channel`'s per-peer streams, as training
        )
        # plans that do not fit are scored as such, not raised
        config = dataclasses.replace(config, strict_memory=False)
        return DipPlanner(
            self.setup.model,
            self.cost_model,
            self.dip_placement,
            dataclasses.replace(config, **overrides),
            stage_units=self.dip.stage_units,
        )

    # -- one batch ---------------------------------------------------------------------------

    def run_batch(self, batch: BatchMeta) -> BatchResult:
        """Every static configuration and DIP's ablation steps on the same replica shards and
        microbatches, and the balanced bound. With several replicas, the iteration time is the
        slowest replica's."""
        base = self.planner()
        layout = base.layout(batch)
        stock: dict[tuple, list[StockResult]] = {}
        peers: dict[tuple, list[StockResult]] = {}
        dip: dict[str, list[Outcome]] = {}
        bounds = []
        whole_config = base.layout_config.with_whole_modules()
        for replica in layout.replicas:
            # Megatron runs every module's share of a microbatch at once.
            whole = resplit(self.setup.model, replica, whole_config)
            bounds.append(
                balanced_bound(
                    self.cost_model,
                    whole.submicrobatches,
                    num_ranks=self.setup.pipeline_parallel,
                )
            )
            mine = self._stock(layout, whole)
            for r in mine:
                stock.setdefault(r.key, []).append(r)
            for r in self._zero_bubble(layout, whole, mine):
                # By placement: each replica's peer runs under its own fastest setting.
                peers.setdefault(r.key[:2], []).append(r)
            for o in self._dip_steps(layout, replica):
                dip.setdefault(o.name, []).append(o)
        return BatchResult(
            layout.iteration,
            tuple(_slowest_stock(rs) for rs in stock.values()),
            tuple(max(os, key=lambda o: o.sim.iteration_time) for os in dip.values()),
            max(bounds),
            tuple(_slowest_stock(rs) for rs in peers.values()),
        )

    def _stock_work(self, layout: BatchLayout, whole: ReplicaLayout) -> StockWork:
        return StockWork(
            whole.submicrobatches, whole.dependencies, whole.infos, layout.totals, layout.iteration
        )

    def _zero_bubble(
        self, layout: BatchLayout, whole: ReplicaLayout, stock: Sequence[StockResult]
    ) -> list[StockResult]:
        """ZB-H1 on each static 1F1B placement: Megatron's 1F1B order under that placement's
        fastest fitting recompute setting on this batch, backwards split, W moved into the
        bubbles within 1F1B's own activation peak (ZB-H1's memory)."""
        from .weight_fill import split_into_bubbles

        work = self._stock_work(layout, whole)
        shapes = self.planner().shapes.for_lookup(whole.sub_of().__getitem__)
        out = []
        for pipe in self.static:
            mine = [r for r in stock if r.pipeline == pipe.name and r.schedule == "1f1b"]
            if pipe.num_model_chunks != 1 or not mine:
                continue
            best = fastest(mine)
            plan = megatron_plan(pipe, work, best.mode, cost_model=self.cost_model, tensors=shapes)
            limits = self.memory(pipe.placement)
            own = [min(lim, p) for lim, p in zip(limits, best.sim.peak_activation_bytes)]
            _, sim = split_into_bubbles(plan, self.cost_model, limits=own, baseline=best.sim)
            out.append(StockResult(pipe.name, "zb-h1", best.mode, sim, fits(sim, limits)))
        return out

    def _stock(self, layout: BatchLayout, whole: ReplicaLayout) -> list[StockResult]:
        """Every static placement with every recompute setting (`stock_configs`)."""
        work = self._stock_work(layout, whole)
        shapes = self.planner().shapes.for_lookup(whole.sub_of().__getitem__)
        out = []
        for pipe in self.static:
            out += evaluate_stock(
                pipe,
                work,
                cost_model=self.cost_model,
                tensors=shapes,
                limits=self.memory(pipe.placement),
                offload=True,  # Megatron-Core's fine-grained activation offloading
            )
        return out

    def _dip_steps(self, layout: BatchLayout, replica: ReplicaLayout) -> list[Outcome]:
        """DIP's ablation steps; each keeps the previous step's plan when that one is faster
        (the planner holds both), so a step never loses."""
        steps = [
            (
                "dip: separated",
                dict(
                    fill_bubbles=False,
                    use_search=False,
                    optimize_memory=False,
                    megatron_candidate=False,
                    sub_size_scales=(),
                ),
            ),
            (
                "dip: +interleave",
                dict(
                    use_search=False,
                    optimize_memory=False,
                    megatron_candidate=False,
                    sub_size_scales=(),
                ),
            ),
            (
                "dip: +mcts",
                dict(optimize_memory=False, megatron_candidate=False, sub_size_scales=()),
            ),
            ("dip: +memory", {}),  # also tries Megatron's order on its placement
        ]
        limits = self.memory(self.dip_placement)
        out: list[Outcome] = []
        for name, overrides in steps:
            outcome = self._dip(name, overrides, layout, replica.replica, limits)
            previous = out[-1] if out else None
            if (
                previous is not None
                and previous.fits
                and (not outcome.fits or previous.sim.iteration_time < outcome.sim.iteration_time)
            ):
                outcome = dataclasses.replace(
                    previous, name=name, plan_seconds=outcome.plan_seconds
                )
            out.append(outcome)
        out.append(self._split_step(out[-1], layout, replica.replica, limits))
        return out

    def _split_step(
        self, full: Outcome, layout: BatchLayout, replica: int, limits: list[float]
    ) -> Outcome:
        """The full DIP planned again with `PlannerConfig.split_backward` (the split is one more
        candidate of the planner: its list schedule with B/W, and the post-pass on its chosen
        plan); the previous step's plan where that is faster."""
        name = "dip: +B/W split (full DIP)"
        split = self._dip(name, dict(split_backward=True), layout, replica, limits)
        if full.fits and (not split.fits or full.sim.iteration_time < split.sim.iteration_time):
            return dataclasses.replace(full, name=name, plan_seconds=split.plan_seconds)
        return split

    def _dip(
        self, name: str, overrides: dict, layout: BatchLayout, replica: int, limits: list[float]
    ) -> Outcome:
        best = None
        modes = (None,) if overrides.get("optimize_memory", True) else MODES
        for mode in modes:
            uniform = None if mode is None else MemoryPolicy(mode)
            planner = self.planner(**overrides, uniform_recompute=uniform)
            started = time.perf_counter()
            rp = planner.plan_layout(layout, replica)
            seconds = time.perf_counter() - started
            sim = simulate(rp.plan, self.cost_model, channel=self.dip_channel)
            label = "per-chunk" if mode is None else mode.value
            o = Outcome(name, sim, fits(sim, limits), label, seconds, rp.plan)
            if best is None or (o.fits, -o.sim.iteration_time) > (
                best.fits,
                -best.sim.iteration_time,
            ):
                best = o
        return best


def _slowest_stock(results: Sequence[StockResult]) -> StockResult:
    """One configuration over the replicas: the slowest's timing, fitting only if all fit."""
    slowest = max(results, key=lambda r: r.sim.iteration_time)
    return dataclasses.replace(slowest, fits=all(r.fits for r in results))


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
