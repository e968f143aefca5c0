"""A run's planner configuration: what the planner needs to know about the run, made one way
(`planner_config`) by training, the start-up placement search (`scoring_config`) and the
studies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..data.packing import PackingLimits
from ..parallel import ParallelShape
from ..schedule.ir import Channels, MemoryPolicy
from ..schedule.passes import RECEIVE_LEAD
from .cost_model import OFFLOAD_OFFERS
from .search import SearchConfig

# The coarser sub-microbatch sizes a run with --dip-coarser-sub-microbatches (and the study's
# full DIP) also plans each batch at, as multiples of the configured ones, each a coarser cut
# than the one before (`sub_size_choice.scaled_sizes`).
COARSER_SUB_SIZES = (1.5, 2.0)


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner needs to know about the run (flags map onto these fields).

    `shape`: the parallel shape of the run the plans are for (its sequence length, DP replicas,
    TP and sequence parallelism, activation dtype); under --dip-emulate-compute the real run's,
    not the emulating processes'.
    """

    shape: ParallelShape
    sub_sizes: Mapping[str, int] = field(default_factory=dict)  # per non-LLM module
    search: SearchConfig = field(default_factory=SearchConfig)
    memory_limit_bytes: float | Sequence[float] | None = None  # activations, per rank
    lookahead: int = 1  # producer microbatches ahead of their consumer in the greedy order
    fill_bubbles: bool = True  # dual-queue interleaving (False: fixed segment order)
    use_search: bool = True
    optimize_memory: bool = True
    # No plan within memory_limit_bytes: raise MemoryLimitError (True), or return the best plan
    # found marked `ReplicaPlan.overcommitted` (False: simulation studies that score such plans).
    strict_memory: bool = True
    uniform_recompute: MemoryPolicy | None = None  # start from this mode on every chunk
    # The memory pass may also offload saved activations to host memory (`MemoryPolicy`),
    # at most this many bytes at once per rank (default: the device's `host_offload_share`).
    offload_activations: bool = False
    host_memory_limit_bytes: float | None = None
    # The memory pass may also recompute these cheap modules (`schedule.ir.RECOMPUTE_MODULES`:
    # the norms, the MLP activation) in the layers that keep their activations.
    recompute_modules: tuple[str, ...] = ()
    megatron_candidate: bool = True  # also try Megatron's order on this placement, keep faster
    # Check every plan against the IR's rules before returning it (off only where no plan is
    # ever run: the start-up search's scoring, `scoring_config`).
    validate_plans: bool = True
    # Split backwards into B and W, W in the bubbles (list-scheduled, `split_schedule`, or moved
    # by `weight_fill`), when that simulates faster within memory. Off by default: it doubles
    # planning time for a simulated 0.2-1% on the paper's rows, and its kernels' cost against
    # the fused backward has not been measured on a GPU (docs/benchmarks.md).
    split_backward: bool = False
    # With `split_backward` and the search on, search the unit order a second time scored by
    # split list schedules (`split_candidates.SplitCandidates.searched_order`). Off by default:
    # on VLM-S, T2V-S and VLM-M it found no faster order and costs about 0.5 s of CPU per plan
    # (docs/benchmarks.md).
    split_search: bool = False
    # With `split_backward`: run the fastest fitting split plan even where the fused plan
    # simulates faster, so that a benchmark measures the split runtime (its W, its reductions)
    # against the split simulation. Never a speed setting.
    split_always: bool = False
    # Also plan each batch with every split module's sub-microbatch size times each of these
    # factors (rounded up) and keep the plan that fits and simulates fastest
    # (`sub_size_choice`; the configured sizes win ties). Each new cut plans the batch once more.
    sub_size_scales: tuple[float, ...] = ()
    # With `offload_activations`: which offloads the memory pass offers beside recomputation
    # (`cost_model.OFFLOAD_OFFERS`, `CostModel.hidden_offload_layers`), and the other offers
    # each batch is also planned with, keeping the plan that fits and simulates fastest
    # (`sub_size_choice`). The memory pass prices a stage alone: an offload whose copy out
    # outlasts its forward can queue on the rank's copy channel behind the previous one, which
    # only the simulation sees ("drained" offers none such), and the "paced" offer's longer
    # reload chains can cost more there than they save ("chained" offers issue 24g's). A
    # candidate whose offers equal this planner's on every stage of the batch is not planned
    # (the same plan); each other one plans the batch once more per sub-microbatch cut.
    offload_offer: str = "paced"
    offload_offer_candidates: tuple[str, ...] = ("drained", "chained")
    packing: PackingLimits | None = None  # default: `batching.packing_limits` of the model
    # Post each receive this many computes ahead of where one stream allows (`RECEIVE_LEAD`, the
    # only lead there is), so that a message on the critical path travels while the rank still
    # computes (`add_communication`); the plans then need one stream per (sender, receiver)
    # pair (`Channels.PER_PEER`: training's ChannelGroups). 0: plans that run on one stream too.
    receive_lead: int = 0

    @property
    def channels(self) -> Channels:
        """The streams this configuration's plans are posted for."""
        return Channels.PER_PEER if self.receive_lead else Channels.SINGLE

    def __post_init__(self) -> None:
        if self.shape.seq_length is None:
            raise ValueError("PlannerConfig.shape has no seq_length (--seq-length)")
        for offer in (self.offload_offer, *self.offload_offer_candidates):
            if offer not in OFFLOAD_OFFERS:
                raise ValueError(f"PlannerConfig: offload offer {offer!r} not in {OFFLOAD_OFFERS}")
        if self.receive_lead not in (0, RECEIVE_LEAD):
            raise ValueError(
                f"PlannerConfig: receive_lead must be 0 or {RECEIVE_LEAD}, got {self.receive_lead}"
            )

    @property
    def seq_length(self) -> int:
        """Tokens of one packed microbatch."""
        return self.shape.seq_length

    @property
    def data_parallel(self) -> int:
        """Replicas a batch is split over."""
        return self.shape.dp


