"""The runtime in one process: handlers, message checks, recompute, loss modes, the drop-in.

A world-size-1 gloo group stands in for the pipeline group (all chunks on rank 0: every message
is a local hand-over), fp64 tiny models; the multi-process behaviour is in test_runtime_dist.py.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import test_runtime_setups as st
import torch
import torch.distributed as dist

from megatron_dip.modalities import build_chunk
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.init import global_param_name
from megatron_dip.parallel import ParallelShape
from megatron_dip.reference import reference_loss_and_grads
from megatron_dip.runtime import executor as executor_mod
from megatron_dip.runtime.data import SampleBatchSource
from megatron_dip.runtime.executor import ExecutorConfig, check_handlers
from megatron_dip.runtime.gradsync import grad_sync_points
from megatron_dip.runtime.loss import (
    LossConfig,
    LossTracker,
    loss_weight,
    megatron_loss_func,
    microbatch_mean_scale,
    per_token_scale,
)
from megatron_dip.runtime.p2p import MessageError, PipelineP2P
from megatron_dip.runtime.recompute import run_chunk, run_policy
from megatron_dip.runtime.stock import pack_message, unpack_message
from megatron_dip.schedule import (
    Backward,
    BatchTotals,
    ChunkSpec,
    Forward,
    MemoryPolicy,
    MessageKey,
    MessageKind,
    ModuleLayout,
    Placement,
    PlanError,
    Program,
    Recompute,
    Send,
    StageId,
    TensorSpec,
    Wait,
    build_segment_plan,
)

SIZES = {"vlm": {"vit": 2}, "t2v": {"text": 2, "dit": 2}}


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    world = single_rank_world
    from megatron_dip.cpu_support import seed_model_parallel_rng

    seed_model_parallel_rng(st.CFG.seed)
    return ModelGroups(tp=world, cp=world)


def _setup(kind: str, *, segments: int = 2, forward_only: bool = False):
    mbs = st.group_samples(st.samples(kind, 10), [3, 2, 3, 2])
    batch = st.make_batch(kind, mbs, sizes=SIZES[kind])
    placement = st.dip_placement(batch.model, 1, {m.name: segments for m in batch.model.modules})
    plan = build_segment_plan(
        placement=placement,
        microbatches=batch.infos,
        submicrobatches=batch.subs,
        dependencies=batch.deps,
        totals=batch.totals,
        tensors=batch.tensor_fn(),
        forward_only=forward_only,
    )
    return batch, placement, plan


def _run(batch, placement, plan, chunks, **runtime_options):
    runtime = st.rank_runtime(
        batch, placement, chunks, pp_group=dist.group.WORLD, **runtime_options
    )
    return runtime.run(plan, batch.by_index)


def _grads(chunks) -> dict[str, torch.Tensor]:
    return {
        global_param_name(c, n): p.grad
        for c in chunks
        for n, p in c.named_parameters()
        if p.grad is not None
    }


def _reference(batch, groups, **kw):
    return reference_loss_and_grads(
        batch.model,
        [list(mb) for mb in batch.microbatches],
        seed=st.SEED,
        seq_length=st.SEQ,
        groups=groups,
        config=st.CFG,
        **kw,
    )


# -- handlers and messages ------------------------------------------------------------------------


def test_every_instruction_type_has_a_handler():
    check_handlers()
    with pytest.raises(TypeError, match="Wait"):
        check_handlers({t: h for t, h in executor_mod._HANDLERS.items() if t is not Wait})


def _key(kind: MessageKind, chunk: int, mb: int) -> MessageKey:
    return MessageKey(kind, StageId("m", chunk, mb), StageId("m", chunk + 1, mb))


def test_runtime_refuses_crossed_channel_order_even_without_validation():
    """The runtime's pre-run checks use `schedule.validate.check_channel_order` (no own copy)."""
    from test_validate import crossed_sends_plan

    from megatron_dip.runtime.checks import check_before_run

    plan = crossed_sends_plan()
    chunk = torch.nn.Module()
    chunk.chunk = plan.placement.chunks_on_rank(1)[0]
    with pytest.raises(PlanError, match=r"channel rank 0 -> rank 1: message 0 .* act:model0\[mb0"):
        check_before_run(
            plan=plan,
            placement=plan.placement,
            rank=1,
            num_ranks=2,
            chunks={("model", 1): chunk},
            tensor_fn=None,
            validate=False,
        )


