"""The DIP planner: from a batch's metadata to one validated `Plan` per data-parallel replica.

    BatchMeta -> replica split (balanced by estimated cost) -> packing into microbatches
      -> sub-microbatches + dependencies -> stage graph -> dual-queue list schedule
      -> MCTS over segment order -> recompute choice under the memory limit
      -> communication pass -> validated Plan

Everything here works on metadata only; the runtime is never imported.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from ..batching import BatchLayout, LayoutConfig, MessageShapes, MicrobatchWork, layout_batch
from ..batching import packing_limits as default_packing
from ..data.sample import BatchMeta, SampleMeta
from ..modalities import modality_of
from ..modelspec import MultimodalSpec
from ..schedule.graph import Dataflow
from ..schedule.ir import (
    NO_RECOMPUTE,
    BatchTotals,
    Dependency,
    MemoryPolicy,
    MessageKey,
    Placement,
    Plan,
    Recompute,
    StageId,
    SubMicrobatch,
)
from ..schedule.passes import TensorFn, add_communication
from ..schedule.validate import validate_plan
from .candidates import best_of_megatron
from .config import PlannerConfig
from .cost_model import StageCost
from .list_scheduler import (
    ListSchedule,
    StageGraph,
    build_stage_graph,
    list_makespan,
    list_schedule,
    priorities_from_units,
    unit_priority_ranks,
)
from .memory import MemoryLimitError, RecomputeChoice, stage_modes
from .message_room import MESSAGE_REFITS, MessageRoom
from .overheads import host_overheads
from .recompute_candidates import RecomputeCandidates
from .search import SearchResult, Unit, parallel_mcts_order, unit_constraints
from .simulator import activation_peaks
from .split_candidates import best_split_plan
from .stock_configs import peaks_fit
from .submicrobatch import split_modules

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaPlan:
    """A plan with the planner's own statistics."""

    plan: Plan
    greedy_makespan: float
    makespan: float
    rollouts: int
    recompute_added: float
    planning_seconds: float
    simulated_time: float | None = None  # of the chosen plan, when candidates were compared
    # The plan holds more activations than the limit on some rank; only with
    # `strict_memory=False` (otherwise such a batch raises MemoryLimitError).
    overcommitted: bool = False


