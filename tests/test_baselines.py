"""Baselines: our 1F1B / interleaved orders against megatron-core's own schedule functions.

The schedule functions of megatron-core run in-process, once per pipeline rank, with a fake
point-to-point communicator (every receive returns a dummy) and `forward_step`/`backward_step`
replaced by recorders. A backward does not say which microbatch it runs, so the fake forward
returns a marker naming (chunk, microbatch) and the fake backward reads the marker it is given
back: that is exactly the pairing megatron's own bookkeeping makes.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_dip import megatron_compat
from megatron_dip.schedule import (
    BatchTotals,
    ChunkSpec,
    Dependency,
    MessageKind,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Recv,
    Send,
    SubMicrobatch,
    WorkId,
    build_1f1b_plan,
    build_interleaved_plan,
    build_megatron_plan,
    dataflow_of,
    execute_programs,
    ideal_timing,
    megatron_1f1b_order,
    megatron_interleaved_order,
    plan_from_bytes,
    plan_to_bytes,
    validate_plan,
)
from megatron_dip.schedule.baselines import megatron_schedule_table

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _FakeP2P(P2PCommunicator):
    """Megatron's P2PCommunicator (its stage properties: `total_stages`, `current_stage`, ...
    on 0.19) whose sends vanish and whose receives return a dummy; no process group needed."""

    def __init__(self, pp_group: _Group, config, vp_size: int | None) -> None:  # no super()
        self.pp_group = pp_group
        self.config = config
        self.virtual_pipeline_model_parallel_size = vp_size

    def _recv(self, *args, **kwargs):
        return "dummy"

    recv_forward = recv_backward = _recv
    send_forward_recv_backward = send_backward_recv_forward = _recv
    send_forward_recv_forward = send_backward_recv_backward = _recv

    def send_forward(self, *args, **kwargs) -> None:
        return None

    send_backward = send_forward

    def send_forward_backward_recv_forward_backward(self, *args, **kwargs):
        return "dummy", "dummy"


class _Chunk(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder


@pytest.fixture
def run_megatron(monkeypatch):
    """Returns run(P, V, M, rank, group=None) -> the (is_forward, chunk, mb) megatron runs."""
    calls: list[tuple[bool, int, int]] = []

    def fake_forward(*args, current_microbatch=None, vp_stage=None, **kwargs):
        chunk = vp_stage or 0
        calls.append((True, chunk, current_microbatch))
        return [("marker", chunk, current_microbatch)], 0

    def fake_backward(input_tensor, output_tensor, output_tensor_grad, *model_type_config):
        # (model_type, config) on megatron-core 0.16, (config,) on 0.19
        _, chunk, mb = output_tensor[0]
        calls.append((False, chunk, mb))

    real_zeros = torch.zeros

    def cpu_zeros(*args, device=None, **kwargs):
        # The schedules allocate their token counter on "cuda"; keep it on the CPU here.
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(schedules, "forward_step", fake_forward)
    monkeypatch.setattr(schedules, "backward_step", fake_backward)
    monkeypatch.setattr(torch, "zeros", cpu_zeros)
    # megatron's is_pp_first_stage reads the group's rank only when torch.distributed is up.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)

    def run(p: int, v: int | None, m: int, rank: int, group: int | None = None, fwd_only=False):
        config = TransformerConfig(
            num_layers=p * (v or 1),
            hidden_size=8,
            num_attention_heads=1,
            pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=v,
            microbatch_group_size_per_vp_stage=group,
            pipeline_dtype=torch.float32,
        )
        pp = _Group(rank, p)
        one = _Group(0, 1)
        pgs = megatron_compat.process_group_collection(
            tp=one, cp=one, embd=None, pos_embd=None, pp=pp, dp_cp=one
        )
        # What megatron dispatches to: no pipelining for P = 1, interleaved iff V is given.
        func = schedules.get_forward_backward_func(p, v)
        chunks = [_Chunk(config) for _ in range(v or 1)]
        calls.clear()
        func(
            forward_step_func=None,
            data_iterator=[None] * len(chunks),
            model=chunks,
            num_microbatches=m,
            seq_length=4,
            micro_batch_size=1,
            p2p_communicator=_FakeP2P(pp, config, v),
            pg_collection=pgs,
            forward_only=fwd_only,
        )
        return list(calls)

    return run


ONE_F_ONE_B = [
    (p, m) for p in range(1, 9) for m in sorted({1, 2, max(1, p - 1), p, p + 1, 2 * p + 3})
]


@pytest.mark.parametrize(("p", "m"), ONE_F_ONE_B)
def test_1f1b_order_equals_megatron(run_megatron, p, m):
    for rank in range(p):
        ours = megatron_1f1b_order(num_ranks=p, num_microbatches=m, rank=rank)
        assert ours == run_megatron(p, None, m, rank), (p, m, rank)


def test_single_rank_runs_no_pipelining():
    """With P = 1 megatron dispatches to forward_backward_no_pipelining, which the P = 1 cases
    above therefore compare against; it rejects model chunks, and so do we."""
    assert schedules.get_forward_backward_func(1, None) is schedules.forward_backward_no_pipelining
    assert schedules.get_forward_backward_func(1, 2) is schedules.forward_backward_no_pipelining
    with pytest.raises(ValueError, match="no_pipelining"):
        megatron_interleaved_order(num_ranks=1, num_model_chunks=2, num_microbatches=4, rank=0)


def _interleaved_cases():
    cases = []
    for p in range(1, 7):
        for v in range(1, 5):
            for m in range(1, 2 * p + 4):
                for g in [None, *sorted({p, p + 1, m})]:
                    cases.append((p, v, m, g))
    return cases


def test_interleaved_order_equals_megatron_and_rejections_agree(run_megatron):
    accepted = rejected = 0
    for p, v, m, g in _interleaved_cases():
        try:
            ours = [
                megatron_interleaved_order(
                    num_ranks=p,
                    num_model_chunks=v,
                    num_microbatches=m,
                    rank=r,
                    microbatch_group_size=g,
                )
                for r in range(p)
            ]
        except ValueError:
            with pytest.raises((ValueError, RuntimeError, AssertionError)):
                run_megatron(p, v, m, 0, g)
            rejected += 1
            continue
        for r in range(p):
            assert ours[r] == run_megatron(p, v, m, r, g), (p, v, m, g, r)
        accepted += 1
    assert accepted > 200 and rejected > 100


def test_rejections_explain_megatron_reasoning():
    with pytest.raises(ValueError, match=r"dependency bubbles"):
        megatron_interleaved_order(num_ranks=4, num_model_chunks=2, num_microbatches=6, rank=0)
    with pytest.raises(ValueError, match=r"must lie in \[PP=4, M=3\]"):
        megatron_interleaved_order(num_ranks=4, num_model_chunks=2, num_microbatches=3, rank=0)
    # 6 = 4 + 2 with group 4 is rejected, but group 6 (one group) is accepted.
    order = megatron_interleaved_order(
        num_ranks=4, num_model_chunks=2, num_microbatches=6, rank=0, microbatch_group_size=6
    )
    assert len(order) == 24
    with pytest.raises(ValueError, match="dependency bubbles"):
        build_interleaved_plan(num_ranks=4, num_model_chunks=2, num_microbatches=6)


def test_schedule_table_matches_megatron_docstring_example():
    # megatron's comment: PP2 N3 M5 VP2 -> microbatch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1
    table = megatron_schedule_table(num_microbatches=5, num_model_chunks=2, microbatch_group_size=3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert table == schedules.get_schedule_table(5, 2, 3)


# ---------------------------------------------------------------------------------------------
# Plans


def _plan_order(plan, rank):
    p = plan.num_ranks
    return [
        (type(i).__name__ == "Forward", i.stage.chunk // p, i.stage.microbatch)
        for i in plan.programs[rank].compute()
    ]


@st.composite
def _interleaved_args(draw):
    """(P, V, M, group) megatron-core accepts: P <= group <= M, M mod group 0 or >= P."""
    p = draw(st.integers(1, 8))
    v = draw(st.integers(1, 4)) if p > 1 else 1
    g = draw(st.integers(p, 2 * p))
    rest = draw(st.sampled_from([0, *range(p, g)]))
    m = g * draw(st.integers(1, 2)) + rest
    return p, v, m, draw(st.sampled_from([None, g])) if g == p else g


@given(_interleaved_args())
def test_interleaved_plans_validate_roundtrip_and_run(args):
    p, v, m, g = args
    plan = build_interleaved_plan(
        num_ranks=p, num_model_chunks=v, num_microbatches=m, microbatch_group_size=g
    )
    validate_plan(plan)
    data = plan_to_bytes(plan)
    again = plan_from_bytes(data)
    assert again == plan and plan_to_bytes(again) == data
    for r in range(p):
        assert _plan_order(plan, r) == megatron_interleaved_order(
            num_ranks=p, num_model_chunks=v, num_microbatches=m, rank=r, microbatch_group_size=g
        )
    result = execute_programs(plan.programs, compute_time=lambda r, i: 1.0)
    assert result.makespan >= 2 * v * m  # every rank computes 2*V*M unit steps
    # With free transfers the inserted communication delays nothing: the plan runs exactly as
    # fast as its compute orders allow.
    ideal = ideal_timing([prog.compute() for prog in plan.programs], dataflow_of(plan))
    assert result.makespan == max(f[-1] for f in ideal.finish)


@given(st.integers(1, 8), st.integers(1, 20))
def test_1f1b_plans_validate_roundtrip_and_run(p, m):
    plan = build_1f1b_plan(num_ranks=p, num_microbatches=m, iteration=7)
    validate_plan(plan)
    assert plan_to_bytes(plan_from_bytes(plan_to_bytes(plan))) == plan_to_bytes(plan)
    for r in range(p):
        assert _plan_order(plan, r) == megatron_1f1b_order(num_ranks=p, num_microbatches=m, rank=r)
    result = execute_programs(plan.programs, compute_time=lambda r, i: 1.0)
    # Unit forward and backward, free messages: 1F1B takes exactly 2 * (M + P - 1) steps.
    assert result.makespan == 2 * (m + p - 1)


def test_pp2_interleaved_keys_stay_distinct():
    """PP=2: the previous and the next rank are the same process; keys keep messages apart."""
    plan = build_interleaved_plan(num_ranks=2, num_model_chunks=3, num_microbatches=4)
    validate_plan(plan)
    for prog in plan.programs:
        ops = [i for i in prog.instructions if isinstance(i, (Send, Recv))]
        assert {i.peer for i in ops} == {1 - prog.rank}
        keys = [(type(i), i.key) for i in ops]
        assert len(keys) == len(set(keys))
        kinds = {(type(i), i.key.kind) for i in ops}
        assert len(kinds) == 4  # activations and gradients both ways on one peer
    # Rank 0 sends activations both to the "next" chunk (1) and receives from the "previous"
    # one (chunk 1 -> 2): same peer, different keys.
    sends = {i.key for i in plan.programs[0].instructions if isinstance(i, Send)}
    recvs = {i.key for i in plan.programs[0].instructions if isinstance(i, Recv)}
    assert not sends & recvs
    assert any(k.kind is MessageKind.ACTIVATION and k.consumer.chunk == 1 for k in sends)
    assert any(k.kind is MessageKind.ACTIVATION and k.consumer.chunk == 2 for k in recvs)


def _llava_stock(p: int, m: int, *, train_vit: bool):
    """Stock Megatron LLaVA: the whole ViT and LLM chunk 0 form rank 0's stage."""
    vit = ModuleLayout("vit", 4, train_vit, (ChunkSpec("vit", 0, 0, 0, 4),))
    llm_chunks = tuple(ChunkSpec("llm", c, c, c, c + 1) for c in range(p))
    placement = Placement(p, (vit, ModuleLayout("llm", p, True, llm_chunks)))
    subs = [SubMicrobatch(mod, i, 0, 0, 2, 10, 10) for i in range(m) for mod in ("vit", "llm")]
    deps = [Dependency(WorkId("vit", i), WorkId("llm", i)) for i in range(m)]
    units = [[[("vit", 0), ("llm", 0)]]] + [[[("llm", r)]] for r in range(1, p)]
    return dict(
        placement=placement,
        stage_units=units,
        submicrobatches=subs,
        dependencies=deps,
        microbatches=[MicrobatchInfo(i, (i,), 10) for i in range(m)],
        totals=BatchTotals(m, m, 10 * m),
        num_model_chunks=1,
    )


