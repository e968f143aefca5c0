"""Checks run before an executor communicates: a plan that does not fit the built model is refused.

Every rank holds the whole plan and runs the same checks on all of it, so a plan that is wrong
anywhere is refused on every rank, before the first message. That alone is not enough: one rank
may hold another plan than its peers (a corrupted or stale copy, another iteration's), and a rank
that refused alone would leave its peers waiting forever. So the verdicts are then *agreed*
(`agree_on_plan`): one tiny all-gather per group (pipeline, then tensor-parallel, then
data-parallel) of (verdict, plan identity, reason), before any point-to-point message. If any rank
rejected its plan, or the ranks of a pipeline (or of a tensor-parallel group) hold different
plans, every rank raises, and none communicates.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_dip.schedule.engine import ChannelFn, PlanError, per_peer_channel, single_channel
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import (
    FORMAT_VERSION,
    Channels,
    ChunkSpec,
    MessageKey,
    Placement,
    Plan,
    Recv,
    Send,
    TensorSpec,
)
from megatron_dip.schedule.validate import check_channel_order, check_plan_matches, validate_plan

from .errors import PipelineCommError, PipelineTimeoutError, PlanRejectedError

TensorFn = Callable[[MessageKey], Iterable[TensorSpec]]
ChunkKey = tuple[str, int]


def unwrap_chunk(module: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside wrappers (DDP, Float16Module): the module with a `chunk` spec."""
    seen = module
    while not isinstance(getattr(seen, "chunk", None), ChunkSpec):
        inner = getattr(seen, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(
                f"{type(module).__name__} is not a model chunk: no `chunk` ChunkSpec attribute "
                "on it or on the modules it wraps"
            )
        seen = inner
    return seen


def chunks_device(chunks: Iterable[torch.nn.Module]) -> torch.device:
    """Where a rank's chunks run: the first chunk's first parameter's device (CPU without)."""
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device
        break  # the chunks of a rank share one device
    return torch.device("cpu")


def index_chunks(chunks: Iterable[torch.nn.Module]) -> dict[ChunkKey, torch.nn.Module]:
    """The given (possibly wrapped) chunks by (module, chunk index); duplicates are refused."""
    found: dict[ChunkKey, torch.nn.Module] = {}
    for c in chunks:
        spec = unwrap_chunk(c).chunk
        key = (spec.module, spec.index)
        if key in found:
            raise ValueError(f"chunk {spec.module}{spec.index} is given twice")
        found[key] = c
    return found


def check_chunks(
    chunks: Mapping[ChunkKey, torch.nn.Module], *, placement: Placement, rank: int
) -> None:
    """Refuse unless this rank holds exactly the chunks the placement puts on it."""
    want = {(c.module, c.index): c for c in placement.chunks_on_rank(rank)}
    for key, spec in want.items():
        if key not in chunks:
            raise PlanError(
                f"rank {rank}: the placement puts chunk {key[0]}{key[1]} "
                f"(layers [{spec.layer_start}, {spec.layer_end})) here, but it was not built"
            )
        built = unwrap_chunk(chunks[key]).chunk
        if (built.layer_start, built.layer_end) != (spec.layer_start, spec.layer_end):
            raise PlanError(
                f"rank {rank}: chunk {key[0]}{key[1]} was built for layers "
                f"[{built.layer_start}, {built.layer_end}), the placement says "
                f"[{spec.layer_start}, {spec.layer_end})"
            )
    extra = sorted(set(chunks) - set(want))
    if extra:
        raise PlanError(
            f"rank {rank}: chunks {[f'{m}{i}' for m, i in extra]} were built here, "
            "the placement puts them elsewhere"
        )


def check_message_specs(plan: Plan, tensor_fn: TensorFn) -> None:
    """Refuse a plan whose message shapes differ from what the built model produces."""
    memo: dict[MessageKey, tuple[TensorSpec, ...]] = {}
    for program in plan.programs:
        for i, ins in enumerate(program.instructions):
            if not isinstance(ins, (Send, Recv)):
                continue
            if ins.key not in memo:
                memo[ins.key] = tuple(tensor_fn(ins.key))
            if tuple(ins.tensors) != memo[ins.key]:
                raise PlanError(
                    f"rank {program.rank}: instruction {i} ({type(ins).__name__.lower()} "
                    f"{ins.key}) carries {_specs(ins.tensors)}, the model produces "
                    f"{_specs(memo[ins.key])}"
                )


def _specs(specs: Iterable[TensorSpec]) -> str:
    return ", ".join(f"{s.name}{list(s.shape)}:{s.dtype}" for s in specs) or "nothing"


def check_before_run(
    *,
    plan: Plan,
    placement: Placement,
    rank: int,
    num_ranks: int,
    chunks: Mapping[ChunkKey, Any],
    tensor_fn: TensorFn | None,
    validate: bool,
    channel: ChannelFn = single_channel,
) -> Dataflow:
    """All checks that need no communication; returns the plan's data flow.

    Format version; the plan is for this world size and the built model's placement; this rank
    holds exactly its chunks; the transport's streams (`channel`) are those the plan was posted
    for; (optionally) the full `validate_plan`; every channel carries its messages in one
    order; (when `tensor_fn` is given) every message has the model's shapes.
    """
    if plan.version != FORMAT_VERSION:
        raise PlanError(
            f"plan {plan.name!r} has format version {plan.version}, this runtime runs "
            f"version {FORMAT_VERSION}"
        )
    check_plan_matches(plan, placement=placement, num_ranks=num_ranks)
    check_chunks(chunks, placement=placement, rank=rank)
    check_streams(plan, channel)
    if validate:
        validate_plan(plan)
    check_channel_order(plan.programs)  # also part of validate_plan; cheap, so always run
    if tensor_fn is not None:
        check_message_specs(plan, tensor_fn)
    return Dataflow(plan.placement, plan.submicrobatches, plan.dependencies)


def check_streams(plan: Plan, channel: ChannelFn) -> None:
    """Raise `PlanError` when `plan` posts its receives for one stream per (sender, receiver)
    pair (`Channels.PER_PEER`) and this transport carries every message of the rank on one
    (`channel` is not `per_peer_channel`): there its programs could deadlock."""
    if plan.channels is not Channels.PER_PEER or channel is per_peer_channel:
        return
    if any(isinstance(i, Send | Recv) for p in plan.programs for i in p.instructions):
        raise PlanError(
            f"plan {plan.name!r} (iteration {plan.iteration}) posts its receives ahead, for one "
            "stream per (sender, receiver) pair (Plan.channels per-peer), but this transport "
            "carries every message of the rank on one stream (no ChannelGroups), where those "
            "programs can deadlock: give the transport ChannelGroups, or plan with "
            "--dip-receive-lead 0 (PlannerConfig.receive_lead)"
        )


# -- agreeing on the verdict ----------------------------------------------------------------------

# (description, group, whether its ranks must hold the same plan); a None group is skipped.
VerdictGroup = tuple[str, "dist.ProcessGroup | None", bool]
_IDENTITY_BYTES, _ROW_BYTES = 64, 512


def plan_identity(plan: Plan) -> str:
    """A short text naming `plan`: name, iteration, replica and a digest of its shape (program
    lengths, microbatch samples), equal on every rank holding the same plan."""
    shape = (
        plan.version,
        plan.forward_only,
        tuple(len(p.instructions) for p in plan.programs),
        tuple(tuple(m.sample_ids) for m in plan.microbatches),
    )
    digest = hashlib.blake2b(repr(shape).encode(), digest_size=4).hexdigest()
    return f"{plan.name} iteration {plan.iteration} replica {plan.replica} #{digest}"


def encode_verdict(reason: str | None, identity: str) -> bytes:
    """One rank's row of the verdict exchange (fixed size; texts are truncated)."""
    ident = identity.encode()[:_IDENTITY_BYTES].ljust(_IDENTITY_BYTES, b"\0")
    text = (reason or "").encode()[: _ROW_BYTES - 1 - _IDENTITY_BYTES]
    return (b"\1" if reason is not None else b"\0") + ident + text


def decode_verdict(row: bytes) -> tuple[str | None, str]:
    """(reason or None, plan identity) of a row made by `encode_verdict`."""
    ident = row[1 : 1 + _IDENTITY_BYTES].rstrip(b"\0").decode(errors="replace")
    text = row[1 + _IDENTITY_BYTES :].rstrip(b"\0").decode(errors="replace")
    return (text if row[:1] == b"\1" else None), ident


def combine_verdicts(
    rows: Sequence[tuple[str | None, str]], *, same_plan: bool, description: str
) -> str | None:
    """The reason every rank of one group rejects the plan (None: all accept). `rows`: the
    group's (reason, identity) by group rank, identical on every rank, so is the result."""
    for reason, _ in rows:
        if reason is not None:
            return reason
    identities = [ident for _, ident in rows]
    if same_plan and len(set(identities)) > 1:
        held = ", ".join(f"rank {r} holds {ident!r}" for r, ident in enumerate(identities))
        return f"the {description} ranks hold different plans ({held})"
    return None


def agree_on_plan(
    *,
    error: BaseException | None,
    identity: str,
    rank: int,
    groups: Sequence[VerdictGroup],
    device: torch.device,
    timeout_s: float | None,
) -> None:
    """Agree on this rank's verdict (`error`: why it rejected its plan, None if it accepted)
    with every rank of `groups`, in order (module docstring). Raises `error` itself on the rank
    that rejected, `PlanRejectedError` ("rank N rejected the plan: ...") on the others;
    `PipelineTimeoutError` if a group's rank does not arrive within `timeout_s`.
    """
    reason = None
    if error is not None:
        me = dist.get_rank() if dist.is_initialized() else rank
        reason = (
            f"pipeline rank {rank} rejected the plan (global rank {me}): "
            f"{type(error).__name__}: {error}"
        )
    for description, group, same_plan in groups:
        if group is None or group.size() == 1:
            continue
        try:
            rows = _all_gather_rows(encode_verdict(reason, identity), group, device, timeout_s)
        except PipelineCommError as exc:
            if error is not None:
                raise error from exc  # the root cause; the exchange failed because of it
            raise
        combined = combine_verdicts(
            [decode_verdict(r) for r in rows], same_plan=same_plan, description=description
        )
        reason = reason if reason is not None else combined
    if error is not None:
        raise error
    if reason is not None:
        raise PlanRejectedError(f"rank {rank}: {reason}; no rank communicates")


def _all_gather_rows(
    row: bytes, group: dist.ProcessGroup, device: torch.device, timeout_s: float | None
) -> list[bytes]:
    mine = torch.zeros(_ROW_BYTES, dtype=torch.uint8)
    mine[: len(row)] = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    mine = mine.to(device)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    started = time.monotonic()
    try:
        # NCCL: a timed wait blocks the CPU anyway here (the result is read right away), but its
        # timeout is the process group's; gloo honours this one.
        if timeout_s is None or device.type == "cuda":
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout_s))
    except Exception as e:
        late = timeout_s is not None and time.monotonic() - started >= timeout_s
        timed_out = late or "timed out" in str(e).lower()
        kind = PipelineTimeoutError if timed_out else PipelineCommError
        what = f"failed ({e})"
        if timed_out:
            what = "timed out" + (f" after {timeout_s:g} s" if timeout_s is not None else "")
        raise kind(
            f"rank {group.rank()} of group {dist.get_process_group_ranks(group)}: agreeing on "
            f"the plan verdict before instruction 0 {what}: a rank of the group did not reach "
            "the executor (it failed or stalled before; see its error)",
            rank=group.rank(),
            index=None,
            peer=None,
            key=None,
            tensor=None,
        ) from e
    return [bytes(r.cpu().tolist()) for r in rows]
