"""The DIP planner end to end on metadata: determinism, search vs greedy, memory, and the planner
service delivering one plan per iteration to every rank, with the inline fallback."""

from __future__ import annotations

import dataclasses
import functools
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from megatron_dip.data.sample import BatchMeta
from megatron_dip.data.synthetic import generate_meta
from megatron_dip.modelspec import tiny_vlm
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.config import PlannerConfig
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import DeviceSpec, get_device
from megatron_dip.planner.dip import DipPlanner
from megatron_dip.planner.placement import ModuleWorkload, build_dip_placement
from megatron_dip.planner.search import SearchConfig
from megatron_dip.planner.service import (
    GREEDY,
    INLINE,
    SEARCHED,
    PlanClient,
    PlannerService,
    StoreAddress,
)
from megatron_dip.planner.simulator import simulate
from megatron_dip.schedule.ir import Forward, Recompute
from megatron_dip.schedule.serialize import plan_from_bytes, plan_to_bytes
from megatron_dip.schedule.validate import validate_plan

SEQ = 256


def make_planner(
    *,
    rollouts: int = 12,
    sleep_s: float = 0.0,
    memory_gb: float | None = None,
    data_parallel: int = 1,
    workers: int = 1,
    budget_s: float = 60.0,
    device: str | DeviceSpec = "H100",
    **overrides: object,
) -> DipPlanner:
    """A planner for the tiny VLM on 2 pipeline ranks (module-level: picklable for the service);
    `overrides`: other `PlannerConfig` fields."""
    model = tiny_vlm()
    cost = CostModel(model, get_device(device) if isinstance(device, str) else device)
    workload = {"vit": ModuleWorkload(4, 256), "llm": ModuleWorkload(1, SEQ)}
    placement, _ = build_dip_placement(model, cost, num_ranks=2, workload=workload)
    config = PlannerConfig(
        shape=ParallelShape(dp=data_parallel, seq_length=SEQ),
        sub_sizes={"vit": 2},
        search=SearchConfig(max_rollouts=rollouts, time_budget_s=budget_s, seed=7, workers=workers),
        memory_limit_bytes=None if memory_gb is None else memory_gb * 2**30,
    )
    planner = DipPlanner(model, cost, placement, dataclasses.replace(config, **overrides))
    if sleep_s:
        planner.plan_batch = _slow(planner.plan_batch, sleep_s)
    return planner


def _slow(fn, seconds):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return wrapper


def batch(iteration: int, *, samples: int = 24) -> BatchMeta:
    metas = generate_meta(
        "mixed",
        model=tiny_vlm(),
        num_samples=samples,
        seed=3,
        start=iteration * samples,
        scale=0.05,
    )
    return BatchMeta(iteration, tuple(metas))


# -- planning in-process -----------------------------------------------------------------------


def test_plans_are_valid_deterministic_and_search_never_loses():
    a = make_planner().plan_batch(batch(0))
    b = make_planner().plan_batch(batch(0))
    assert [plan_to_bytes(r.plan) for r in a] == [plan_to_bytes(r.plan) for r in b]
    for r in a:
        validate_plan(r.plan)
        assert r.makespan <= r.greedy_makespan + 1e-12
        assert r.rollouts == 12
        # Sub-microbatches: the ViT work is cut into pieces of at most 2 images.
        assert all(s.num_instances <= 2 for s in r.plan.submicrobatches if s.module == "vit")
    greedy = make_planner().plan_batch(batch(0), search=False)
    assert greedy[0].rollouts == 1


def test_data_parallel_replicas_get_their_own_balanced_plans():
    plans = make_planner(data_parallel=2).plan_batch(batch(1, samples=40))
    assert [r.plan.replica for r in plans] == [0, 1]
    ids = [set(i for mb in r.plan.microbatches for i in mb.sample_ids) for r in plans]
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == 40
    totals = {r.plan.totals for r in plans}
    assert len(totals) == 1  # both replicas normalise by the same global denominators
    times = [simulate(r.plan, make_planner().cost_model).iteration_time for r in plans]
    assert max(times) / min(times) < 1.5


