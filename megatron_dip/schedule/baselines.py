"""Megatron-Core's stock pipeline schedules, expressed in the plan format.

`megatron_1f1b_order` and `megatron_interleaved_order` reproduce, rank by rank, the order of
forward and backward steps that megatron-core (0.16) runs in
`forward_backward_pipelining_without_interleaving` and `..._with_interleaving`
(`megatron/core/pipeline_parallel/schedules.py`): the same warm-up counts, the same
`get_schedule_table` and the same rejection of microbatch counts. `tests/test_baselines.py`
runs megatron-core's own functions and compares. The plan builders add communication with
`passes.add_communication`, so the plans are deadlock-free by construction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from .graph import Dataflow
from .ir import (
    Backward,
    BatchTotals,
    ChunkSpec,
    Dependency,
    Forward,
    MessageKey,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Plan,
    StageId,
    SubMicrobatch,
    TensorSpec,
)
from .passes import ComputeTimeFn, TensorFn, add_communication

OrderEntry = tuple[bool, int, int]
"""(is_forward, local model chunk, microbatch): one step of a Megatron schedule on one rank."""


def default_tensors(key: MessageKey) -> tuple[TensorSpec, ...]:
    """One placeholder hidden-state tensor per message (shape (1,), float32)."""
    return (TensorSpec("hidden", (1,)),)


def megatron_1f1b_order(*, num_ranks: int, num_microbatches: int, rank: int) -> list[OrderEntry]:
    """Rank `rank`'s steps in Megatron's non-interleaved 1F1B schedule.

    Warm-up: min(P - rank - 1, M) forwards; steady state: one forward then one backward;
    cool-down: the remaining backwards. With P = 1 this is also `forward_backward_no_pipelining`'s
    order (forward then backward of each microbatch).
    """
    _check_rank(num_ranks, rank)
    if num_microbatches < 1:
        raise ValueError(f"need at least one microbatch, got {num_microbatches}")
    warmup = min(num_ranks - rank - 1, num_microbatches)
    order: list[OrderEntry] = [(True, 0, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [(True, 0, warmup + i), (False, 0, i)]
    order += [(False, 0, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def check_interleaved_args(
    *, num_ranks: int, num_microbatches: int, microbatch_group_size: int
) -> None:
    """Raise `ValueError` for the microbatch counts megatron-core's interleaved schedule rejects."""
    p, m, g = num_ranks, num_microbatches, microbatch_group_size
    if g > m or g < p:
        raise ValueError(
            "the number of contiguous microbatches in a virtual pipeline stage (microbatch "
            f"group size {g}) must lie in [PP={p}, M={m}]: with fewer than PP, a rank would wait "
            "for its own chunk's output to come round the pipeline; more than M do not exist"
        )
    if 0 < m % g < p:
        raise ValueError(
            f"the remainder of M={m} divided by the microbatch group size {g} is {m % g}; it must "
            f"be 0 or at least PP={p}, otherwise the final group introduces dependency bubbles "
            "in the pipeline (megatron-core rejects this)"
        )


def megatron_schedule_table(
    *, num_microbatches: int, num_model_chunks: int, microbatch_group_size: int
) -> list[tuple[int, int]]:
    """(microbatch, local chunk) of each forward step, as megatron's `get_schedule_table`:
    groups of `microbatch_group_size` microbatches run through chunk 0, then chunk 1, ...; the
    last group takes all remaining microbatches."""
    table: list[tuple[int, int]] = []
    m, g = num_microbatches, microbatch_group_size
    for first in range(0, m, g):
        last = m if first + g >= m else first + g
        table += [(mb, c) for c in range(num_model_chunks) for mb in range(first, last)]
    return table