@pytest.mark.parametrize("train_vit", [True, False])
def test_stock_llava_plan(train_vit):
    plan = build_megatron_plan(**_llava_stock(3, 5, train_vit=train_vit))
    validate_plan(plan)
    rank0 = [
        (type(i).__name__[0], i.stage.module, i.stage.microbatch)
        for i in plan.programs[0].compute()
    ]
    # Each 1F1B step of rank 0 runs ViT then LLM chunk 0 forward, LLM then ViT backward.
    assert rank0[:4] == [("F", "vit", 0), ("F", "llm", 0), ("F", "vit", 1), ("F", "llm", 1)]
    backward_vit = [x for x in rank0 if x[:2] == ("B", "vit")]
    assert len(backward_vit) == (5 if train_vit else 0)
    first_b = next(i for i, x in enumerate(rank0) if x[0] == "B")
    assert rank0[first_b][1] == "llm"
    # ViT -> LLM is a local hand-over: no message names the ViT.
    for prog in plan.programs:
        for ins in prog.instructions:
            if isinstance(ins, (Send, Recv)):
                assert "vit" not in (ins.key.producer.module, ins.key.consumer.module)


def test_megatron_plan_needs_at_most_one_sub_per_microbatch():
    args = _llava_stock(2, 3, train_vit=True)
    args["submicrobatches"] = args["submicrobatches"] + [SubMicrobatch("vit", 0, 1, 2, 3, 5, 5)]
    with pytest.raises(ValueError, match="at most one"):
        build_megatron_plan(**args)