def test_runtime_refuses_a_plan_posted_for_per_peer_streams_on_one_stream():
    """A plan whose receives are posted ahead (`Channels.PER_PEER`) may deadlock where every
    message of a rank shares one stream: refused before anything is posted, with the remedy."""
    from megatron_dip.runtime.checks import check_streams
    from megatron_dip.schedule import Channels, build_1f1b_plan
    from megatron_dip.schedule.engine import per_peer_channel, single_channel

    plan = build_1f1b_plan(num_ranks=2, num_microbatches=2)
    check_streams(plan, single_channel)  # posted for one stream: runs on either
    check_streams(plan, per_peer_channel)
    ahead = dataclasses.replace(plan, channels=Channels.PER_PEER)
    check_streams(ahead, per_peer_channel)
    with pytest.raises(PlanError, match=r"posts its receives ahead.*--dip-receive-lead 0"):
        check_streams(ahead, single_channel)
    # Without messages (one pipeline rank) there is nothing to deadlock on.
    lone = build_1f1b_plan(num_ranks=1, num_microbatches=2)
    check_streams(dataclasses.replace(lone, channels=Channels.PER_PEER), single_channel)


def test_outgoing_tensors_are_checked_before_anything_is_posted(groups):
    p2p = PipelineP2P(group=dist.group.WORLD, device=torch.device("cpu"))
    key = _key(MessageKind.ACTIVATION, 0, 3)
    spec = (TensorSpec("hidden", (4, 1, 8), "float64"), TensorSpec("idx", (2,), "int64"))
    send = Send(key, 0, spec)
    bad = {
        "hidden": torch.zeros(4, 1, 9, dtype=torch.float64),
        "idx": torch.zeros(2, dtype=torch.int64),
    }
    with pytest.raises(MessageError) as err:
        p2p.post([(7, send)], {key: bad})
    text = str(err.value)
    assert "rank 0: instruction 7" in text and str(key) in text and "'hidden'" in text
    assert "(4, 1, 9)" in text and "(4, 1, 8)" in text
    wrong_dtype = {**bad, "hidden": torch.zeros(4, 1, 8, dtype=torch.float32)}
    with pytest.raises(MessageError, match="float32"):
        p2p.post([(7, send)], {key: wrong_dtype})
    with pytest.raises(MessageError, match="has not been produced"):
        p2p.post([(8, send)], {})
    assert p2p.messages_posted == 0


def test_packed_stock_messages_round_trip_with_gradients():
    specs = (
        TensorSpec("hidden", (3, 1, 4), "float64"),
        TensorSpec("temb", (2, 4), "float64"),
        TensorSpec("cond_index", (2,), "int64"),
    )
    hidden = torch.randn(3, 1, 4, dtype=torch.float64, requires_grad=True)
    temb = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([5, 1])
    flat = pack_message(
        {"hidden": hidden, "temb": temb, "cond_index": index}, specs, length=30, dtype=torch.float64
    )
    assert flat.shape == (30, 1, 1)
    back = unpack_message(flat, specs)
    assert torch.equal(back["hidden"], hidden) and torch.equal(back["cond_index"], index)
    (back["hidden"].sum() + 2 * back["temb"].sum()).backward()
    assert torch.equal(hidden.grad, torch.ones_like(hidden))
    assert torch.equal(temb.grad, 2 * torch.ones_like(temb))