def planner_config(
    *,
    shape: ParallelShape,
    packing: PackingLimits,
    search: SearchConfig,
    sub_sizes: Mapping[str, int] | None = None,
    memory_limit: Sequence[float] | None = None,
    use_search: bool = True,
    uniform_recompute: MemoryPolicy | None = None,
    offload_activations: bool = False,
    split_backward: bool = False,
    split_search: bool = False,
    split_always: bool = False,
    recompute_modules: tuple[str, ...] = (),
    sub_size_scales: tuple[float, ...] = (),
    receive_lead: int = 0,
) -> PlannerConfig:
    """The one way a run's planner configuration is made: by training (`training.config`'s
    resolve, from the flags), the start-up placement search (`scoring_config` of it) and the
    studies (`compare.Comparison`), so a study plans what training would."""
    return PlannerConfig(
        shape=shape,
        sub_sizes=dict(sub_sizes or {}),
        search=search,
        memory_limit_bytes=memory_limit,
        use_search=use_search,
        uniform_recompute=uniform_recompute,
        packing=packing,
        offload_activations=offload_activations,
        split_backward=split_backward,
        split_search=split_search,
        split_always=split_always,
        recompute_modules=tuple(recompute_modules),
        sub_size_scales=tuple(sub_size_scales),
        receive_lead=receive_lead,
    )


def scoring_config(base: PlannerConfig, *, greedy: bool = True) -> PlannerConfig:
    """`base` as a placement is scored with it: without the search (so the score depends on
    the data alone), plans over the memory limit scored as such rather than raised, not
    validated (a score's plans are simulated, never run; the run's own plans are checked), and
    (`greedy`, the start-up search's score) at the configured sub-microbatch sizes and offload
    offer only (a placement's score, not its best plan); not `greedy`: with every candidate
    the run's planner has (`placement_ties`' score of near-ties)."""
    config = replace(base, use_search=False, strict_memory=False, validate_plans=False)
    if not greedy:
        return config
    return replace(config, sub_size_scales=(), offload_offer_candidates=())