def test_a_plan_fits_its_limit_with_its_message_buffers():
    """The list scheduler and the memory pass see stored activations only. At a limit the free
    plan exceeds only once its message buffers count, the planner schedules within room for
    them (`DipPlanner.scheduling_limits`, `_fit_messages`): the plan fits with its buffers."""
    from megatron_dip.planner.simulator import activation_peaks, message_peaks

    cost = make_planner().cost_model
    free = make_planner().plan_batch(batch(2))[0].plan
    peak, buffers = max(activation_peaks(free, cost)), max(message_peaks(free))
    assert 0 < buffers < peak
    limit = peak - buffers / 2
    tight = make_planner(memory_gb=limit / 2**30, megatron_candidate=False)
    tight = tight.plan_batch(batch(2))[0].plan  # DIP's own order: no candidate to fall back on
    assert max(activation_peaks(tight, cost)) <= limit
    assert simulate(tight, cost).peak_activation_bytes == activation_peaks(tight, cost)


def test_where_nothing_fits_within_the_first_message_room_the_search_is_not_run_again(
    monkeypatch,
):
    """At a limit so tight that no schedule fits within it less the first room for message
    buffers (10% of the free plan's peak: full recomputation and little else), the planner
    schedules the order it searched again with no room, then with the room the plan's buffers
    need (`DipPlanner._planned`, `_fit_messages`): one search, and a plan within the limit."""
    from planner_cases import tiny_case

    from megatron_dip.planner.simulator import activation_peaks

    case = tiny_case(pipeline=2, search=True)
    cost = case.cost_model()
    free = simulate(case.planner(None).plan_batch(case.batch)[0].plan, cost)
    limit = 0.1 * max(free.peak_activation_bytes)
    planner = case.planner(limit)
    rooms, searches = [], []
    schedule, search = DipPlanner._schedule, DipPlanner.search_order
    monkeypatch.setattr(
        DipPlanner,
        "_schedule",
        lambda self, *a, **k: rooms.append(self.message_room.bytes) or schedule(self, *a, **k),
    )
    monkeypatch.setattr(
        DipPlanner,
        "search_order",
        lambda self, *a, **k: searches.append(1) or search(self, *a, **k),
    )
    plan = planner.plan_batch(case.batch)[0].plan
    assert any(rooms[0]) and not any(rooms[1]) and any(rooms[2])
    assert len(searches) == 1
    assert max(activation_peaks(plan, cost)) <= limit


def test_memory_limit_is_respected_in_simulation():
    free = make_planner().plan_batch(batch(2))[0]
    peak = max(simulate(free.plan, make_planner().cost_model).peak_activation_bytes)
    limit_gb = 0.6 * peak / 2**30
    tight = make_planner(memory_gb=limit_gb).plan_batch(batch(2))[0]
    sim = simulate(tight.plan, make_planner().cost_model)
    assert max(sim.peak_activation_bytes) <= limit_gb * 2**30
    assert (
        any(
            i.memory.method.value != "none"
            for p in tight.plan.programs
            for i in p.instructions
            if isinstance(i, Forward)
        )
        or sim.iteration_time >= simulate(free.plan, make_planner().cost_model).iteration_time
    )


class _SlowedRank:
    """This process as a slow, loaded rank: every clock read jumps `step_s` ahead (a rank that
    is descheduled between any two reads) and a busy thread competes for the interpreter."""

    def __init__(self, monkeypatch, step_s: float) -> None:
        self.offset, self.step_s = 0.0, step_s
        for name in ("monotonic", "perf_counter", "time"):
            monkeypatch.setattr(time, name, self._warped(getattr(time, name)))
        self.stop = threading.Event()
        self.hog = threading.Thread(target=self._spin, daemon=True)

    def _warped(self, real):
        def now() -> float:
            self.offset += self.step_s
            return real() + self.offset

        return now

    def _spin(self) -> None:
        while not self.stop.is_set():
            sum(range(1000))

    def __enter__(self):
        self.hog.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.hog.join()


