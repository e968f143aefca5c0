"""The runtime's reliability in one process: timeouts and failures of point-to-point waits name
the rank, instruction, peer, message and tensor; plan verdicts are combined so that every rank
raises; the public per-instruction timing hook. The multi-process behaviour (a stalled rank, one
rank with a bad plan) is in test_runtime_dist.py (`test_runtime_faults.py`)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import test_runtime_setups as st
import torch
import torch.distributed as dist
from test_runtime import _key, _run, _setup

from megatron_dip.models.chunk import ModelGroups
from megatron_dip.runtime.errors import (
    MessageError,
    PipelineCommError,
    PipelineTimeoutError,
    PlanRejectedError,
)
from megatron_dip.runtime.p2p import P2PConfig, PipelineP2P
from megatron_dip.schedule import MessageKey, MessageKind, PlanError, Recv, Send, TensorSpec


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    from megatron_dip.cpu_support import seed_model_parallel_rng

    seed_model_parallel_rng(st.CFG.seed)
    return ModelGroups(tp=single_rank_world, cp=single_rank_world)


class _Work:
    """A stand-in for a posted operation's `Work`: its wait succeeds, raises, or returns False."""

    def __init__(self, error: Exception | None = None, result: bool = True) -> None:
        self.error, self.result, self.timeouts = error, result, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return self.result


HIDDEN_IDX = (TensorSpec("hidden", (4, 1, 8), "float64"), TensorSpec("idx", (2,), "int64"))


def _posted_recv(monkeypatch, works: list[_Work]) -> tuple[PipelineP2P, MessageKey]:
    """A receive of two tensors posted by instruction 7, completed by `works` (one per tensor,
    as gloo gives them)."""
    p2p = PipelineP2P(
        group=dist.group.WORLD, device=torch.device("cpu"), config=P2PConfig(timeout_s=2.5)
    )
    monkeypatch.setattr(p2p, "_start", lambda ops, infos: works)
    key = _key(MessageKind.ACTIVATION, 0, 3)
    p2p.post([(7, Recv(key, 0, HIDDEN_IDX))], {})
    return p2p, key