def test_grad_sync_points_follow_last_backwards_in_canonical_order():
    def layout(name: str) -> ModuleLayout:
        return ModuleLayout(
            name, 2, True, (ChunkSpec(name, 0, 0, 0, 1), ChunkSpec(name, 1, 0, 1, 2))
        )

    placement = Placement(1, (layout("vit"), layout("llm")))
    order = [("llm", 1), ("vit", 1), ("llm", 0), ("vit", 0), ("llm", 1), ("vit", 1), ("llm", 0)]
    program = Program(0, tuple(Backward(StageId(m, c, 0)) for m, c in order))
    points = grad_sync_points(program, placement, {("llm", 0), ("llm", 1), ("vit", 0), ("vit", 1)})
    # llm1 last at 4; llm0 last at 6; vit1 last at 5 but after llm0 in the order; vit0 at 3.
    assert points == {4: [("llm", 1)], 6: [("llm", 0), ("vit", 1), ("vit", 0)]}
    assert grad_sync_points(program, placement, {("vit", 0)}) == {3: [("vit", 0)]}


def test_loss_weight_formulas():
    totals = BatchTotals(
        num_microbatches=4, num_samples=9, num_loss_tokens=100, data_parallel_size=2
    )
    w = loss_weight(totals=totals, microbatch_tokens=10, per_token=False, reduction_averages=True)
    assert w == pytest.approx(2 / (4 * 10))
    w = loss_weight(totals=totals, microbatch_tokens=10, per_token=True, reduction_averages=False)
    assert w == pytest.approx(1 / 100)
    assert (
        loss_weight(totals=totals, microbatch_tokens=0, per_token=False, reduction_averages=False)
        == 0.25
    )