def test_ranks_slowed_differently_make_identical_plans(monkeypatch):
    """What the ranks must agree on depends on the batch alone: the greedy plan and the
    fallback plan of one batch, with the memory pass binding (recompute chosen), are the same
    bytes on an idle rank, twice, and on a rank slowed by 1000 s per clock read and a busy
    thread."""
    free = make_planner().plan_batch(batch(2), search=False)[0]
    limit_gb = 0.6 * max(simulate(free.plan, make_planner().cost_model).peak_activation_bytes)
    limit_gb /= 2**30

    def plans() -> tuple[bytes, bytes]:
        planner = make_planner(memory_gb=limit_gb)
        greedy = planner.plan_batch(batch(2), search=False)[0].plan
        fallback = planner.fallback_plan(planner.layout(batch(2)), 0)
        return plan_to_bytes(greedy), plan_to_bytes(fallback)

    idle = plans()
    assert idle == plans()
    with monkeypatch.context() as m, _SlowedRank(m, step_s=1000.0):
        assert plans() == idle
    greedy = plan_from_bytes(idle[0])
    assert any(
        i.memory.method is not Recompute.NONE
        for p in greedy.programs
        for i in p.instructions
        if isinstance(i, Forward)
    )  # the memory pass chose recomputation: the part that used to hang on the clock


# -- the service ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store_address():
    port = _free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
    yield StoreAddress("127.0.0.1", port), master


def _client(address: StoreAddress) -> PlanClient:
    return PlanClient(address.connect(), replica=0)


def _wait_ready(store, iteration: int, want: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    key = f"dip/{iteration}/ready"
    while time.monotonic() < deadline:
        if store.check([key]) and store.get(key).decode() == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"planner never published {want} for iteration {iteration}")


def test_service_delivers_one_plan_to_every_rank_and_falls_back_inline(store_address):
    address, master = store_address
    service = PlannerService(functools.partial(make_planner, rollouts=6), address, lookahead=2)
    try:
        service.submit(batch(0))
        _wait_ready(master, 0, SEARCHED)
        ranks = [_client(address), _client(address)]
        fetched = [c.fetch(0, inline=lambda: pytest.fail("no inline plan expected")) for c in ranks]
        assert {v for _, v in fetched} == {SEARCHED}
        assert plan_to_bytes(fetched[0][0]) == plan_to_bytes(fetched[1][0])
        # Nothing submitted for iteration 5: the first rank decides "inline", all follow.
        inline = make_planner().plan_batch(batch(5), search=False)[0].plan
        got = [c.fetch(5, inline=lambda: inline) for c in ranks]
        assert [v for _, v in got] == [INLINE, INLINE]
        assert ranks[0].inline_count == ranks[1].inline_count == 1
        ranks[0].cleanup(0, num_replicas=1)
        assert not master.check(["dip/0/decision"])
    finally:
        service.close()


def test_a_late_plan_is_made_once_on_rank_0_and_shared(store_address):
    """Nothing ready for iteration 4: rank 0 makes the fallback (Megatron's order on the
    placement) for every replica and publishes it; rank 1 reads it and plans nothing."""
    address, master = store_address
    planner, made = make_planner(), []

    def fallbacks():
        made.append(4)
        return [planner.fallback_plan(planner.layout(batch(4)), 0)]

    rank0 = PlanClient(address.connect(), replica=0, shares_fallback=True)
    rank1 = PlanClient(address.connect(), replica=0, shares_fallback=False)
    p0, v0 = rank0.fetch(4, fallbacks)
    p1, v1 = rank1.fetch(4, lambda: pytest.fail("only rank 0 plans a late iteration"))
    assert v0 == v1 == INLINE and made == [4]
    assert plan_to_bytes(p0) == plan_to_bytes(p1)
    # Five microbatches on two ranks: Megatron's interleaved order does not apply, the fallback
    # is the quick list schedule (no search, no candidates).
    assert p0.name == "dip" and p0.iteration == 4
    validate_plan(p1)
    assert master.check(["dip/4/inline/began"])
    rank0.cleanup(4, num_replicas=1)
    assert not master.check(["dip/4/inline/0"]) and not master.check(["dip/4/inline/began"])
    # Four microbatches: Megatron's order applies, and that is the fallback.
    four = planner.layout(batch(4, samples=20))
    assert len(four.replicas[0].works) == 4
    assert planner.fallback_plan(four, 0).name == "dip (megatron order)"