def megatron_interleaved_order(
    *,
    num_ranks: int,
    num_model_chunks: int,
    num_microbatches: int,
    rank: int,
    microbatch_group_size: int | None = None,
) -> list[OrderEntry]:
    """Rank `rank`'s steps in Megatron's interleaved 1F1B schedule.

    `microbatch_group_size` defaults to `num_ranks`, as in megatron's `ModelParallelConfig`.
    Warm-up: 2 * (P - rank - 1) + (V - 1) * group forwards (all of them if that is more than
    V * M); then alternate one forward and one backward; then the remaining backwards.
    Backward step k runs chunk V - 1 - chunk(k) on microbatch(k) of the forward table.
    With P = 1 megatron runs `forward_backward_no_pipelining` instead, which has no model
    chunks: V = 1 gives its order (that of `megatron_1f1b_order`), V > 1 is rejected.
    """
    _check_rank(num_ranks, rank)
    if num_model_chunks < 1:
        raise ValueError(f"need at least one model chunk, got {num_model_chunks}")
    if num_ranks == 1:
        if num_model_chunks > 1:
            raise ValueError(
                "with one pipeline rank megatron-core runs forward_backward_no_pipelining, "
                f"which does not support model chunking (got {num_model_chunks} chunks)"
            )
        return megatron_1f1b_order(num_ranks=1, num_microbatches=num_microbatches, rank=0)
    group = num_ranks if microbatch_group_size is None else microbatch_group_size
    check_interleaved_args(
        num_ranks=num_ranks, num_microbatches=num_microbatches, microbatch_group_size=group
    )
    table = megatron_schedule_table(
        num_microbatches=num_microbatches,
        num_model_chunks=num_model_chunks,
        microbatch_group_size=group,
    )
    total = len(table)
    warmup = min(2 * (num_ranks - rank - 1) + (num_model_chunks - 1) * group, total)

    def fwd(k: int) -> OrderEntry:
        return (True, table[k][1], table[k][0])

    def bwd(k: int) -> OrderEntry:
        return (False, num_model_chunks - 1 - table[k][1], table[k][0])

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def _check_rank(num_ranks: int, rank: int) -> None:
    if num_ranks < 1 or not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} outside a pipeline of {num_ranks} ranks")


# ---------------------------------------------------------------------------------------------
# Plans


def _check_stage_units(
    placement: Placement, stage_units: Sequence[Sequence[Sequence[tuple[str, int]]]], v: int
) -> None:
    if len(stage_units) != placement.num_ranks:
        raise ValueError(
            f"stage_units has {len(stage_units)} ranks, placement has {placement.num_ranks}"
        )
    seen: dict[tuple[str, int], int] = {}
    for r, stages in enumerate(stage_units):
        if len(stages) != v:
            raise ValueError(f"rank {r} has {len(stages)} virtual stages, expected {v}")
        for units in stages:
            for module, chunk in units:
                try:
                    owner = placement.rank_of(module, chunk)
                except (KeyError, IndexError):
                    raise ValueError(f"unit {module}{chunk} is not in the placement") from None
                if owner != r:
                    raise ValueError(f"unit {module}{chunk} is placed on another rank than {r}")
                if (module, chunk) in seen:
                    raise ValueError(f"unit {module}{chunk} appears twice in stage_units")
                seen[(module, chunk)] = r
    for m in placement.modules:
        for c in m.chunks:
            if (m.name, c.index) not in seen:
                raise ValueError(f"chunk {m.name}{c.index} is in no virtual stage")


def _check_one_sub_each(
    placement: Placement,
    submicrobatches: Sequence[SubMicrobatch],
    microbatches: Sequence[MicrobatchInfo],
) -> None:
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for s in submicrobatches:
        counts[(s.module, s.microbatch)] += 1
    for mb in microbatches:
        for m in placement.modules:
            if counts[(m.name, mb.index)] > 1:
                raise ValueError(
                    f"module {m.name} has {counts[(m.name, mb.index)]} sub-microbatches in "
                    f"microbatch {mb.index}; Megatron's schedules run at most one"
                )


def _expand(
    steps: list[OrderEntry],
    units: Sequence[Sequence[tuple[str, int]]],
    microbatches: list[int],
    df: Dataflow,
    forward_only: bool,
) -> list[Forward | Backward]:
    """One rank's compute order: each step runs its virtual stage's units (reversed backward)."""
    order: list[Forward | Backward] = []
    present = {(w.module, w.microbatch) for w in df.works}
    for is_fwd, j, i in steps:
        for module, chunk in units[j] if is_fwd else reversed(units[j]):
            if (module, microbatches[i]) not in present:
                continue  # the module has no work in this microbatch (e.g. no images)
            stage = StageId(module, chunk, microbatches[i], 0)
            if is_fwd:
                order.append(Forward(stage))
            elif not forward_only and df.needs_backward(module):
                order.append(Backward(stage))
    return order


