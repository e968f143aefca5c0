"""How the runtime is assembled, in one process: the transport interface (another backend is one
class) and `RankRuntime`. (The drop-in, installed into Megatron-Core and called as Megatron-LM
does, is tested on gloo ranks: `test_runtime_dist.py`.)

`MemoryTransport` below is a whole second transport backend: the messages of a 2-rank plan
travel between two threads, each running one rank's `RankRuntime`, and the gradients are the
single-process reference's. The plan verdict's all-gather is the one piece of torch.distributed
left, replaced by an exchange between the threads.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_runtime_setups as st
import torch
import torch.distributed as dist
from test_runtime import _grads, _reference

from megatron_dip.modalities import build_chunk
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.runtime import checks
from megatron_dip.runtime.errors import MessageError, PipelineTimeoutError
from megatron_dip.runtime.p2p import ChannelGroups, PipelineP2P, check_message
from megatron_dip.runtime.transport import Outgoing, Transport
from megatron_dip.schedule import MessageKey, Recv, Send
from megatron_dip.schedule.engine import per_peer_channel, single_channel


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    from megatron_dip.cpu_support import seed_model_parallel_rng

    seed_model_parallel_rng(st.CFG.seed)
    return ModelGroups(tp=single_rank_world, cp=single_rank_world)


class MemoryTransport:
    """A `Transport` between the threads of one process: one FIFO per (sender, receiver) pair
    of `wire`. A send completes at once (its tensors are copied); waiting for a receive takes
    the pair's messages in order, each of which must be a receive this rank posted. The class
    (with `wire` and `rank` bound) is its own `TransportFactory`: the other fixed parts a
    `RankRuntime` passes (group, device, config, channels) are of no use here."""

    def __init__(self, wire: dict, *, rank: int, timeout_s: float = 30.0, **unused) -> None:
        del unused
        self.wire, self.rank, self.timeout_s = wire, rank, timeout_s
        self.messages_posted = 0
        self._posted: dict[MessageKey, Recv] = {}
        self._received: dict[MessageKey, dict[str, torch.Tensor]] = {}

    @property
    def channel(self):
        return per_peer_channel

    def post(self, ops: Sequence[tuple[int, Send | Recv]], outgoing: Outgoing) -> None:
        for index, op in ops:
            if isinstance(op, Recv):
                self._posted[op.key] = op
                continue
            if op.key not in outgoing:
                raise MessageError(f"rank {self.rank}: instruction {index}: {op.key} not produced")
            tensors = outgoing[op.key]
            check_message(tensors, op.tensors, where=f"rank {self.rank}", key=op.key)
            copy = {name: t.clone() for name, t in tensors.items()}
            self.wire[(self.rank, op.peer)].put((op.key, copy))
        self.messages_posted += len(ops)

    def wait(
        self, keys: Iterable[MessageKey], *, where: str = "", index: int | None = None
    ) -> None:
        for key in keys:
            while key in self._posted:  # sends are complete already
                self._arrive(self._posted[key].peer, where, index)

    def _arrive(self, peer: int, where: str, index: int | None) -> None:
        try:
            key, tensors = self.wire[(peer, self.rank)].get(timeout=self.timeout_s)
        except queue.Empty:
            raise PipelineTimeoutError(
                f"rank {self.rank}: {where}: nothing from rank {peer}",
                rank=self.rank,
                index=index,
                peer=peer,
                key=None,
                tensor=None,
            ) from None
        op = self._posted.pop(key, None)
        if op is None:
            raise MessageError(f"rank {self.rank}: {key} arrived before its receive was posted")
        check_message(tensors, op.tensors, where=f"rank {self.rank}: {where}", key=key)
        self._received[key] = tensors

    def take(self, key: MessageKey) -> dict[str, torch.Tensor]:
        if key not in self._received:
            raise MessageError(f"rank {self.rank}: {key} used before it was received")
        return self._received.pop(key)

    def finish(self) -> None:
        while self._posted:
            self._arrive(next(iter(self._posted.values())).peer, "end of the program", None)

    def pending(self) -> dict[str, list[str]]:
        return {"received": [str(k) for k in self._received], "sending": []}


class _Group:
    """A stand-in process group (the runtime reads only its rank and size): the pipeline group
    as one thread sees it, or a one-rank group (whose verdict exchange is skipped)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Exchange:
    """The plan verdict's all-gather, between threads."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=30)
        self.rows: list[bytes | None] = [None] * size

    def __call__(self, row: bytes, group, device, timeout_s) -> list[bytes]:
        self.rows[group.rank()] = row
        self.barrier.wait()
        rows = list(self.rows)
        self.barrier.wait()  # every thread has read the rows before the next exchange writes
        return rows


def test_another_transport_is_one_class_and_runs_a_pipeline_exactly(groups, monkeypatch):
    """Two ranks of a segment plan (activations and gradients both ways) on two threads,
    connected by `MemoryTransport`: the single-process reference's loss and gradients."""
    batch = st.make_batch(
        "vlm", st.group_samples(st.samples("vlm", 10, start=10), [3, 2, 3, 2]), sizes={"vit": 2}
    )
    placement = st.dip_placement(batch.model, 2, {"vit": 1, "llm": 1})
    plan = st.segment_plan(batch, placement)
    assert any(isinstance(i, Send) for p in plan.programs for i in p.instructions)
    monkeypatch.setattr(checks, "_all_gather_rows", _Exchange(2))
    wire = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    chunks = {
        r: [
            build_chunk(
                batch.model,
                c,
                num_chunks=placement.module(c.module).num_chunks,
                config=st.CFG,
                groups=groups,
            )
            for c in placement.chunks_on_rank(r)
        ]
        for r in (0, 1)
    }

    def rank(r: int):
        transport = functools.partial(MemoryTransport, wire, rank=r)
        runtime = st.rank_runtime(
            batch, placement, chunks[r], pp_group=_Group(r, 2), transport=transport
        )
        return runtime.run(plan, batch.by_index)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, (0, 1)))
    assert isinstance(MemoryTransport(wire, rank=0), Transport)
    loss, ref = _reference(batch, groups)
    assert sum(r.objective for r in results) == pytest.approx(loss, rel=1e-12)
    assert results[0].freed_bytes > 0  # its sent outputs' data freed before their backward
    got = {**_grads(chunks[0]), **_grads(chunks[1])}
    assert got.keys() == ref.keys()
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12 * float(g.abs().max()))
    for r, result in enumerate(results):
        posted = sum(isinstance(i, (Send, Recv)) for i in plan.program(r).instructions)
        assert result.messages == posted > 0 and result.channel is per_peer_channel
        assert not any(result.leftovers.values())
    assert all(q.empty() for q in wire.values())


def test_pipeline_p2p_is_a_transport_whose_channel_model_follows_its_channels(groups):
    world = dist.group.WORLD
    plain = PipelineP2P(group=world, device=torch.device("cpu"))
    assert isinstance(plain, Transport) and plain.channel is single_channel
    paired = PipelineP2P(group=world, device=torch.device("cpu"), channels=ChannelGroups(world))
    assert paired.channel is per_peer_channel