def test_a_peer_that_times_out_on_rank_0s_fallback_says_where_rank_0_was(store_address):
    """The fallback is rank 0's alone, so a peer that waits past the store's timeout names
    whether rank 0 had begun that plan (slow or stuck inside it) or not (behind, in an earlier
    step); cleanup removes the marker."""
    address, master = store_address
    quick = StoreAddress(address.host, address.port, timeout_s=0.3)
    rank1 = PlanClient(quick.connect(), replica=0, shares_fallback=False)
    with pytest.raises(RuntimeError, match=r"iteration 6: .*\(it has not begun that plan: it is"):
        rank1.fetch(6, lambda: pytest.fail("only rank 0 plans a late iteration"))
    master.set("dip/7/decision", INLINE)
    master.set("dip/7/inline/began", "1")  # what rank 0 sets before it plans
    with pytest.raises(RuntimeError, match=r"iteration 7: .*\(it began that plan and has not"):
        rank1.fetch(7, lambda: pytest.fail("only rank 0 plans a late iteration"))
    rank1.cleanup(7, num_replicas=1)
    assert not master.check(["dip/7/inline/began"])


def test_the_fallback_fits_the_memory_limit_without_a_simulation():
    """Megatron's order as the fallback, under a limit below what it holds without
    recomputation: a recompute setting is chosen from the order's own activation count (equal
    to the simulator's peaks), and the plan fits in simulation."""
    from megatron_dip.planner.simulator import activation_peaks

    free = make_planner()
    four = free.layout(batch(4, samples=20))
    plain = free.fallback_plan(four, 0)
    cost = free.cost_model
    peaks = activation_peaks(plain, cost)
    assert peaks == simulate(plain, cost).peak_activation_bytes
    limit_gb = 0.7 * max(peaks) / 2**30
    tight = make_planner(memory_gb=limit_gb)
    plan = tight.fallback_plan(tight.layout(batch(4, samples=20)), 0)
    assert plan.name == "dip (megatron order)"
    sim = simulate(plan, cost)
    assert max(sim.peak_activation_bytes) <= limit_gb * 2**30
    assert activation_peaks(plan, cost) == sim.peak_activation_bytes
    modes = {
        i.memory.method for p in plan.programs for i in p.instructions if isinstance(i, Forward)
    }
    assert modes and Recompute.NONE not in modes


# The tiny model's copies last less than its chunks' compute only without the link's latency.
FAST_HOST_LINK = dataclasses.replace(
    get_device("H100"), p2p_latency=0.0, host_link_bandwidth=10**15
)


def test_the_fallback_offloads_where_memory_binds_within_the_host_limit():
    """With offload on, the fallback under the same tight limit may offload (Megatron-Core's
    fine-grained offloading, the same K on every chunk) where that adds less time than
    recomputing (a host link fast enough that the tiny model's copies hide); a host limit
    below one offloaded stage leaves it to recompute instead."""
    from megatron_dip.planner.fallback import offload_peaks
    from megatron_dip.planner.simulator import activation_peaks

    free = make_planner()
    cost = free.cost_model
    limit_gb = 0.7 * max(
        activation_peaks(free.fallback_plan(free.layout(batch(4, samples=20)), 0), cost)
    )
    limit_gb /= 2**30
    plans = {}
    for host in (None, 1.0):
        planner = make_planner(
            memory_gb=limit_gb,
            device=FAST_HOST_LINK,
            offload_activations=True,
            host_memory_limit_bytes=host,
        )
        plans[host] = planner.fallback_plan(planner.layout(batch(4, samples=20)), 0)
        assert plans[host].name == "dip (megatron order)"
        # Priced on the device it was planned for: an offloading stage holds what its copy
        # out has not moved at the forward's end, which a slower host link (`cost`'s) leaves.
        peaks = activation_peaks(plans[host], planner.cost_model)
        assert max(peaks) <= limit_gb * 2**30
    assert max(offload_peaks(plans[None], cost)) > 1.0  # it offloads where nothing bounds it
    assert max(offload_peaks(plans[1.0], cost)) <= 1.0
    modes = {
        i.memory.method
        for p in plans[1.0].programs
        for i in p.instructions
        if isinstance(i, Forward)
    }
    assert modes and Recompute.NONE not in modes