@pytest.mark.parametrize("per_token", [False, True])
def test_stock_and_dip_share_one_normalisation(per_token):
    """What Megatron-Core's schedules make of the stock path's loss function
    (`forward_step_calc_loss`) is the loss sum times `microbatch_mean_scale`, the per-microbatch
    factor of DIP's `loss_weight`; with a per-token loss it leaves the sum, which both paths
    scale by `per_token_scale` of the global batch's tokens (DIP before the backward, stock
    after the schedule)."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    loss_sum, tokens, m = torch.tensor(7.5, dtype=torch.float64), torch.tensor(12), 4
    reports: list = []
    out, num_tokens = forward_step_calc_loss(
        None, loss_sum.clone(), functools.partial(megatron_loss_func, tokens, "lm loss"),
        SimpleNamespace(calculate_per_token_loss=per_token, timers=None), None, False, m,
        reports, cp_group_size=1, is_last_stage=True,
    )  # fmt: skip
    assert int(num_tokens) == 12
    assert reports[0]["lm loss"].tolist() == [7.5, 12.0]  # the report DIP's LossTracker gives
    totals = BatchTotals(num_microbatches=m, num_samples=9, num_loss_tokens=100)
    dip = loss_weight(
        totals=totals, microbatch_tokens=12, per_token=per_token, reduction_averages=True
    )
    if per_token:
        assert float(out) == 7.5 and dip == per_token_scale(100) == 1 / 100
    else:
        assert float(out) == pytest.approx(7.5 * microbatch_mean_scale(m, 12), rel=1e-15)
        assert dip == microbatch_mean_scale(m, 12)


def test_loss_reports_stay_on_the_device_of_the_loss():
    """Megatron reduces the reports where the loss is (NCCL on a GPU): the token count joins
    the loss sum on its device. (On a GPU the report once stacked a CUDA sum with a CPU count;
    the meta device stands in for it here.)"""
    from types import SimpleNamespace

    work = SimpleNamespace(module="llm", microbatch=0)
    plan = SimpleNamespace(
        dependencies=[],
        submicrobatches=[SimpleNamespace(module="llm", microbatch=0, work=work)],
        placement=SimpleNamespace(modules=[SimpleNamespace(name="llm")]),
        totals=BatchTotals(num_microbatches=1, num_samples=2, num_loss_tokens=12),
    )
    batches = SimpleNamespace(loss_tokens=lambda w: 12)
    tracker = LossTracker(
        plan=plan, batches=batches, config=LossConfig(per_token=True), reduction_averages=True
    )
    stage = StageId("llm", 0, 0)
    loss = torch.tensor(7.5, dtype=torch.float32)
    tracker.weighted(stage, {"loss": loss, "num_tokens": 12}, where="test")
    assert tracker.reports()[0]["lm loss"].tolist() == [7.5, 12.0]
    tracker = LossTracker(
        plan=plan, batches=batches, config=LossConfig(per_token=True), reduction_averages=True
    )
    tracker._sums[0] = [loss.to("meta").double(), 12]  # what `weighted` keeps, on a device
    (report,) = tracker.reports()
    assert report["lm loss"].device.type == "meta" and report["lm loss"].shape == (2,)


# -- executor on real chunks ----------------------------------------------------------------------


def test_plan_for_other_chunks_is_refused_before_running(groups):
    batch, placement, plan = _setup("vlm")
    chunks = st.rank_chunks(batch, placement, groups)
    with pytest.raises(PlanError, match="was not built"):
        _run(batch, placement, plan, chunks[1:])
    wrong = ChunkSpec("vit", 0, 0, 0, 3)
    built = build_chunk(batch.model, wrong, num_chunks=2, config=st.CFG, groups=groups)
    with pytest.raises(PlanError, match=r"built for layers \[0, 3\)"):
        _run(batch, placement, plan, [built, *chunks[1:]])


@pytest.mark.parametrize("mode", [Recompute.SELECTIVE, Recompute.FULL])
def test_recompute_keeps_less_and_gives_the_same_gradients(groups, mode):
    """Bytes saved for backward during one chunk forward: NONE > SELECTIVE > FULL; the
    gradients are identical, and FULL re-runs the chunk's layers in backward."""
    batch, placement, plan = _setup("vlm", segments=1)
    spec = placement.module("llm").chunks[0]
    chunk = build_chunk(batch.model, spec, num_chunks=1, config=st.CFG, groups=groups)
    source = SampleBatchSource(
        model=batch.model, plan=plan, samples=batch.by_index, seq_length=st.SEQ, seed=st.SEED
    )
    sub = next(s for s in batch.subs if s.module == "llm" and s.microbatch == 0)
    images = sum(1 for s in batch.subs if s.module == "vit" and s.microbatch == 0)
    rows = source.sub_batch(sub.work).tensors["vit.positions"].numel()
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(rows, 32, generator=gen, dtype=torch.float64)
    assert images > 0 and rows > 0

    def once(m: Recompute):
        chunk.zero_grad(set_to_none=True)
        saved, calls = [0], [0]
        hook = chunk.layers[0].register_forward_pre_hook(
            lambda *a: calls.__setitem__(0, calls[0] + 1)
        )

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        inp = [{"vit.embeddings": emb.clone().requires_grad_(True)}]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_chunk(chunk, m, chunk, inp, source.sub_batch(sub.work))
        out["loss"].backward()
        hook.remove()
        grads = {n: p.grad.clone() for n, p in chunk.named_parameters()}
        return saved[0], calls[0], grads, inp[0]["vit.embeddings"].grad

    base = once(Recompute.NONE)
    got = once(mode)
    assert got[0] < base[0]
    if mode is Recompute.FULL:
        assert got[1] == 2 and base[1] == 1
        assert got[0] < once(Recompute.SELECTIVE)[0]
    for name, g in base[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-12, atol=1e-15, msg=name)
    torch.testing.assert_close(got[3], base[3], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "policy",
    [MemoryPolicy(Recompute.NONE, 0, 2), MemoryPolicy(Recompute.BLOCK, 1, 1)],
    ids=lambda p: p.label,
)
def test_offload_keeps_less_on_the_device_and_gives_the_same_gradients(groups, policy):
    """Offloaded layers' saved tensors leave autograd's device bytes (they go to the host
    record, in its count) and come back for the backward: identical gradients, prefetched or
    reloaded on demand, a layer at a time; parameters and the received leaf are never
    offloaded."""
    batch, placement, plan = _setup("vlm", segments=1)
    spec = placement.module("llm").chunks[0]
    chunk = build_chunk(batch.model, spec, num_chunks=1, config=st.CFG, groups=groups)
    source = SampleBatchSource(
        model=batch.model, plan=plan, samples=batch.by_index, seq_length=st.SEQ, seed=st.SEED
    )
    sub = next(s for s in batch.subs if s.module == "llm" and s.microbatch == 0)
    rows = source.sub_batch(sub.work).tensors["vit.positions"].numel()
    emb = torch.randn(rows, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def once(p: MemoryPolicy, prefetch: bool = False):
        chunk.zero_grad(set_to_none=True)
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        inp = [{"vit.embeddings": emb.clone().requires_grad_(True)}]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, record = run_policy(chunk, p, chunk, inp, source.sub_batch(sub.work))
        if record is not None and prefetch:
            record.prefetch()  # the last offloaded layer only: the others as backward goes
            back = {slot.layer for slot in record.slots if slot.reloaded is not None}
            assert back == {record.layers - 1} and record.layers == p.offload
        out["loss"].backward()
        grads = {n: q.grad.clone() for n, q in chunk.named_parameters()}
        return saved[0], record, grads, inp[0]["vit.embeddings"].grad

    base = once(MemoryPolicy())
    recomputed = once(MemoryPolicy(policy.method, policy.layers))
    for prefetch in (False, True):
        got = once(policy, prefetch)
        record = got[1]
        assert record is not None and record.slots and record.offloaded_bytes > 0
        assert got[0] < recomputed[0]
        assert got[0] + record.offloaded_bytes >= recomputed[0]
        assert all(slot.reloaded is not None for slot in record.slots)
        for name, g in base[2].items():
            torch.testing.assert_close(got[2][name], g, rtol=1e-12, atol=1e-15, msg=name)
        torch.testing.assert_close(got[3], base[3], rtol=1e-12, atol=1e-15)


MODULE_POLICIES = tuple(
    MemoryPolicy(method, n, 0, mods)
    for mods in (("layernorm",), ("mlp_act",), ("layernorm", "mlp_act"))
    for method, n in ((Recompute.NONE, 0), (Recompute.SELECTIVE, 0), (Recompute.BLOCK, 1))
)


@pytest.mark.parametrize("kind", ["vlm", "t2v"])
def test_module_recompute_plans_give_the_same_gradients_bit_for_bit(groups, kind):
    """Cheap module recomputation (`MemoryPolicy.modules`: the norms' and the MLP activation's
    outputs, recomputed in backward from inputs autograd keeps anyway), alone and with
    selective and block recomputation, on every layer kind (Megatron's GPT layer with
    LayerNorm / RMSNorm, GELU / SwiGLU; the DiT layer), fused and split
    backwards: the plan's loss and gradients are those of the plan without it, bit for bit
    (the recomputed outputs are the same kernels on the same inputs), and the reference's."""
    batch, placement, plan = _setup(kind)

    def policy(ins: Forward) -> MemoryPolicy:
        s = ins.stage
        return MODULE_POLICIES[(s.chunk + 2 * s.microbatch + s.sub) % len(MODULE_POLICIES)]

    loss, ref = _reference(batch, groups)
    runs = {}
    for name, p in (("plain", plan), ("modules", st.with_recompute(plan, policy))):
        for split in (False, True):
            chunks = st.rank_chunks(batch, placement, groups)
            result = _run(batch, placement, st.split_plan(p) if split else p, chunks)
            assert result.objective == pytest.approx(loss, rel=1e-12)
            runs[(name, split)] = (result.objective, _grads(chunks))
    for split in (False, True):
        plain, modules = runs[("plain", split)], runs[("modules", split)]
        assert modules[0] == plain[0] and modules[1].keys() == plain[1].keys() == ref.keys()
        for name, g in plain[1].items():
            assert torch.equal(modules[1][name], g), (split, name)
            r = ref[name]
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12 * float(r.abs().max()))