def build_megatron_plan(
    *,
    placement: Placement,
    stage_units: Sequence[Sequence[Sequence[tuple[str, int]]]],
    submicrobatches: Sequence[SubMicrobatch],
    dependencies: Sequence[Dependency],
    microbatches: Sequence[MicrobatchInfo],
    totals: BatchTotals,
    num_model_chunks: int,
    tensors: TensorFn | None = None,
    microbatch_group_size: int | None = None,
    interleaved: bool | None = None,
    iteration: int = 0,
    forward_only: bool = False,
    name: str | None = None,
    compute_time: ComputeTimeFn | None = None,
) -> Plan:
    """A plan running Megatron's stock schedule on a (possibly multi-module) placement.

    `compute_time` (rank, instruction) -> seconds lets the communication pass place messages by
    the real stage durations (as for DIP plans), so a simulated baseline is not slowed by
    messages placed for unit durations.

    `stage_units[r][j]` lists the (module, chunk) units virtual stage j of rank r runs back to
    back in forward (reversed in backward), e.g. stock Megatron LLaVA puts the whole ViT and
    LLM chunk 0 in rank 0's stage. Every module has at most one sub-microbatch per microbatch
    (none where it has no work, like the ViT on a text-only microbatch).
    The order is interleaved 1F1B when `interleaved` (default: `num_model_chunks > 1`), else
    1F1B (which needs `num_model_chunks == 1`). Backwards are left
    out for modules that need none, and all of them when `forward_only` (megatron's forward-only
    order is the training order's forwards).
    """
    interleaved = num_model_chunks > 1 if interleaved is None else interleaved
    if not interleaved and num_model_chunks != 1:
        raise ValueError(f"1F1B runs one model chunk per rank, got {num_model_chunks}")
    _check_stage_units(placement, stage_units, num_model_chunks)
    _check_one_sub_each(placement, submicrobatches, microbatches)
    df = Dataflow(placement, submicrobatches, dependencies)
    p, mbs = placement.num_ranks, [mb.index for mb in microbatches]
    compute: list[list[Forward | Backward]] = []
    for r in range(p):
        if not interleaved:
            steps = megatron_1f1b_order(num_ranks=p, num_microbatches=len(mbs), rank=r)
        else:
            steps = megatron_interleaved_order(
                num_ranks=p,
                num_model_chunks=num_model_chunks,
                num_microbatches=len(mbs),
                rank=r,
                microbatch_group_size=microbatch_group_size,
            )
        compute.append(_expand(steps, stage_units[r], mbs, df, forward_only))
    programs = add_communication(
        compute, df, tensors=tensors or default_tensors, compute_time=compute_time
    )
    return Plan(
        iteration=iteration,
        placement=placement,
        microbatches=tuple(microbatches),
        submicrobatches=tuple(submicrobatches),
        dependencies=tuple(dependencies),
        totals=totals,
        programs=programs,
        forward_only=forward_only,
        name=name or ("megatron-interleaved" if interleaved else "megatron-1f1b"),
    )


def _single_module_plan(
    *,
    num_ranks: int,
    num_model_chunks: int,
    num_microbatches: int,
    microbatch_group_size: int | None,
    interleaved: bool,
    tensors: TensorFn | None,
    iteration: int,
    name: str,
) -> Plan:
    p, v, m = num_ranks, num_model_chunks, num_microbatches
    chunks = tuple(ChunkSpec("model", c, c % p, c, c + 1) for c in range(p * v))
    placement = Placement(p, (ModuleLayout("model", p * v, True, chunks),))
    return build_megatron_plan(
        placement=placement,
        stage_units=[[[("model", j * p + r)] for j in range(v)] for r in range(p)],
        submicrobatches=[SubMicrobatch("model", i, 0, 0, 1, 1, 1) for i in range(m)],
        dependencies=(),
        microbatches=[MicrobatchInfo(i, (i,), 1) for i in range(m)],
        totals=BatchTotals(num_microbatches=m, num_samples=m, num_loss_tokens=m),
        num_model_chunks=v,
        tensors=tensors,
        microbatch_group_size=microbatch_group_size,
        interleaved=interleaved,
        iteration=iteration,
        name=name,
    )


def build_1f1b_plan(
    *,
    num_ranks: int,
    num_microbatches: int,
    tensors: TensorFn | None = None,
    iteration: int = 0,
) -> Plan:
    """Megatron's 1F1B on a one-module model "model" of `num_ranks` one-layer chunks."""
    return _single_module_plan(
        num_ranks=num_ranks,
        num_model_chunks=1,
        num_microbatches=num_microbatches,
        microbatch_group_size=None,
        interleaved=False,
        tensors=tensors,
        iteration=iteration,
        name="megatron-1f1b",
    )


def build_interleaved_plan(
    *,
    num_ranks: int,
    num_model_chunks: int,
    num_microbatches: int,
    microbatch_group_size: int | None = None,
    tensors: TensorFn | None = None,
    iteration: int = 0,
) -> Plan:
    """Megatron's interleaved 1F1B on a one-module model "model" of P*V one-layer chunks,
    chunk c on rank c mod P (local chunk j of rank r is global chunk j*P + r)."""
    return _single_module_plan(
        num_ranks=num_ranks,
        num_model_chunks=num_model_chunks,
        num_microbatches=num_microbatches,
        microbatch_group_size=microbatch_group_size,
        interleaved=True,
        tensors=tensors,
        iteration=iteration,
        name="megatron-interleaved",
    )