def test_planned_offload_stays_within_the_host_limit():
    """The memory pass offloads no more at once than the host limit allows: with room it
    offloads more than a limit of a quarter of that; under that limit the plan's offloaded
    bytes stay within it, and the plan still fits the device limit."""
    from megatron_dip.planner.fallback import offload_peaks

    free = make_planner().plan_batch(batch(2), search=False)[0]
    cost = make_planner().cost_model
    limit_gb = 0.6 * max(simulate(free.plan, cost).peak_activation_bytes) / 2**30
    roomy = make_planner(memory_gb=limit_gb, device=FAST_HOST_LINK, offload_activations=True)
    wide = max(offload_peaks(roomy.plan_batch(batch(2), search=False)[0].plan, cost))
    assert wide > 0
    tight = make_planner(
        memory_gb=limit_gb,
        device=FAST_HOST_LINK,
        offload_activations=True,
        host_memory_limit_bytes=wide / 4,
    )
    plan = tight.plan_batch(batch(2), search=False)[0].plan
    assert max(offload_peaks(plan, cost)) <= wide / 4
    # The device peak as simulated on the device it was planned for (copy channels and what a
    # copy out has not moved yet included; `cost`'s host link is far slower).
    assert max(simulate(plan, tight.cost_model).peak_activation_bytes) <= limit_gb * 2**30


def test_offload_offers_compete_with_each_other(monkeypatch):
    """With offload, the planner also plans the batch under its other offload offers
    (`offer_planners`: "drained", copies out that end within the forward; "chained", issue
    24g's) and keeps whichever fitting plan simulates faster: never slower than any alone. An
    offer that equals the planner's on every stage is not planned (it plans the same)."""
    from megatron_dip.planner.dip import DipPlanner

    free = make_planner().plan_batch(batch(2), search=False)[0]
    cost = make_planner().cost_model
    limit_gb = 0.6 * max(simulate(free.plan, cost).peak_activation_bytes) / 2**30
    kw = dict(memory_gb=limit_gb, offload_activations=True)
    both = make_planner(**kw)
    others = both.offer_planners()
    assert [p.config.offload_offer for p in others] == ["drained", "chained"]
    assert all(p.offer_planners() == [] for p in others) and both.offer_planners() == others
    alone = make_planner(**kw, offload_offer_candidates=())
    assert alone.offer_planners() == [] and make_planner().offer_planners() == []
    # The tiny model's offers agree on every stage: the candidates are skipped, same plan.
    layout = alone.layout(batch(2))
    works = layout.replicas[0].works
    assert not any(alone.offers_differ(p, works) for p in others)
    plan = alone.plan_batch(batch(2), search=False)[0].plan
    assert both.plan_batch(batch(2), search=False)[0].plan == plan
    # Where they differ, each is planned and the fastest fitting plan kept.
    monkeypatch.setattr(DipPlanner, "offers_differ", lambda self, other, works: True)
    times = [
        simulate(p.plan_batch(batch(2), search=False)[0].plan, both.cost_model).iteration_time
        for p in (both, alone, *others)
    ]
    assert times[0] == min(times)


