"""Errors of the runtime, each naming the rank (and, where there is one, the instruction) at fault.

* `MessageError`: a tensor does not match the plan, or a message is used in a way the plan does
  not allow (the runtime's own error type);
* `PipelineCommError` (a `MessageError`): a point-to-point operation failed, e.g. the peer's
  process died or closed its connection; names the rank, the instruction, the peer, the message
  and the tensor;
* `PipelineTimeoutError` (a `PipelineCommError`): a blocking wait ran past the timeout
  (`P2PConfig.timeout_s`, the training flag `--dip-comm-timeout-s`);
* `PlanRejectedError` (a `schedule.PlanError`): this rank's plan passed its checks, but another
  rank rejected its own plan, or the ranks hold different plans (`checks.agree_on_plan`);
* `StallError`: a phase of the training loop (a collective, a store wait, the schedule) failed
  to communicate; names the phase, the group, the ranks that did and did not arrive and the
  ranks that stalled (`stalls.PhaseWatch`).
"""

from __future__ import annotations

from megatron_dip.schedule.engine import PlanError
from megatron_dip.schedule.ir import MessageKey


class MessageError(RuntimeError):
    """A tensor does not match the plan, or a message is used in a way the plan does not allow.

    The message names the rank, the instruction index, the message and the tensor.
    """


class PipelineCommError(MessageError):
    """A point-to-point operation failed (module docstring). The attributes repeat what the
    message names: `rank` (pipeline rank), `index` (the instruction that was waiting or posting,
    None at the end of the program), `peer` (pipeline rank), `key`, `tensor`."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        index: int | None,
        peer: int | None,
        key: MessageKey | None,
        tensor: str | None,
    ) -> None:
        super().__init__(message)
        self.rank, self.index, self.peer, self.key, self.tensor = rank, index, peer, key, tensor


class PipelineTimeoutError(PipelineCommError):
    """A blocking wait of the runtime ran past its timeout (module docstring)."""


class PlanRejectedError(PlanError):
    """Another rank rejected its plan, or the ranks' plans differ: nobody communicates."""


class StallError(RuntimeError):
    """A phase of the training loop failed to communicate (module docstring). `phase`: its
    name; `stalled`: the global ranks whose heartbeat stopped (empty: none did)."""

    def __init__(self, message: str, *, phase: str, stalled: list[int]) -> None:
        super().__init__(message)
        self.phase, self.stalled = phase, list(stalled)


__all__ = [
    "MessageError",
    "PipelineCommError",
    "PipelineTimeoutError",
    "PlanRejectedError",
    "StallError",
]
