"""`schedule.ir.MemoryPolicy`: the plan's one memory value (recomputation and offload) on every
`Forward`, its checks, and the plan validation of a policy against its chunk."""

from __future__ import annotations

import re

import pytest

from megatron_dip.schedule.ir import (
    NO_RECOMPUTE,
    Backward,
    BatchTotals,
    ChunkSpec,
    Forward,
    MemoryPolicy,
    MicrobatchInfo,
    ModuleLayout,
    Placement,
    Plan,
    Program,
    Recompute,
    StageId,
    SubMicrobatch,
)
from megatron_dip.schedule.validate import PlanError, validate_plan

STAGE = StageId("vit", 0, 0, 0)


@pytest.mark.parametrize(
    ("policy", "label"),
    [
        (NO_RECOMPUTE, "none"),
        (MemoryPolicy(Recompute.SELECTIVE), "selective"),
        (MemoryPolicy(Recompute.FULL), "full"),
        (MemoryPolicy(Recompute.BLOCK, 2), "block2"),
        (MemoryPolicy(Recompute.UNIFORM, 1), "uniform1"),
        (MemoryPolicy(Recompute.NONE, 0, 3), "off3"),
        (MemoryPolicy(Recompute.BLOCK, 1, 2), "block1+off2"),
    ],
)
def test_valid_policies_check_and_label(policy: MemoryPolicy, label: str) -> None:
    assert policy.check() is policy
    assert policy.label == str(policy) == label
    assert Forward(STAGE, policy).memory is policy
    assert policy.recompute_only == MemoryPolicy(policy.method, policy.layers)
    assert policy.recompute_only.with_offload(policy.offload) == policy


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (MemoryPolicy(Recompute.BLOCK, 0), "block takes N >= 1 layers"),
        (MemoryPolicy(Recompute.UNIFORM, 0), "uniform takes N >= 1 layers"),
        (MemoryPolicy(Recompute.NONE, 2), "none takes no layers"),
        (MemoryPolicy(Recompute.FULL, 0, 1), "only none and block recompute combine with offload"),
        (MemoryPolicy(Recompute.SELECTIVE, 0, 1), "only none and block"),
        (MemoryPolicy(Recompute.NONE, 0, -1), "offload K >= 0"),
    ],
)
def test_a_forward_refuses_a_policy_its_numbers_do_not_fit(policy, message) -> None:
    with pytest.raises(ValueError, match=message):
        policy.check()
    with pytest.raises(ValueError, match=re.escape(f"Forward {STAGE}: memory policy")):
        Forward(STAGE, policy)


def test_a_policy_is_one_value_never_a_tuple() -> None:
    """The old `(method, N)` tuples neither construct a Forward nor compare equal to a policy,
    so no leftover tuple can silently stand for one."""
    with pytest.raises(TypeError, match="memory must be a MemoryPolicy"):
        Forward(STAGE, (Recompute.FULL, 0))  # type: ignore[arg-type]
    assert NO_RECOMPUTE != (Recompute.NONE, 0)
    assert MemoryPolicy(Recompute.BLOCK, 2) != (Recompute.BLOCK, 2)
    with pytest.raises(TypeError):
        method, layers, offload = NO_RECOMPUTE  # type: ignore[misc]
    # Values: equal policies hash alike (dict keys of the memory pass and the cost model's cache).
    assert {MemoryPolicy("block", 2): 1}[MemoryPolicy(Recompute.BLOCK, 2)] == 1
    assert MemoryPolicy("none") is not NO_RECOMPUTE and MemoryPolicy("none") == NO_RECOMPUTE


def test_offload_starts_after_the_block_recomputed_layers() -> None:
    assert MemoryPolicy(Recompute.NONE, 0, 2).offload_start == 0
    assert MemoryPolicy(Recompute.BLOCK, 3, 2).offload_start == 3
    MemoryPolicy(Recompute.BLOCK, 3, 2).check(num_layers=5)
    with pytest.raises(ValueError, match="offloads past the chunk's 4 layers"):
        MemoryPolicy(Recompute.BLOCK, 3, 2).check(num_layers=4)
    # A uniform setting fitted to a chunk: its offload clamped to the layers after block N.
    assert MemoryPolicy(Recompute.BLOCK, 3, 2).fitted(4) == MemoryPolicy(Recompute.BLOCK, 3, 1)
    assert MemoryPolicy(Recompute.BLOCK, 3, 2).fitted(2) == MemoryPolicy(Recompute.BLOCK, 3)
    assert MemoryPolicy(Recompute.NONE, 0, 2).fitted(8) == MemoryPolicy(Recompute.NONE, 0, 2)


def test_plan_validation_checks_a_policy_against_its_chunk() -> None:
    """A Forward that offloads more layers than its chunk has is a plan error naming where."""
    chunk = ChunkSpec("vit", 0, 0, 0, 2)
    placement = Placement(1, (ModuleLayout("vit", 2, True, (chunk,)),))

    def plan_with(policy: MemoryPolicy) -> Plan:
        return Plan(
            iteration=0,
            placement=placement,
            microbatches=(MicrobatchInfo(0, (0,), 4),),
            submicrobatches=(SubMicrobatch("vit", 0, 0, 0, 1, 4, 16),),
            dependencies=(),
            totals=BatchTotals(1, 4, 4),
            programs=(Program(0, (Forward(STAGE, policy), Backward(STAGE))),),
            name="one forward",
        )

    validate_plan(plan_with(MemoryPolicy(Recompute.NONE, 0, 2)))
    with pytest.raises(PlanError, match="offloads past the chunk's 2 layers"):
        validate_plan(plan_with(MemoryPolicy(Recompute.BLOCK, 1, 2)))