def _wait_any_ready(store, iteration: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([f"dip/{iteration}/ready"]):
        if time.monotonic() > deadline:
            raise AssertionError(f"planner never published a plan for iteration {iteration}")
        time.sleep(0.02)


def test_planner_process_is_light_and_answers_from_the_second_iteration(store_address):
    """The planner process imports neither torch nor megatron-core (its start-up took longer than
    the first iterations of a run); in a loop like the training's (submit the next two batches,
    fetch this iteration's plan, mark it decided) iteration 0 may be inline, every later one
    comes from the planner process."""
    address, master = store_address
    # The factory as DipPlans builds it (this test module imports torch; the planner must not).
    p = make_planner(rollouts=4)
    factory = functools.partial(DipPlanner, p.model, p.cost_model, p.placement, p.config)
    service = PlannerService(factory, address, lookahead=2)
    rank = _client(address)
    inline = functools.partial(make_planner().plan_batch, search=False)
    variants, submitted = [], set()
    try:
        for it in range(4):
            for ahead in {it, it + 1} - submitted:  # DipPlans.ahead: the next two batches
                service.submit(batch(ahead))
                submitted.add(ahead)
            if it:
                _wait_any_ready(master, it)
            plan, variant = rank.fetch(it, inline=lambda it=it: inline(batch(it))[0].plan)
            service.decided(it)
            assert plan.iteration == it
            variants.append(variant)
        assert INLINE not in variants[1:], variants
        assert rank.inline_count == variants.count(INLINE) <= 1
        startup = service.startup
        assert startup is not None and startup["heavy_modules"] == [], startup
        assert startup["seconds"] > 0 and startup["planner_build_s"] >= 0
    finally:
        service.close()


def test_decision_is_made_once_even_if_a_better_plan_arrives(store_address):
    address, master = store_address
    service = PlannerService(
        functools.partial(make_planner, rollouts=6, sleep_s=1.0), address, lookahead=2
    )
    try:
        service.submit(batch(3))
        _wait_ready(master, 3, GREEDY)
        first = _client(address)
        plan, variant = first.fetch(3, inline=lambda: pytest.fail("greedy was ready"))
        assert variant == GREEDY
        time.sleep(2.5)  # the searched plan would be ready by now, but the iteration is decided
        later, variant2 = _client(address).fetch(3, inline=lambda: pytest.fail("decided"))
        assert variant2 == GREEDY and plan_to_bytes(later) == plan_to_bytes(plan)
    finally:
        service.close()


def test_killed_planner_is_restarted_and_replans_what_is_ahead(store_address):
    address, master = store_address
    service = PlannerService(functools.partial(make_planner, rollouts=4), address, lookahead=2)
    try:
        service.submit(batch(0))
        _wait_ready(master, 0, SEARCHED)
        service.process.kill()
        service.process.join(timeout=10)
        assert service.ensure_alive() is True and service.restarts == 1
        service.submit(batch(1))
        _wait_ready(master, 1, SEARCHED)
        plan, variant = _client(address).fetch(1, inline=lambda: pytest.fail("planner restarted"))
        assert variant == SEARCHED and plan.iteration == 1
    finally:
        service.close()


def _restarted(service, caplog, timeout: float = 60.0) -> str:
    """Call `ensure_alive` (as every iteration does) until the service restarted its planner;
    the warning it logged."""
    deadline = time.monotonic() + timeout
    while service.restarts == 0:
        assert time.monotonic() < deadline, "the unresponsive planner was never restarted"
        service.ensure_alive()
        time.sleep(0.1)
    return next(r.getMessage() for r in caplog.records if "restarting it" in r.getMessage())


@pytest.mark.parametrize("state", ["starting", "idle", "planning"])
def test_a_stopped_planner_is_found_by_its_heartbeat_killed_and_restarted(
    store_address, caplog, state
):
    address, master = store_address
    slow = 3.0 if state == "planning" else 0.0
    factory = functools.partial(make_planner, rollouts=4, sleep_s=slow)
    # A starting planner gets the busy limit for its first heartbeat; a running one, once it
    # beats, the heartbeat timeout (the long busy limit keeps a slow search from counting).
    busy = 3.0 if state == "starting" else 120.0
    service = PlannerService(
        factory, address, timeout_s=2.0, busy_limit_s=busy, startup_limit_s=busy
    )
    try:
        if state == "starting":
            service.start()  # stopped before it could import much
        else:
            service.submit(batch(0))
            if state == "idle":
                _wait_ready(master, 0, SEARCHED)
            else:  # inside its slow first plan
                deadline = time.monotonic() + 60
                while service.startup is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(1.0)
        stopped = service.process
        stopped.stop_signal()
        message = _restarted(service, caplog)
        assert "sent no heartbeat for" in message, message
        assert "killed it; restarting it (restart 1)" in message
        assert not stopped.is_alive() and service.process.is_alive()
    finally:
        service.close()


def test_a_planner_stuck_in_one_plan_is_killed_and_restarted(store_address, caplog):
    """Its heartbeat thread still beats (a Python-level hang): the loop's progress gives it away."""
    address, _ = store_address
    stuck = functools.partial(make_planner, rollouts=4, sleep_s=600.0)
    service = PlannerService(stuck, address, timeout_s=5.0, busy_limit_s=2.0)
    try:
        service.submit(batch(0))
        deadline = time.monotonic() + 60
        while service.startup is None:  # up, so the time lost is the plan's, not the start's
            assert time.monotonic() < deadline, "the planner never started"
            time.sleep(0.05)
        message = _restarted(service, caplog)
        assert "made no progress for" in message and "restart 1" in message
    finally:
        service.close()


def _slow_to_build(seconds: float):
    """A planner factory whose build takes `seconds` (in the planner process)."""
    time.sleep(seconds)
    return make_planner(rollouts=4)


def test_a_planner_slower_to_start_than_the_busy_limit_is_waited_for(store_address, caplog):
    """Start-up (imports, the planner's build, the kernel's compilation on a fresh machine) is
    bounded work with its own limit: a start-up longer than the planning loop's busy limit is
    not killed for it (restarted, it would start from scratch again, and again, under load)."""
    address, master = store_address
    factory = functools.partial(_slow_to_build, 4.0)
    # The heartbeat's own limit is not what this tests: a loaded machine (a cold compiler
    # cache holding the interpreter lock) silenced it for over 1 s once and failed CI.
    service = PlannerService(
        factory, address, timeout_s=10.0, busy_limit_s=1.5, startup_limit_s=120.0
    )
    try:
        service.submit(batch(0))
        deadline = time.monotonic() + 120
        while service.startup is None:
            assert time.monotonic() < deadline, "the planner never started"
            service.ensure_alive()  # as every iteration does
            time.sleep(0.1)
        assert service.restarts == 0, [r.getMessage() for r in caplog.records]
        assert service.startup["planner_build_s"] >= 4.0
        _wait_ready(master, 0, SEARCHED)
        assert service.restarts == 0
    finally:
        service.close()


def test_planner_never_loses_to_megatron_order_on_its_placement():
    """Text-only batches leave nothing to balance: the chosen plan simulates no slower than
    Megatron's interleaved order on the same placement (which the planner also builds)."""
    from megatron_dip.planner.candidates import megatron_order_plan, merge_submicrobatches
    from megatron_dip.schedule.engine import per_peer_channel

    planner = make_planner(rollouts=4)
    metas = generate_meta("text-only", model=tiny_vlm(), num_samples=48, seed=5, scale=0.05)
    batch = BatchMeta(0, tuple(metas))
    chosen = planner.plan_batch(batch)[0]
    works = merge_submicrobatches(planner.model, planner.layout(batch).replicas[0].works)
    sub_of = {s.work: s for w in works for s in w.submicrobatches}
    alt = megatron_order_plan(
        planner.model,
        planner.placement,
        works,
        totals=chosen.plan.totals,
        iteration=0,
        replica=0,
        tensors=functools.partial(planner.message_tensors, sub_of),
        compute_time=lambda r, i: 1e-3,
    )
    assert alt is not None
    validate_plan(alt)
    cost = planner.cost_model
    ours = simulate(chosen.plan, cost, channel=per_peer_channel).iteration_time
    assert ours <= simulate(alt, cost, channel=per_peer_channel).iteration_time + 1e-12
    assert chosen.simulated_time == pytest.approx(ours)
