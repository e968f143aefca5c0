"""Point-to-point messages between pipeline ranks, over one explicit process group.

`PipelineP2P` is the torch.distributed (NCCL, gloo) implementation of the executor's
`Transport` (transport.py); its channel model (`PipelineP2P.channel`) follows its `channels`.

A *batch* is a maximal run of consecutive `Send`/`Recv` instructions of a program (see
`schedule/ir.py`). `PipelineP2P.post` posts one batch without blocking, as ONE
`torch.distributed.batch_isend_irecv` (or one `isend`/`irecv` per tensor when
`P2PConfig.batched` is False); `wait` blocks until named messages completed.

How messages stay unambiguous. NCCL ignores tags and matches the point-to-point operations
between two ranks in the order they were issued, per direction; gloo matches by (peer, tag) in
order. So every operation is issued in *plan order* (the order of the instructions, then the
order of a message's TensorSpecs), with tag 0 by default, and the runtime requires the plan to be
*channel-consistent*: for every ordered pair of ranks (a, b), the sequence of messages rank a
sends to b equals the sequence of messages rank b receives from a
(`schedule.validate.check_channel_order`, run before any communication). Then the k-th send
from a to b always meets the k-th receive, even when the previous and the next pipeline rank are
the same process (PP=2), where Megatron's own batched p2p swaps activations and gradients. Note that re-sorting a batch (e.g. by MessageKey)
would be wrong: the two ends of a message may sit in differently composed batches.
`P2PConfig.use_tags` additionally gives every tensor a tag derived from its message (gloo and
MPI honour it; NCCL ignores it, so it is a second line of defence only).

Channels. By default every message of a rank travels over the one pipeline group, i.e. on one
ordered NCCL stream: a batch whose send waits for a slow receiver holds up every later batch of
the rank, receives from other peers included (`schedule.engine.single_channel`). With
`ChannelGroups`, each ordered (sender, receiver) pair of pipeline ranks gets its own 2-rank group,
so a batch is posted as one `batch_isend_irecv` per channel and only messages between the same
two ranks stay ordered (`schedule.engine.per_peer_channel`, what the planner simulates).

Every outgoing tensor is checked against the plan's TensorSpec (shape and dtype) before it is
posted: NCCL does not check sizes, a mismatch would corrupt memory or hang. Receive buffers are
allocated from the Recv's TensorSpecs. Tensors with no elements are not transferred at all
(both ends skip them, so the order stays consistent).

Timeouts. A wait that blocks the CPU (gloo: one `Work` per tensor) is given
`P2PConfig.timeout_s`; past it, or when the operation fails (gloo: the peer closed its
connection, typically because it failed and exited), `PipelineTimeoutError` /
`PipelineCommError` names this rank, the waiting instruction, the peer, the message and the
tensor. Posting to a peer whose connection is gone fails the same way. NCCL is different: its
`Work.wait()` only makes the current CUDA stream wait (the CPU runs ahead), and a `wait` given a
timeout would block the CPU until the GPU finished, serialising the schedule, so on CUDA the wait
is left untimed and a stalled operation is caught by the process group's own timeout (the NCCL
watchdog aborts the communicators and ends the process after `init_process_group(timeout=...)`,
which the training sets from `--dip-comm-timeout-s`, like every other collective's).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_dip.parallel.groups import ChannelGroups
from megatron_dip.schedule.engine import ChannelFn, per_peer_channel, single_channel
from megatron_dip.schedule.ir import MessageKey, Recv, Send, TensorSpec

from .errors import MessageError, PipelineCommError, PipelineTimeoutError

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}


def torch_dtype_of(spec: TensorSpec) -> torch.dtype:
    """The torch dtype of a TensorSpec."""
    return _TORCH_DTYPES[spec.dtype]


@dataclass(frozen=True)
class P2PConfig:
    """How batches of messages are posted.

    `batched`: one `batch_isend_irecv` per batch (Megatron's `batch_p2p_comm`); False posts
    one `isend`/`irecv` per tensor (same order). `use_tags`: a per-tensor tag derived from the
    message key (see the module docstring); off by default so that gloo runs exercise exactly
    the order-based matching NCCL relies on. `timeout_s`: how long one blocking wait may take
    before `PipelineTimeoutError` (see "Timeouts" in the module docstring); None leaves it to
    the process group's timeout.
    """

    batched: bool = True
    use_tags: bool = False
    timeout_s: float | None = 600.0

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"P2PConfig.timeout_s must be > 0 or None, got {self.timeout_s}")


def message_tag(key: MessageKey, tensor_index: int) -> int:
    """A stable tag in [1, 2^30) for tensor `tensor_index` of message `key`."""
    digest = hashlib.blake2b(f"{key}#{tensor_index}".encode(), digest_size=4).digest()
    return 1 + int.from_bytes(digest, "little") % ((1 << 30) - 1)


def check_tensor(tensor: torch.Tensor, spec: TensorSpec, *, where: str, key: MessageKey) -> None:
    """Raise `MessageError` unless `tensor` has the shape and dtype of `spec`."""
    want = torch_dtype_of(spec)
    if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != want:
        raise MessageError(
            f"{where}: tensor {spec.name!r} of message {key} is {tuple(tensor.shape)} "
            f"{tensor.dtype}, the plan says {tuple(spec.shape)} {want}"
        )


def check_message(
    tensors: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    *,
    where: str,
    key: MessageKey,
) -> None:
    """Raise `MessageError` unless `tensors` holds exactly the tensors of `specs`, matching."""
    names = [s.name for s in specs]
    if set(tensors) != set(names):
        raise MessageError(
            f"{where}: message {key} has tensors {sorted(tensors)}, the plan says {names}"
        )
    for spec in specs:
        check_tensor(tensors[spec.name], spec, where=where, key=key)


_WARM_GROUPS: set[int] = set()


class _OpInfo(NamedTuple):
    """One posted tensor: the Send/Recv instruction (and its index) it belongs to."""

    index: int
    op: Send | Recv
    tensor: str


class _Batch:
    """The posted operations of one batch: their `Work` handles, completed together.

    `infos[i]`: the tensors work `i` completes (gloo gives one work per tensor; a coalesced
    NCCL batch gives one work for all of them). `next`: works before it have completed.
    """

    __slots__ = ("done", "first", "infos", "next", "works")

    def __init__(self, first: int, works: list, infos: list[_OpInfo]) -> None:
        self.first = first
        self.works = works
        self.infos = [[i] for i in infos] if len(works) == len(infos) else [infos] * len(works)
        self.next = 0
        self.done = False


class PipelineP2P:
    """Posts and completes the messages of one pipeline rank (see the module docstring).

    `group`: the pipeline process group; peers are ranks *within* it. `device`: where receive
    buffers are allocated (the model's device).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        device: torch.device,
        config: P2PConfig = P2PConfig(),
        channels: ChannelGroups | None = None,
    ) -> None:
        self.group = group
        self.channels = channels
        self.rank = group.rank()
        self.device = torch.device(device)
        self.config = config
        # NCCL: a timed Work.wait would block the CPU until the GPU finished (module docstring).
        self.timeout_s = None if self.device.type == "cuda" else config.timeout_s
        self._batch_of: dict[tuple[bool, MessageKey], _Batch] = {}
        self._received: dict[MessageKey, dict[str, torch.Tensor]] = {}
        self._sending: dict[MessageKey, Mapping[str, torch.Tensor]] = {}
        self._global = [dist.get_global_rank(group, r) for r in range(group.size())]
        self._wait_timeout = None if self.timeout_s is None else timedelta(seconds=self.timeout_s)
        self.messages_posted = 0
        if self.device.type == "cuda" and config.batched and id(group) not in _WARM_GROUPS:
            # NCCL: a batch_isend_irecv that is the first operation on a communicator must
            # involve every rank of the group (torch's documented caveat); one barrier first.
            dist.barrier(group=group)
            _WARM_GROUPS.add(id(group))

    @property
    def channel(self) -> ChannelFn:
        """The simulator's model of these channels: `per_peer_channel` with `ChannelGroups`,
        else `single_channel` (every message of the rank on the one pipeline group)."""
        return single_channel if self.channels is None else per_peer_channel

    # -- posting ---------------------------------------------------------------------------

    def post(
        self,
        ops: Sequence[tuple[int, Send | Recv]],
        outgoing: Mapping[MessageKey, Mapping[str, torch.Tensor]],
    ) -> None:
        """Post one batch: `ops` are (instruction index, Send/Recv) in program order.

        `outgoing[key]` holds the tensors of each Send; they are checked against the plan
        first (nothing is posted when one does not match) and kept alive until waited for.
        """
        self._check_batch(ops, outgoing)
        by_group: dict[int, tuple[dist.ProcessGroup, list[tuple[int, Send | Recv]]]] = {}
        for item in ops:
            group = self._group_of(item[1])
            by_group.setdefault(id(group), (group, []))[1].append(item)
        for group, items in by_group.values():
            posted: list[tuple[dist.P2POp, _OpInfo]] = []
            for index, op in items:
                posted += self._post_op(index, op, outgoing, group)
            infos = [info for _, info in posted]
            batch = _Batch(items[0][0], self._start([p for p, _ in posted], infos), infos)
            for _, op in items:
                self._batch_of[(isinstance(op, Send), op.key)] = batch
        self.messages_posted += len(ops)

    def _group_of(self, op: Send | Recv) -> dist.ProcessGroup:
        if self.channels is None:
            return self.group
        if isinstance(op, Send):
            return self.channels.group(self.rank, op.peer)
        return self.channels.group(op.peer, self.rank)

    def _post_op(
        self,
        index: int,
        op: Send | Recv,
        outgoing: Mapping[MessageKey, Mapping[str, torch.Tensor]],
        group: dist.ProcessGroup,
    ) -> list[tuple[dist.P2POp, _OpInfo]]:
        if isinstance(op, Send):
            tensors = outgoing[op.key]
            self._sending[op.key] = tensors
            return self._ops(dist.isend, index, op, [tensors[s.name] for s in op.tensors], group)
        buffers = {
            s.name: torch.empty(s.shape, dtype=torch_dtype_of(s), device=self.device)
            for s in op.tensors
        }
        self._received[op.key] = buffers
        return self._ops(dist.irecv, index, op, [buffers[s.name] for s in op.tensors], group)

    def _check_batch(
        self,
        ops: Sequence[tuple[int, Send | Recv]],
        outgoing: Mapping[MessageKey, Mapping[str, torch.Tensor]],
    ) -> None:
        for index, op in ops:
            if (isinstance(op, Send), op.key) in self._batch_of:
                raise MessageError(
                    f"rank {self.rank}: instruction {index} posts {op.key} a second time"
                )
            if isinstance(op, Send):
                where = f"rank {self.rank}: instruction {index} (send to {op.peer})"
                if op.key not in outgoing:
                    raise MessageError(f"{where}: message {op.key} has not been produced")
                check_message(outgoing[op.key], op.tensors, where=where, key=op.key)

    def _ops(
        self,
        fn,
        index: int,
        op: Send | Recv,
        tensors: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> list[tuple[dist.P2POp, _OpInfo]]:
        out = []
        for i, (tensor, spec) in enumerate(zip(tensors, op.tensors)):
            if spec.numel == 0:
                continue
            if not tensor.is_contiguous():
                raise MessageError(
                    f"rank {self.rank}: tensor {spec.name!r} of {op.key} is not contiguous"
                )
            tag = message_tag(op.key, i) if self.config.use_tags else 0
            peer = self._global[op.peer]
            out.append((dist.P2POp(fn, tensor, peer, group, tag), _OpInfo(index, op, spec.name)))
        return out

    def _start(self, p2p_ops: list[dist.P2POp], infos: list[_OpInfo]) -> list:
        if not p2p_ops:
            return []
        try:
            if self.config.batched:
                return list(dist.batch_isend_irecv(p2p_ops))
            works = []
            for op in p2p_ops:
                work = op.op(op.tensor, op.peer, op.group, op.tag)
                if work is not None:
                    works.append(work)
            return works
        except Exception as e:  # gloo: the peer's connection is gone (it failed or exited)
            where = f"instruction {infos[0].index} (posting a batch)"
            raise self._error(where, infos[0].index, infos, e, "posting") from e

    # -- completion ------------------------------------------------------------------------

    def wait(
        self, keys: Iterable[MessageKey], *, where: str = "", index: int | None = None
    ) -> None:
        """Block until the posted operations of `keys` (and their batches) completed.

        `where` describes the waiting instruction, `index` is its index (both for errors).
        Raises `PipelineTimeoutError` when one operation takes longer than the timeout, and
        `PipelineCommError` when it fails (e.g. the peer's process is gone).
        """
        for key in keys:
            batch = self._batch_of.get((True, key)) or self._batch_of.get((False, key))
            if batch is None:
                raise MessageError(f"rank {self.rank}: {where} waits for {key}, never posted")
            self._complete(batch, where, index)
            self._sending.pop(key, None)

    def _complete(self, batch: _Batch, where: str, index: int | None) -> None:
        timeout = self.timeout_s
        while batch.next < len(batch.works):
            work, infos = batch.works[batch.next], batch.infos[batch.next]
            started = time.monotonic()
            try:
                done = work.wait() if timeout is None else work.wait(self._wait_timeout)
            except Exception as e:  # re-raised naming the rank, instruction, peer and tensor
                late = timeout is not None and time.monotonic() - started >= timeout
                what = "timeout" if late or "timed out" in str(e).lower() else "waiting for"
                raise self._error(where, index, infos, e, what) from e
            if done is False:  # a backend that reports a timeout instead of raising
                raise self._error(where, index, infos, None, "timeout")
            batch.next += 1
        batch.done = True

    def _error(
        self,
        where: str,
        index: int | None,
        infos: list[_OpInfo],
        cause: BaseException | None,
        what: str,
    ) -> PipelineCommError:
        """The error for an operation that failed (`what`: "posting", "waiting for") or timed
        out (`what`: "timeout")."""
        ops = "; ".join(_describe(info) for info in infos[:4])
        if len(infos) > 4:
            ops += f"; and {len(infos) - 4} more tensors of the batch"
        if what == "timeout":
            text = (
                f"timed out after {self.timeout_s:g} s waiting for {ops}; the peer is stalled, "
                "has failed, or never posts the matching operation"
            )
            kind: type[PipelineCommError] = PipelineTimeoutError
        else:
            text = f"{what} {ops} failed; the peer has probably failed or exited (see its error)"
            kind = PipelineCommError
        if cause is not None:
            text += f" [{type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]}]"
        first = infos[0]
        return kind(
            f"rank {self.rank}: {where}: {text}",
            rank=self.rank,
            index=index,
            peer=first.op.peer,
            key=first.op.key,
            tensor=first.tensor,
        )

    def take(self, key: MessageKey) -> dict[str, torch.Tensor]:
        """The tensors of received message `key` (which must have been waited for)."""
        batch = self._batch_of.get((False, key))
        if batch is None or not batch.done or key not in self._received:
            raise MessageError(
                f"rank {self.rank}: message {key} used before it was received and waited for"
            )
        return self._received.pop(key)

    def finish(self) -> None:
        """Wait for everything still outstanding (the implicit wait at the end of a program)."""
        for batch in {id(b): b for b in self._batch_of.values()}.values():
            self._complete(batch, "end of the program (implicit wait)", None)
        self._sending.clear()

    def pending(self) -> dict[str, list[str]]:
        """What is still held: received-but-unused messages and unfinished sends."""
        return {
            "received": [str(k) for k in self._received],
            "sending": [str(k) for k in self._sending],
        }


def _describe(info: _OpInfo) -> str:
    if isinstance(info.op, Send):
        what, peer = "send", f"to peer rank {info.op.peer}"
    else:
        what, peer = "recv", f"from peer rank {info.op.peer}"
    return (
        f"the {what} of message {info.op.key}, tensor {info.tensor!r}, {peer} "
        f"(posted by instruction {info.index})"
    )