@pytest.mark.parametrize("kind", ["vlm", "t2v"])
def test_per_token_loss_matches_reference(groups, kind):
    batch, placement, plan = _setup(kind)
    chunks = st.rank_chunks(batch, placement, groups)
    config = ExecutorConfig(loss=LossConfig(per_token=True), debug=True)
    result = _run(batch, placement, plan, chunks, config=config)
    loss, ref = _reference(batch, groups, per_token_loss=True)
    assert result.objective == pytest.approx(loss, rel=1e-12)
    got = _grads(chunks)
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12 * float(g.abs().max()))
    assert not any(result.leftovers.values())
    tokens = sum(float(r["lm loss"][1]) for r in result.reports)
    assert tokens == batch.totals.num_loss_tokens


def test_forward_only_plan_reports_losses_and_keeps_nothing(groups):
    batch, placement, plan = _setup("vlm", forward_only=True)
    chunks = st.rank_chunks(batch, placement, groups)
    result = _run(batch, placement, plan, chunks)
    assert all(p.grad is None for c in chunks for p in c.parameters())
    loss, _ = _reference(batch, groups)
    assert result.objective == pytest.approx(loss, rel=1e-12)
    assert len(result.reports) == len(batch.infos)
    assert not any(result.leftovers.values())


def test_drop_in_installed_into_megatron_runs_the_plan(groups):
    """`install` makes Megatron's own `get_forward_backward_func()` return the DIP drop-in;
    called with Megatron's schedule arguments it runs the plan; `uninstall` restores."""
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    from megatron_dip.runtime.forward_backward import DipSchedule, installed

    original = schedules.get_forward_backward_func
    batch, placement, plan = _setup("t2v")
    chunks = st.rank_chunks(batch, placement, groups)
    schedule = DipSchedule(
        model=batch.model,
        placement=placement,
        pp_group=dist.group.WORLD,
        seed=st.SEED,
        plan_provider=lambda: plan,
        shape=ParallelShape(dtype=st.CFG.dtype),
    )
    with installed(schedule):
        func = pipeline_parallel.get_forward_backward_func()
        assert schedules.get_forward_backward_func(pp_size=4, vp_size=2) is not original
        with pytest.raises(ValueError, match="num_microbatches=3"):
            func(
                forward_step_func=None,
                data_iterator=iter(batch.microbatches),
                model=chunks,
                num_microbatches=3,
                seq_length=st.SEQ,
                micro_batch_size=1,
            )
        reports = func(
            forward_step_func=None,
            data_iterator=iter(batch.microbatches),
            model=chunks,
            num_microbatches=len(batch.infos),
            seq_length=st.SEQ,
            micro_batch_size=1,
        )
    assert schedules.get_forward_backward_func is original
    assert pipeline_parallel.get_forward_backward_func is original
    loss, ref = _reference(batch, groups)
    per_mb = [float(r["lm loss"][0]) / float(r["lm loss"][1]) for r in reports]
    assert np.mean(per_mb) == pytest.approx(loss, rel=1e-12)
    got = _grads(chunks)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12 * float(g.abs().max()))