def test_wait_timeout_names_rank_instruction_peer_message_and_tensor(groups, monkeypatch):
    first = _Work()
    slow = _Work(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 2500ms for recv"))
    p2p, key = _posted_recv(monkeypatch, [first, slow])
    where = "instruction 9 (Wait for 1 message(s))"
    with pytest.raises(PipelineTimeoutError) as err:
        p2p.wait([key], where=where, index=9)
    e = err.value
    assert isinstance(e, MessageError)  # the runtime's error type
    assert (e.rank, e.index, e.peer, e.key, e.tensor) == (0, 9, 0, key, "idx")
    text = str(e)
    assert text.startswith(f"rank 0: {where}: timed out after 2.5 s waiting for the recv of")
    assert f"message {key}, tensor 'idx', from peer rank 0 (posted by instruction 7)" in text
    assert first.timeouts == [timedelta(seconds=2.5)] and slow.timeouts == [timedelta(seconds=2.5)]
    with pytest.raises(PipelineTimeoutError):  # waiting again resumes at the unfinished tensor
        p2p.wait([key], where=where, index=9)
    assert len(first.timeouts) == 1 and len(slow.timeouts) == 2
    with pytest.raises(MessageError, match="used before it was received"):
        p2p.take(key)


def test_failed_and_unfinished_operations_and_failed_posts_are_named(groups, monkeypatch):
    from megatron_dip.runtime import p2p as p2p_mod

    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    p2p, key = _posted_recv(monkeypatch, [_Work(closed), _Work()])
    with pytest.raises(PipelineCommError) as err:
        p2p.finish()
    assert not isinstance(err.value, PipelineTimeoutError) and err.value.index is None
    assert "end of the program" in str(err.value) and "Connection closed by peer" in str(err.value)
    assert err.value.tensor == "hidden"
    p2p, key = _posted_recv(monkeypatch, [_Work(result=False), _Work()])  # reported, not raised
    with pytest.raises(PipelineTimeoutError, match="tensor 'hidden'"):
        p2p.wait([key], where="instruction 3", index=3)

    def gone(ops):
        raise closed

    p2p = PipelineP2P(group=dist.group.WORLD, device=torch.device("cpu"))
    monkeypatch.setattr(p2p_mod.dist, "batch_isend_irecv", gone)
    tensors = {"hidden": torch.zeros(4, 1, 8, dtype=torch.float64), "idx": torch.zeros(2).long()}
    with pytest.raises(PipelineCommError) as err:
        p2p.post([(5, Send(key, 0, HIDDEN_IDX))], {key: tensors})
    assert str(err.value).startswith(
        f"rank 0: instruction 5 (posting a batch): posting the send of message {key}, "
        "tensor 'hidden', to peer rank 0"
    )
    assert (err.value.index, err.value.peer) == (5, 0)
    # NCCL waits are not timed (a timed NCCL wait would block the CPU); the flag is checked.
    cuda = PipelineP2P(
        group=dist.group.WORLD, device=torch.device("cuda"), config=P2PConfig(batched=False)
    )
    assert cuda.timeout_s is None and p2p.timeout_s == P2PConfig().timeout_s
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        P2PConfig(timeout_s=0)


def test_verdicts_are_combined_so_that_every_rank_raises(groups, monkeypatch):
    from megatron_dip.runtime import checks

    reason, ident = checks.decode_verdict(checks.encode_verdict("x" * 2000, "plan #1"))
    assert ident == "plan #1" and reason.startswith("xxx") and len(reason) < 512
    assert checks.decode_verdict(checks.encode_verdict(None, "plan #1")) == (None, "plan #1")
    assert checks._all_gather_rows(b"\x01ab", dist.group.WORLD, torch.device("cpu"), 5.0) == [
        b"\x01ab".ljust(512, b"\0")
    ]  # the real exchange, on the one-rank world
    ok, other = (None, "plan #1"), (None, "plan #2")
    combine = checks.combine_verdicts
    assert combine([ok, ok], same_plan=True, description="pipeline") is None
    assert combine([ok, ("rank 1 says no", "")], same_plan=True, description="x") == (
        "rank 1 says no"
    )
    differ = combine([ok, other], same_plan=True, description="pipeline")
    assert "pipeline ranks hold different plans" in differ and "rank 1 holds 'plan #2'" in differ
    assert combine([ok, other], same_plan=False, description="data-parallel") is None

    class TwoRanks:  # a stand-in group: only its size is read before the (patched) exchange
        def size(self) -> int:
            return 2

    peer = "pipeline rank 1 rejected the plan (global rank 1): PlanError: bad shapes"
    rows = lambda row, group, device, timeout: [row, checks.encode_verdict(peer, "")]  # noqa: E731
    monkeypatch.setattr(checks, "_all_gather_rows", rows)
    agree = dict(rank=0, groups=[("pipeline", TwoRanks(), True)], device=torch.device("cpu"))
    with pytest.raises(PlanRejectedError, match=r"^rank 0: pipeline rank 1 rejected the plan .*"):
        checks.agree_on_plan(error=None, identity="plan #1", timeout_s=1.0, **agree)
    own = PlanError("mine")
    with pytest.raises(PlanError) as err:
        checks.agree_on_plan(error=own, identity="", timeout_s=1.0, **agree)
    assert err.value is own  # the rejecting rank raises its own error


def test_timing_hook_reports_every_instruction_once_in_order(groups):
    batch, placement, plan = _setup("vlm")
    chunks = st.rank_chunks(batch, placement, groups)
    seen: list[tuple] = []
    before = time.time()
    _run(
        batch,
        placement,
        plan,
        chunks,
        on_instruction=lambda i, ins, start, end: seen.append((i, ins, start, end)),
    )
    after = time.time()
    program = plan.program(0).instructions
    assert [i for i, *_ in seen] == list(range(len(program)))
    assert all(ins is program[i] for i, ins, *_ in seen)
    assert all(before <= start <= end <= after for *_, start, end in seen)
    starts = [start for *_, start, _ in seen]
    assert starts == sorted(starts)
    assert sum(end - start for *_, start, end in seen) > 0
