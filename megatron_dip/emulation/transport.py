"""The transport of emulated chunks: the plan's messages, each carried as the emulated stand-in.

Emulated chunks exchange one tiny tensor per message (`timing.message_spec`: a payload and time
stamps) whatever the plan's tensors are, while the executor runs the plan as planned, with the
real model's message shapes, whose bytes the emulated transfers take the time of
(`timing.EmulatedBatchSource`). `EmulatedTransport` wraps a real transport and hands it every
Send and Recv with the stand-in's TensorSpec instead of the plan's (`timing.stand_in`), so the
real transport still checks, posts and matches each message in plan order (`stand_in`); everything
else is the wrapped transport's, its channel model included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_dip.runtime.p2p import ChannelGroups, P2PConfig, PipelineP2P
from megatron_dip.runtime.transport import Outgoing, Transport
from megatron_dip.schedule.engine import ChannelFn
from megatron_dip.schedule.ir import MessageKey, Recv, Send

from .timing import message_spec


class EmulatedTransport:
    """`inner` (any `Transport`) carrying the emulated stand-in of every message."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self._spec = (message_spec(),)

    @property
    def channel(self) -> ChannelFn:
        return self.inner.channel

    @property
    def messages_posted(self) -> int:
        return self.inner.messages_posted

    def post(self, ops: Sequence[tuple[int, Send | Recv]], outgoing: Outgoing) -> None:
        """Post one batch of the plan as stand-ins (`Transport.post`)."""
        # The stand-in built directly: a `dataclasses.replace` per message is measurable here.
        self.inner.post([(i, type(op)(op.key, op.peer, self._spec)) for i, op in ops], outgoing)

    def wait(
        self, keys: Iterable[MessageKey], *, where: str = "", index: int | None = None
    ) -> None:
        self.inner.wait(keys, where=where, index=index)

    def take(self, key: MessageKey) -> dict[str, torch.Tensor]:
        return self.inner.take(key)

    def finish(self) -> None:
        self.inner.finish()

    def pending(self) -> dict[str, list[str]]:
        return self.inner.pending()


def emulated_p2p(
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    config: P2PConfig,
    channels: ChannelGroups | None,
) -> EmulatedTransport:
    """The `TransportFactory` of emulated runs: `PipelineP2P` carrying stand-ins."""
    return EmulatedTransport(
        PipelineP2P(group=group, device=device, config=config, channels=channels)
    )


__all__ = ["EmulatedTransport", "emulated_p2p"]