def test_microbatch_without_images_and_frozen_text_encoder(groups):
    """A VLM microbatch whose samples have no image (no ViT work, no LLM producer) and a
    text-to-video model whose frozen text encoder runs forward only."""
    vlm = st.samples("vlm", 10, start=10)
    no_images = [vlm[2], vlm[7]]  # samples 12 and 17
    assert not any(s.media.get("vit") for s in no_images)
    cases = [
        st.make_batch("vlm", [no_images, list(vlm[:2])], sizes=SIZES["vlm"]),
        st.make_batch(
            "t2v-frozen", st.group_samples(st.samples("t2v", 5), [3, 2]), sizes=SIZES["t2v"]
        ),
    ]
    for batch in cases:
        placement = st.dip_placement(batch.model, 1, {m.name: 2 for m in batch.model.modules})
        plan = st.segment_plan(batch, placement)
        chunks = st.rank_chunks(batch, placement, groups)
        result = _run(batch, placement, plan, chunks)
        loss, ref = _reference(batch, groups)
        assert result.objective == pytest.approx(loss, rel=1e-12)
        got = _grads(chunks)
        assert got.keys() == ref.keys()
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12 * float(g.abs().max()))
        assert not any(result.leftovers.values())
    frozen = [c for c in chunks if c.chunk.module == "text"]
    assert frozen and all(p.grad is None for c in frozen for p in c.parameters())