class DipPlanner:
    """Plans batches for a fixed model, placement and cost model."""

    def __init__(
        self,
        model: MultimodalSpec,
        cost_model,
        placement: Placement,
        config: PlannerConfig,
        *,
        stage_units: list | None = None,
    ) -> None:
        """`stage_units`: Megatron's virtual stages of `placement` when it is a static Megatron
        placement (the Megatron-order candidate then runs on them)."""
        self.model = model
        self.cost_model = cost_model
        self.placement = placement
        self.config = config
        self.stage_units = stage_units
        missing = [m.name for m in split_modules(model) if m.name not in config.sub_sizes]
        if missing:
            raise ValueError(f"PlannerConfig.sub_sizes lacks module(s) {missing}")
        # (dataflow, forward_only, StageGraph) of the last graph built, see stage_graph
        self._graph_cache: tuple | None = None
        # Per plan (keyed by its sub-microbatch table): message tensors and stage costs, asked
        # for several times each by the graph, memory and communication passes.
        self._memo: tuple = (None, {}, {}, {}, {})
        # CPU seconds spent per pass over this planner's plans (`tools/planner_speed.py`):
        # statistics only, nothing planned depends on them.
        self.pass_seconds: Counter[str] = Counter()
        self.shapes = MessageShapes(model, config.shape)
        self._offer_planners: dict[str, DipPlanner] = {}  # `offer_planners`
        # Kept for message buffers while a replica is planned (`scheduling_limits`).
        self.message_room = MessageRoom()

    # -- data side ---------------------------------------------------------------------------

    @property
    def layout_config(self) -> LayoutConfig:
        """How this planner's runs cut batches (`batching.layout_batch`)."""
        c = self.config
        return LayoutConfig(
            seq_length=c.seq_length,
            packing=c.packing or default_packing(self.model, c.seq_length),
            sub_sizes=c.sub_sizes,
            pad_multiple=c.shape.sequence_split,
            data_parallel=c.data_parallel,
        )

    @contextlib.contextmanager
    def _pass(self, name: str) -> Iterator[None]:
        """Count the CPU time of the block as pass `name` (`pass_seconds`)."""
        started = time.process_time()
        try:
            yield
        finally:
            self.pass_seconds[name] += time.process_time() - started

    def layout(self, batch: BatchMeta) -> BatchLayout:
        """The global batch over the replicas: samples balanced by estimated cost, each
        replica's share packed and cut into sub-microbatches."""
        with self._pass("layout"):
            return layout_batch(self.model, batch, self.layout_config, cost=self.sample_cost)

    def sample_cost(self, meta: SampleMeta) -> float:
        """Estimated compute of one sample: every module's time on its share of the sample."""
        total = 0.0
        for m in self.model.modules:
            modality = modality_of(m)
            tokens, n = modality.module_tokens(m, meta)
            if not (n and tokens):
                continue
            items = modality.microbatch_instances(m, [meta], seq_length=self.config.seq_length)
            context, _ = modality.context(m, [meta], items)  # a DiT clip's caption
            total += self.cost_model.module_time(
                m.name, instances=n, tokens=tokens, context_tokens=context
            )
        return total

    # -- planning ----------------------------------------------------------------------------

    def plan_batch(self, batch: BatchMeta, *, search: bool | None = None) -> list[ReplicaPlan]:
        """One plan per data-parallel replica for the global batch `batch`; `search` overrides
        `config.use_search` (False: the greedy plan only)."""
        layout = self.layout(batch)
        return [self.plan_layout(layout, r.replica, search=search) for r in layout.replicas]

    def plan_layout(
        self,
        layout: BatchLayout,
        replica: int,
        *,
        forward_only: bool = False,
        search: bool | None = None,
    ) -> ReplicaPlan:
        """The plan of one replica of a laid-out batch (at the configured sub-microbatch sizes
        or, with `config.sub_size_scales`, at the coarser ones where that plan is faster:
        `sub_size_choice`)."""
        from .sub_size_choice import plan_with_sizes

        return plan_with_sizes(self, layout, replica, forward_only=forward_only, search=search)

    def plan_replica(
        self,
        works: Sequence[MicrobatchWork],
        *,
        iteration: int,
        replica: int,
        totals: BatchTotals,
        forward_only: bool = False,
        search: bool | None = None,
        quick: bool = False,
    ) -> ReplicaPlan:
        """Schedule the microbatches of one replica and return its validated plan; `quick`:
        one list schedule, no search and no Megatron-order candidate, the memory pass only if
        that schedule cannot fit (`fallback_plan`)."""
        started = time.perf_counter()
        subs = tuple(s for w in works for s in w.submicrobatches)
        deps = tuple(d for w in works for d in w.dependencies)
        dataflow = Dataflow(self.placement, subs, deps)
        sub_of = {s.work: s for s in subs}
        use_search = self.config.use_search if search is None else search
        lower = functools.partial(
            self._lowered,
            dataflow=dataflow,
            works=works,
            subs=subs,
            deps=deps,
            tensors=functools.partial(self.message_tensors, sub_of),
            iteration=iteration,
            replica=replica,
            totals=totals,
            forward_only=forward_only,
        )
        with self._room_kept(dataflow, sub_of, planned=not (forward_only or quick)):
            return self._planned(
                works,
                dataflow,
                sub_of,
                lower,
                totals=totals,
                forward_only=forward_only,
                use_search=use_search,
                quick=quick,
                started=started,
            )

    def _planned(
        self,
        works: Sequence[MicrobatchWork],
        dataflow: Dataflow,
        sub_of: Mapping,
        lower: Callable[[ListSchedule], Plan],
        *,
        totals: BatchTotals,
        forward_only: bool,
        use_search: bool,
        quick: bool,
        started: float,
    ) -> ReplicaPlan:
        """`plan_replica`'s plan, scheduled within the room for message buffers and lowered by
        `lower` (`_lowered` of the replica)."""
        schedule_it = functools.partial(
            self._schedule,
            dataflow,
            sub_of,
            forward_only=forward_only,
            use_search=use_search and not quick,
            quick=quick,
        )
        scheduled = schedule_it()
        if scheduled[0].overcommitted and self.message_room.keeps_any:
            # Nothing fits within the first room: no room, then what the plan needs (the
            # order searched within the room is scheduled again, not searched again).
            self.message_room.drop()
            scheduled = schedule_it(searched=scheduled[1])
        plan = lower(scheduled[0])
        simulated, candidates, fits = None, not (forward_only or quick), True
        if candidates:
            plan, scheduled, fits = self._fit_messages(plan, scheduled, lower, dataflow, sub_of)
        schedule, result, choice, errors = scheduled
        own, over = plan, schedule.overcommitted or not fits
        if self.config.megatron_candidate and candidates:
            with self._pass("candidates"):
                plan, simulated = best_of_megatron(
                    self, plan, works, totals=totals, replica=plan.replica, over=over
                )
        if self.config.split_backward and candidates:
            with self._pass("backward split"):
                scheduled = (dataflow, sub_of, result.order, choice)
                plan, simulated = best_split_plan(self, plan, own, scheduled, use_search)
        overcommitted = over and plan.name == "dip"  # the candidates are taken only if they fit
        if overcommitted:
            self._overcommitted(plan, errors)
        return ReplicaPlan(
            plan,
            result.greedy_makespan,
            schedule.makespan,
            result.rollouts,
            choice.added_time,
            time.perf_counter() - started,
            simulated,
            overcommitted=overcommitted,
        )

    def _lowered(
        self,
        schedule: ListSchedule,
        *,
        dataflow: Dataflow,
        works: Sequence[MicrobatchWork],
        subs: tuple[SubMicrobatch, ...],
        deps: tuple[Dependency, ...],
        tensors: TensorFn,
        iteration: int,
        replica: int,
        totals: BatchTotals,
        forward_only: bool,
    ) -> Plan:
        """DIP's plan of `schedule`'s compute orders for `works` (`subs`, `deps`: their
        sub-microbatches and dependencies; `tensors`: their message shapes): their messages
        added (`add_communication`), validated where the config asks."""
        with self._pass("communication"):
            programs = add_communication(
                schedule.orders,
                dataflow,
                tensors=tensors,
                compute_time=schedule.duration,
                channels=self.config.channels,
            )
        plan = Plan(
            iteration=iteration,
            placement=self.placement,
            microbatches=tuple(w.info for w in works),
            submicrobatches=subs,
            dependencies=deps,
            totals=totals,
            programs=programs,
            replica=replica,
            forward_only=forward_only,
            name="dip",
            channels=self.config.channels,
        )
        if self.config.validate_plans:
            with self._pass("validation"):
                validate_plan(plan)
        return plan

    def fallback_plan(self, layout: BatchLayout, replica: int) -> Plan:
        """A plan of one replica in milliseconds, for an iteration the planner process has no
        plan ready for: Megatron's order on this placement under the cheapest uniform recompute
        setting that fits, else one list schedule (`planner.fallback`). Deterministic: made
        once (on one rank) and shared, it is what every rank runs."""
        from .fallback import fallback_plan

        return fallback_plan(self, layout, replica)

    def plan_memos(self, sub_of: Mapping) -> tuple[dict, dict, dict, dict]:
        """Per plan: message tensors, stage costs, candidate modes, the memory pass's rows."""
        if self._memo[0] is not sub_of:
            self._memo = (sub_of, {}, {}, {}, {})
        return self._memo[1:]

    def message_tensors(self, sub_of: Mapping, key: MessageKey) -> tuple:
        """The tensors of message `key` of the plan of `sub_of` (its sub-microbatches by work
        id; `MessageShapes.tensors`, memoized per plan)."""
        memo = self.plan_memos(sub_of)[0]
        found = memo.get(key)
        if found is None:
            found = memo[key] = self.shapes.tensors(key, sub_of.__getitem__)
        return found

    def _message_bytes(self, sub_of: Mapping, key: MessageKey) -> int:
        """Bytes of message `key` of this plan (`message_tensors`)."""
        return sum(t.nbytes for t in self.message_tensors(sub_of, key))

    def stage_cost(self, sub_of: Mapping, stage: StageId, mode: MemoryPolicy) -> StageCost:
        """`cost_model.stage_cost` of a stage of this plan (memoized per plan)."""
        memo = self.plan_memos(sub_of)[1]
        found = memo.get((stage, mode))
        if found is None:
            chunk = self.placement.module(stage.module).chunks[stage.chunk]
            found = memo[(stage, mode)] = self.cost_model.stage_cost(
                chunk, sub_of[stage.work], mode
            )
        return found

    def _schedule(
        self,
        dataflow: Dataflow,
        sub_of: Mapping,
        *,
        forward_only: bool,
        use_search: bool,
        quick: bool = False,
        searched: SearchResult | None = None,
    ) -> tuple[ListSchedule, SearchResult, RecomputeChoice, list[MemoryLimitError]]:
        """The list schedule of the searched order (`searched`: that search's, not searched
        again), with the recompute choice that fits the memory limit best, and the memory
        pass's errors (for the caller's report)."""
        limits = self.scheduling_limits
        choice = self.uniform_choice()
        with self._pass("list schedule"):
            graph = self.stage_graph(dataflow, sub_of, choice, forward_only=forward_only)
        search = searched
        if search is None:
            with self._pass("search"):
                search = self.search_order(graph, dataflow, limits, use_search=use_search)
        with self._pass("list schedule"):
            schedule = self.list_scheduled(graph, search.order, limits, choice)
        errors: list[MemoryLimitError] = []
        trade = not quick or schedule.overcommitted  # quick: only what it takes to fit
        if self.config.optimize_memory and limits is not None and not forward_only and trade:
            with self._pass("memory pass"):
                pass_ = RecomputeCandidates(self, dataflow, sub_of, search.order, limits)
                candidates = pass_.all(errors=errors)
            for candidate in candidates:  # one that fits before one that does not
                new, old = candidate[0], schedule
                if (new.overcommitted, new.makespan) < (old.overcommitted, old.makespan):
                    schedule, choice = candidate
        return schedule, search, choice, errors

    def _overcommitted(self, plan: Plan, errors: list[MemoryLimitError]) -> None:
        """Raise `MemoryLimitError` for DIP's `plan` over the limit with its message buffers
        (the memory pass, if on, found no recompute choice that fits, or the buffers took the
        plan over and no schedule within the room fits: `_fit_messages`); with
        `strict_memory=False` only warn: that caller scores plans that do not fit itself
        (simulation studies, ablations)."""
        peaks = activation_peaks(plan, self.cost_model)
        over = "; ".join(
            f"rank {r}: {p / 2**30:.4f} GiB > {lim / 2**30:.4f} GiB"
            for r, (p, lim) in enumerate(zip(peaks, self.device_limits or []))
            if p > lim
        )
        if not self.config.strict_memory:
            logger.warning("plan overcommits activation memory: %s", over)
            return
        if errors:
            raise errors[-1]
        how = "even with recomputation" if self.config.optimize_memory else "without recomputation"
        raise MemoryLimitError(
            f"activation-memory limit cannot be met {how} ({over}, pipeline message buffers "
            "included); raise --dip-memory-limit-gb or use smaller sub-microbatches"
        )

    def memory_policies(self, sub_of: Mapping, stage: StageId) -> tuple[MemoryPolicy, ...]:
        """The stage's candidate memory policies (`stage_modes`; memoized per plan)."""
        memo = self.plan_memos(sub_of)[2]
        found = memo.get(stage)
        if found is None:
            chunk = self.placement.module(stage.module).chunks[stage.chunk]
            offload = self.config.offload_activations
            hidden = functools.partial(self._hidden, chunk, sub_of[stage.work])
            found = memo[stage] = stage_modes(
                chunk.num_layers,
                offload=offload,
                hidden=hidden,
                modules=self.config.recompute_modules,
            )
        return found

    def uniform_choice(self) -> RecomputeChoice:
        """Every chunk under `PlannerConfig.uniform_recompute` (none: no recomputation), the
        choice plans start from before the memory pass."""
        mode = self.config.uniform_recompute
        if mode is None or mode.method is Recompute.NONE:
            return RecomputeChoice({}, 0.0)
        return RecomputeChoice(
            {(m.name, c.index): mode for m in self.placement.modules for c in m.chunks}, 0.0
        )

    def _hidden(self, chunk, sub, block: int) -> int:
        """Layers whose offload hides after block recomputation of the first `block` (as
        `PlannerConfig.offload_offer` counts them)."""
        recompute = MemoryPolicy(Recompute.BLOCK, block) if block else NO_RECOMPUTE
        offer = self.config.offload_offer
        return self.cost_model.hidden_offload_layers(chunk, sub, recompute, offer=offer)

    def offer_planners(self) -> list[DipPlanner]:
        """The planners of `PlannerConfig.offload_offer_candidates`' plans (the same but for
        `offload_offer`, with no candidates of their own; each made once); none without
        offload or the memory pass (nothing offered)."""
        c = self.config
        if not (c.offload_activations and c.optimize_memory):
            return []
        out = []
        for offer in dict.fromkeys(c.offload_offer_candidates):
            if offer == c.offload_offer:
                continue
            if offer not in self._offer_planners:
                config = replace(c, offload_offer=offer, offload_offer_candidates=())
                self._offer_planners[offer] = DipPlanner(
                    self.model,
                    self.cost_model,
                    self.placement,
                    config,
                    stage_units=self.stage_units,
                )
            out.append(self._offer_planners[offer])
        return out

    def offers_differ(self, other: DipPlanner, works: Sequence[MicrobatchWork]) -> bool:
        """Whether the memory pass of `other` (a planner of this one's placement) offers any
        stage of `works` other memory policies than this planner's (`stage_modes`): where not,
        `other` plans them the same (nothing else in a plan depends on the offer)."""
        for sub in (s for w in works for s in w.submicrobatches):
            for chunk in self.placement.module(sub.module).chunks:
                modes = [
                    stage_modes(
                        chunk.num_layers,
                        offload=p.config.offload_activations,
                        hidden=functools.partial(p._hidden, chunk, sub),
                        modules=p.config.recompute_modules,
                    )
                    for p in (self, other)
                ]
                if modes[0] != modes[1]:
                    return True
        return False

    def host_limits(self) -> list[float] | None:
        """Per rank, the offloaded bytes it may keep in host memory at once
        (`PlannerConfig.host_memory_limit_bytes`, default its device's `host_offload_share`);
        None without offload."""
        if not self.config.offload_activations:
            return None
        share = self.config.host_memory_limit_bytes
        if share is None:
            share = self.cost_model.device.host_offload_share
        return [float(share)] * self.placement.num_ranks

    def host_limit_args(self, sub_of: Mapping) -> dict:
        """The memory pass's host-memory arguments (none without offload)."""
        limits = self.host_limits()
        if limits is None:
            return {}
        return {"host_bytes": functools.partial(self._host_bytes, sub_of), "host_limit": limits}

    def _host_bytes(self, sub_of: Mapping, stage: StageId, policy: MemoryPolicy) -> float:
        if not policy.offload:
            return 0.0
        chunk = self.placement.module(stage.module).chunks[stage.chunk]
        return float(self.cost_model.offloaded_bytes(chunk, sub_of[stage.work], policy))

    def _room_kept(self, dataflow: Dataflow, sub_of: Mapping, *, planned: bool):
        """The block schedules `dataflow`'s plans within the device's limits less room for
        their message buffers (`scheduling_limits`; `planned` False or no limits: no room):
        at first `message_room.first_room`, grown by `_fit_messages` where a lowered plan
        needs more."""
        if not planned or self.device_limits is None:
            return contextlib.nullcontext()
        message_bytes = functools.partial(self._message_bytes, sub_of)
        return self.message_room.kept(dataflow, message_bytes, self.placement.num_ranks)

    def _fit_messages(
        self, plan: Plan, scheduled: tuple, lower: Callable, dataflow: Dataflow, sub_of: Mapping
    ) -> tuple[Plan, tuple, bool]:
        """`plan` (lowered from `scheduled`, `_schedule`'s), fitted to the device's limits with
        its message buffers (`message_room`), with whether it fits them; from here on plans are
        scheduled within the limits less room for them (`scheduling_limits`). Where the plan does
        not fit with its buffers, the searched order is scheduled again within the limits less
        the room grown to them (conservative: the two peaks need not coincide),
        `MESSAGE_REFITS` times at most. A schedule over the room that does not fit with its own
        buffers either is not taken: the plan before it is kept, and reported over the limit
        (`_overcommitted`)."""
        fits = self._fits(plan)
        if self.message_room.bytes is None:
            return plan, scheduled, fits
        for _ in range(MESSAGE_REFITS):
            if fits:
                break
            self.message_room.grow(plan)
            again = self._schedule(
                dataflow, sub_of, forward_only=False, use_search=False, searched=scheduled[1]
            )
            lowered = lower(again[0])
            lowered_fits = self._fits(lowered)
            if again[0].overcommitted and not lowered_fits:
                break  # nothing fits within the room: the plan before is kept
            scheduled, plan, fits = again, lowered, lowered_fits
        return plan, scheduled, fits

    def _fits(self, plan: Plan) -> bool:
        """Whether `plan` holds no more than the device's limits, message buffers included."""
        limits = self.device_limits
        return limits is None or peaks_fit(activation_peaks(plan, self.cost_model), limits)

    @property
    def scheduling_limits(self) -> list[float] | None:
        """Per rank, the activation bytes plans are scheduled within: the device's limits
        (`device_limits`) less the room kept for message buffers while a replica is planned
        (`message_room`)."""
        return self.message_room.less(self.device_limits)

    @property
    def device_limits(self) -> list[float] | None:
        """Per rank, the activation bytes a plan may hold, its message buffers included (None:
        no limit)."""
        limit = self.config.memory_limit_bytes
        if limit is None:
            return None
        if isinstance(limit, (int, float)):
            return [float(limit)] * self.placement.num_ranks
        if len(limit) != self.placement.num_ranks:
            raise ValueError(f"{len(limit)} memory limits for {self.placement.num_ranks} ranks")
        return [float(x) for x in limit]

    @property
    def device_limits_or_infinite(self) -> list[float]:
        """`device_limits`, with an infinite limit per rank where there is none (for the
        passes that compare every rank's peak with a number)."""
        return self.device_limits or [float("inf")] * self.placement.num_ranks

    def stage_graph(
        self, dataflow: Dataflow, sub_of: Mapping, choice: RecomputeChoice, *, forward_only: bool
    ) -> StageGraph:
        """The list scheduler's graph of `dataflow`'s stages under `choice`, with the runtime's
        host time in every duration."""
        # Durations as the runtime takes them: compute plus each instruction's and each
        # message's host time (the posted batches are the simulator's to charge).
        host = host_overheads(self.cost_model)

        def stage_cost(stage: StageId, recompute: MemoryPolicy) -> tuple[float, float, int]:
            c = self.stage_cost(sub_of, stage, recompute)
            return (*host.instruction_times(c.forward, c.backward), c.activation_bytes)

        def transfer(key: MessageKey) -> float:
            return self.cost_model.transfer_time(self._message_bytes(sub_of, key)) + host.message

        # One plan asks for the graph of one dataflow under several recompute choices: its edges
        # and transfer delays are built once (the last dataflow's graph is kept) and only the
        # stage costs are redone.
        cached = self._graph_cache
        if cached is not None and cached[0] is dataflow and cached[1] == forward_only:
            return cached[2].with_costs(stage_cost, choice.of)
        graph = build_stage_graph(
            dataflow,
            stage_cost=stage_cost,
            transfer=transfer,
            recompute=choice.of,
            forward_only=forward_only,
        )
        self._graph_cache = (dataflow, forward_only, graph)
        return graph

    def mode_cost(self, sub_of: Mapping, stage: StageId, mode: MemoryPolicy) -> tuple[float, int]:
        """(forward + backward seconds, stored activation bytes) of `stage` under `mode`."""
        c = self.stage_cost(sub_of, stage, mode)
        return c.forward + c.backward, c.activation_bytes

    def _units(self, dataflow: Dataflow) -> dict[str, list[int]]:
        units: dict[str, list[int]] = {}
        for w in dataflow.works:
            mbs = units.setdefault(w.module, [])
            if not mbs or mbs[-1] != w.microbatch:
                mbs.append(w.microbatch)
        return units

    def search_order(
        self, graph, dataflow: Dataflow, limits, *, use_search: bool, factory=None
    ) -> SearchResult:
        """The unit order search; `factory` makes its scorer (default: the fused list
        schedule's makespan on `graph`)."""
        feeds = {m.name: m.feeds for m in self.model.modules}
        constraints = unit_constraints(
            self._units(dataflow), feeds, lookahead=self.config.lookahead
        )
        if factory is None:
            factory = functools.partial(_score_factory, graph, limits, self.config.fill_bubbles)
        config = self.config.search
        if not use_search:
            config = replace(config, max_rollouts=1, workers=1)
        return parallel_mcts_order(constraints, factory, config)

    def list_scheduled(
        self,
        graph: StageGraph,
        order: Sequence[Unit],
        limits: Sequence[float] | None,
        choice: RecomputeChoice,
    ) -> ListSchedule:
        """`graph` list-scheduled in the unit `order`'s priorities within `limits`, under
        `choice`."""
        return list_schedule(
            graph,
            priority=priorities_from_units(graph.stages, order),
            memory_limit=limits,
            recompute=choice.of,
            fill_bubbles=self.config.fill_bubbles,
        )


def _score_factory(graph, limits, fill_bubbles: bool):
    """A picklable scorer for the search workers: unit order -> list-schedule makespan."""

    def score(order) -> float:
        return list_makespan(
            graph,
            priority=unit_priority_ranks(graph, order),
            memory_limit=limits,
            fill_bubbles=fill_bubbles,
        )

    return score