def test_megatron_plan_skips_modules_without_work():
    # Microbatch 1 is text-only: no ViT sub-microbatch, no ViT stage, no dependency.
    args = _llava_stock(2, 3, train_vit=True)
    args["submicrobatches"] = [
        s for s in args["submicrobatches"] if not (s.module == "vit" and s.microbatch == 1)
    ]
    args["dependencies"] = [d for d in args["dependencies"] if d.producer.microbatch != 1]
    plan = build_megatron_plan(**args)
    validate_plan(plan)
    stages = {i.stage for p in plan.programs for i in p.instructions if hasattr(i, "stage")}
    assert not any(s.module == "vit" and s.microbatch == 1 for s in stages)
    assert any(s.module == "llm" and s.microbatch == 1 for s in stages)


def test_megatron_plan_rejects_misplaced_units():
    args = _llava_stock(2, 3, train_vit=True)
    args["stage_units"] = [[[("llm", 0)]], [[("vit", 0), ("llm", 1)]]]
    with pytest.raises(ValueError, match="placed on another rank"):
        build_megatron_plan(**args)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (
            lambda: megatron_1f1b_order(num_ranks=2, num_microbatches=0, rank=0),
            "at least one microbatch",
        ),
        (
            lambda: megatron_1f1b_order(num_ranks=2, num_microbatches=2, rank=2),
            "rank 2 outside a pipeline of 2",
        ),
        (
            lambda: megatron_interleaved_order(
                num_ranks=2, num_model_chunks=0, num_microbatches=2, rank=0
            ),
            "at least one model chunk",
        ),
    ],
)
def test_order_argument_errors(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            dict(stage_units=[[[("vit", 0), ("llm", 0)]]]),
            "stage_units has 1 ranks, placement has 2",
        ),
        (dict(num_model_chunks=2, interleaved=True), "rank 0 has 1 virtual stages, expected 2"),
        (dict(num_model_chunks=2, interleaved=False), "1F1B runs one model chunk per rank, got 2"),
        (
            dict(stage_units=[[[("vit", 0), ("llm", 0)]], [[("llm", 7)]]]),
            "unit llm7 is not in the placement",
        ),
        (dict(stage_units=[[[("vit", 0), ("vit", 0)]], [[("llm", 1)]]]), "unit vit0 appears twice"),
        (dict(stage_units=[[[("vit", 0)]], [[("llm", 1)]]]), "chunk llm0 is in no virtual stage"),
    ],
)
def test_megatron_plan_argument_errors(change, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        build_megatron_plan(**{**_llava_stock(2, 2, train_vit=True), **change})


@pytest.mark.parametrize(
    ("p", "v", "m"), [(1, None, 3), (3, None, 5), (2, 2, 4), (4, 3, 8), (3, 2, 6)]
)
def test_forward_only_plans_run_megatrons_forward_only_order(run_megatron, p, v, m):
    """Megatron's forward-only order is its training order without the backwards."""
    if v is None:
        plan = build_megatron_plan(**_llava_stock(p, m, train_vit=True), forward_only=True)
    else:
        chunks = tuple(ChunkSpec("model", c, c % p, c, c + 1) for c in range(p * v))
        plan = build_megatron_plan(
            placement=Placement(p, (ModuleLayout("model", p * v, True, chunks),)),
            stage_units=[[[("model", j * p + r)] for j in range(v)] for r in range(p)],
            submicrobatches=[SubMicrobatch("model", i, 0, 0, 1, 1, 1) for i in range(m)],
            dependencies=(),
            microbatches=[MicrobatchInfo(i, (i,), 1) for i in range(m)],
            totals=BatchTotals(m, m, m),
            num_model_chunks=v,
            forward_only=True,
        )
    validate_plan(plan)
    for r in range(p):
        # The LLaVA stage runs two units per step (ViT, LLM chunk 0): keep the LLM's.
        ours = [
            (True, i.stage.chunk // p if v else 0, i.stage.microbatch)
            for i in plan.programs[r].compute()
            if i.stage.module != "vit"
        ]
        assert ours == run_megatron(p, v, m, r, fwd_only=True)
