"""How one rank's point-to-point messages travel: the interface the executor talks to.

The executor never touches a communication library: it hands a `Transport` each *batch* of
consecutive Send/Recv instructions (`post`), blocks on named messages (`wait`), takes received
tensors (`take`), and closes the iteration (`finish`). `PipelineP2P` (p2p.py) is the
torch.distributed implementation (NCCL or gloo); another backend is one class with these
methods, and a `TransportFactory` (its constructor, usually) that `RankRuntime` calls once per
iteration, since a transport holds one iteration's buffers.

A transport also names its *channel model*, the ordering of messages the planner's simulator
assumes (`schedule.engine.single_channel`: every message of the rank on one ordered stream;
`per_peer_channel`: one ordered stream per (sender, receiver) pair), so that a prediction of an
iteration simulates the channels the iteration really ran on (`IterationResult.channel`).

Contract (what `PipelineP2P` does and the executor relies on): operations are matched in plan
order per channel; `post` checks outgoing tensors against the instructions' TensorSpecs before
posting anything and keeps them alive until waited for; `wait` raises `PipelineTimeoutError` /
`PipelineCommError` (errors.py) naming the rank, instruction, peer, message and tensor; `take`
raises `MessageError` for a message not yet received and waited for; `pending` lists what is
still held (empty after a complete iteration).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megatron_dip.schedule.engine import ChannelFn
from megatron_dip.schedule.ir import MessageKey, Recv, Send

from .p2p import ChannelGroups, P2PConfig

Outgoing = Mapping[MessageKey, Mapping[str, torch.Tensor]]


@runtime_checkable
class Transport(Protocol):
    """One iteration's point-to-point messages of one pipeline rank (module docstring)."""

    messages_posted: int  # Send/Recv instructions posted so far

    @property
    def channel(self) -> ChannelFn:
        """The channel model the simulator should use for iterations on this transport."""

    def post(self, ops: Sequence[tuple[int, Send | Recv]], outgoing: Outgoing) -> None:
        """Post one batch: (instruction index, Send/Recv) in program order; `outgoing[key]`
        holds the tensors of each Send."""

    def wait(
        self, keys: Iterable[MessageKey], *, where: str = "", index: int | None = None
    ) -> None:
        """Block until the posted operations of `keys` completed (`where`/`index`: the waiting
        instruction, for errors)."""

    def take(self, key: MessageKey) -> dict[str, torch.Tensor]:
        """The tensors of received message `key` (waited for before)."""

    def finish(self) -> None:
        """Complete everything still outstanding (the implicit wait at the end of a program)."""

    def pending(self) -> dict[str, list[str]]:
        """What is still held: {"received": [...], "sending": [...]}."""


class TransportFactory(Protocol):
    """Builds the transport of one iteration from a `RankRuntime`'s fixed parts: the pipeline
    `group` (peers are ranks within it), the chunks' `device`, the executor's `P2PConfig` and
    the optional per-pair `ChannelGroups`. `PipelineP2P` itself is one; a backend that needs
    none of them accepts and ignores them."""

    def __call__(
        self,
        *,
        group: dist.ProcessGroup,
        device: torch.device,
        config: P2PConfig,
        channels: ChannelGroups | None,
    ) -> Transport: ...


__all__ = ["Outgoing", "Transport", "TransportFactory"]