def _coarser_plan(batch, placement, configured: dict[str, int]):
    """The planner's plan of `batch` at `configured` sizes or at twice them (`sub_size_scales`)."""
    from megatron_dip.batching import BatchLayout, ReplicaLayout, split_microbatch
    from megatron_dip.planner.config import PlannerConfig
    from megatron_dip.planner.cost_model import CostModel
    from megatron_dip.planner.devices import get_device
    from megatron_dip.planner.dip import DipPlanner

    model = batch.model
    metas = tuple(tuple(st.sample_meta(model, s) for s in mb) for mb in batch.microbatches)
    works = tuple(
        split_microbatch(model, list(mb), index=i, seq_length=st.SEQ, sub_sizes=configured)
        for i, mb in enumerate(metas)
    )
    config = PlannerConfig(
        shape=ParallelShape(dtype=st.CFG.dtype, seq_length=st.SEQ),
        sub_sizes=configured,
        sub_size_scales=(2,),
        use_search=False,
        megatron_candidate=False,
    )
    cost = CostModel(model, get_device("h100"), dtype_bytes=8)
    planner = DipPlanner(model, cost, placement, config)
    layout = BatchLayout(0, (ReplicaLayout(0, metas, works),), batch.totals)
    return planner.plan_layout(layout, 0).plan


def test_runtime_runs_the_coarser_cut_the_planner_chose(groups):
    """The planner cut this batch's ViT work at twice the configured size (its simulation is
    faster): the runtime takes each sub-microbatch's instances from the plan, and the plan's
    loss and gradients are the reference's."""
    mbs = st.group_samples(st.samples("vlm", 10), [3, 2, 3, 2])
    batch = st.make_batch("vlm", mbs, sizes={"vit": 1})
    placement = st.dip_placement(batch.model, 1, {m.name: 2 for m in batch.model.modules})
    plan = _coarser_plan(batch, placement, {"vit": 1})
    vit = [s.num_instances for s in plan.submicrobatches if s.module == "vit"]
    assert max(vit) == 2 and len(vit) < sum(1 for s in batch.subs if s.module == "vit")
    chunks = st.rank_chunks(batch, placement, groups)
    result = _run(batch, placement, plan, chunks, config=ExecutorConfig(debug=True))
    loss, ref = _reference(batch, groups)
    assert result.objective == pytest.approx(loss, rel=1e-12)
    got = _grads(chunks)
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12 * float(g.abs().max()))
    assert not any(result.leftovers.values())


def test_stock_no_pipelining_on_our_chunks_matches_reference(groups):
    """One rank: Megatron's `forward_backward_no_pipelining` through the stock adapter."""
    from megatron_dip.runtime.stock import StockPipeline
    from megatron_dip.schedule import Dataflow

    batch = st.make_batch("t2v", st.group_samples(st.samples("t2v", 10), [3, 2, 3, 2]))
    placement, units = st.stock_placement(batch.model, 1, vp=1)
    chunks = st.rank_chunks(batch, placement, groups)
    source = SampleBatchSource(
        model=batch.model,
        plan=st.segment_plan(batch, placement),
        samples=batch.by_index,
        seq_length=st.SEQ,
        seed=st.SEED,
    )
    reports = StockPipeline(
        chunks=chunks,
        all_stage_units=units,
        dataflow=Dataflow(placement, batch.subs, batch.deps),
        microbatches=[i.index for i in batch.infos],
        batches=source,
        tensor_fn=batch.tensor_fn(),
        pp_group=dist.group.WORLD,
        single_group=dist.group.WORLD,
    ).run()
    loss, ref = _reference(batch, groups)
    per_mb = [float(r["lm loss"][0]) / float(r["lm loss"][1]) for r in reports]
    assert np.mean(per_mb) == pytest.approx(loss, rel=1e-12)
    got = _grads(chunks)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12 * float(g.abs().max()))
