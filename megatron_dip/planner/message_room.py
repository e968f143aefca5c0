"""Room in the activation limit for a plan's pipeline message buffers.

The list scheduler and the memory pass fit stored activations only: messages exist once a plan
is lowered (`schedule.passes.add_communication`), and their buffers (`simulator.message_peaks`:
a received tensor from its post to its consumer's end, a sent one until its release; 0.2-0.6 GB
per rank on T2V-S) can take a plan scheduled right up to its limit over it. So plans are
scheduled within the limit less a room for them: first `first_room`, then, where a lowered plan
still does not fit with its buffers, the room grown to those buffers (`grown_room`) and the
plan scheduled again, `MESSAGE_REFITS` times at most (`DipPlanner._fit_messages` for fused
plans, `SplitCandidates.fitted` for split ones). `MessageRoom` is the room a planner keeps while
it plans a replica.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from ..schedule.graph import Dataflow
from ..schedule.ir import MessageKey, Plan
from .simulator import message_peaks

# Times a plan is scheduled again when its message buffers take it over the memory limit.
MESSAGE_REFITS = 2
# The room a plan is first scheduled with for a rank's message buffers, in its largest received
# plus its largest sent message. On T2V-S's plans with receives posted ahead a rank held 2.3-4.7
# times that.
MESSAGE_ROOM = 3


def first_room(
    dataflow: Dataflow, message_bytes: Callable[[MessageKey], int], num_ranks: int
) -> tuple[int, ...]:
    """Per rank, `MESSAGE_ROOM` times its largest received plus its largest sent message of
    `dataflow` (`message_bytes`: a message's bytes)."""
    received = [0] * num_ranks
    sent = list(received)
    for stage in dataflow.stages():
        for key in (*dataflow.forward_outputs(stage), *dataflow.backward_outputs(stage)):
            src, dst = dataflow.sender_of(key), dataflow.receiver_of(key)
            if src != dst:
                nbytes = message_bytes(key)
                sent[src], received[dst] = max(sent[src], nbytes), max(received[dst], nbytes)
    return tuple(MESSAGE_ROOM * (a + b) for a, b in zip(received, sent))


def grown_room(room: Sequence[float], plan: Plan) -> tuple[float, ...]:
    """Per rank, `room` grown where `plan`'s own message buffers need more
    (`simulator.message_peaks`)."""
    return tuple(map(max, room, message_peaks(plan)))


class MessageRoom:
    """Per rank, the bytes a planner keeps free for message buffers in the activation limits it
    schedules within (`less`): none outside `kept`, `first_room` while a replica is planned,
    `grow`n where a lowered plan needs more, `drop`ped where nothing fits within it."""

    def __init__(self) -> None:
        self.bytes: tuple[float, ...] | None = None

    @contextlib.contextmanager
    def kept(
        self, dataflow: Dataflow, message_bytes: Callable[[MessageKey], int], num_ranks: int
    ) -> Iterator[None]:
        """The first room of `dataflow`'s plans (`first_room`) for the block, none after it."""
        self.bytes = first_room(dataflow, message_bytes, num_ranks)
        try:
            yield
        finally:
            self.bytes = None

    @property
    def keeps_any(self) -> bool:
        """Whether some rank keeps room now."""
        return any(self.bytes or ())

    def drop(self) -> None:
        """No room on any rank (the block's plans fit nowhere within the first)."""
        if self.bytes is not None:
            self.bytes = (0,) * len(self.bytes)

    def grow(self, plan: Plan) -> None:
        """The room grown to `plan`'s own message buffers where they need more (`grown_room`)."""
        if self.bytes is not None:
            self.bytes = grown_room(self.bytes, plan)

    def less(self, limits: Sequence[float] | None) -> list[float] | None:
        """`limits` less the room (as they are where none is kept)."""
        if limits is None:
            return None
        if self.bytes is None:
            return list(limits)
        return [lim - room for lim, room in zip(limits, self.bytes)]
