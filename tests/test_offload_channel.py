"""Activation offload as the runtime copies: the engine's per-rank copy channels, where reloads
start (`schedule.prefetch`) and what the simulator's memory timeline holds meanwhile."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from megatron_dip.planner.cost_model import StageCost
from megatron_dip.planner.simulator import simulate
from megatron_dip.schedule.baselines import build_1f1b_plan
from megatron_dip.schedule.engine import execute_programs
from megatron_dip.schedule.ir import (
    Backward,
    BackwardWeight,
    Forward,
    MessageKey,
    MessageKind,
    Program,
    Send,
    StageId,
    Wait,
)
from megatron_dip.schedule.prefetch import reload_points

A, B = StageId("m", 0, 0), StageId("m", 0, 1)


def _run(instructions: tuple, copies: dict) -> tuple[dict, list]:
    """One rank's compute spans by instruction and its copies: forwards last 1 s, backwards 2 s;
    `copies[(kind, stage)]` = (lead or window, seconds)."""
    program = Program(0, instructions)
    result = execute_programs(
        [program],
        compute_time=lambda r, ins: 1.0 if isinstance(ins, Forward) else 2.0,
        host_copy=lambda r, ins: copies.get((type(ins), ins.stage), (0.0, 0.0)),
    )
    spans = {instructions[i]: (s, e) for i, s, e in result.spans[0]}
    return spans, result.copies[0]


def test_reloads_start_at_the_compute_instruction_before_the_backward() -> None:
    """Not at the stage's own forward (nothing is offloaded before it ends); messages and waits
    in between do not count; a split backward's W is a compute instruction."""
    key = MessageKey(MessageKind.ACTIVATION, A, StageId("n", 0, 0))
    fa, fb, ba, bb, wa = Forward(A), Forward(B), Backward(A), Backward(B), BackwardWeight(A)
    assert reload_points([fa, ba]) == {}
    assert reload_points([fa, fb, Send(key, 1, ()), Wait((key,)), ba, bb]) == {1: 4, 4: 5}
    assert reload_points([fa, fb, bb, ba]) == {2: 3}
    assert reload_points([fa, fb, ba, wa, bb]) == {1: 2, 3: 4}


def test_copy_out_outlasting_its_forward_delays_nothing_and_reloads_queue_behind_it() -> None:
    """A forward whose copy out outlasts it ends on time; the next copy out queues behind it on
    the rank's channel, a reload waits for its stage's copy out, and the backward waits for its
    reload; a reload started by the instruction before the backward queues behind that
    instruction's own."""
    fa, fb, bb, ba = Forward(A), Forward(B), Backward(B), Backward(A)
    copies = {
        (Forward, A): (0.5, 3.0),
        (Forward, B): (0.5, 1.0),
        (Backward, B): (0.5, 1.0),
        (Backward, A): (0.5, 3.0),
    }
    spans, channel = _run((fa, fb, bb, ba), copies)
    assert spans[fa] == (0.0, 1.0) and spans[fb] == (1.0, 2.0)  # never waits for a copy out
    # copy out A [0.5, 3.5], then B's queued [3.5, 4.5]; B's reload after its copy out [4.5,
    # 5.5]; A's reload (started with B's backward, after B's own) [5.5, 8.5].
    assert channel == [(0, 0.5, 3.5), (1, 3.5, 4.5), (2, 4.5, 5.5), (3, 5.5, 8.5)]
    assert spans[bb] == pytest.approx((2.0, 7.0))  # needs its reload 0.5 s in: 3 s late
    assert spans[ba] == pytest.approx((7.0, 10.0))  # 1 s late


def test_a_reload_started_at_the_previous_instruction_hides_behind_it() -> None:
    """A's reload starts with B's forward (once A's copy out is done) and is back before A's
    backward needs it; B's starts with A's backward: neither backward waits."""
    fa, fb, ba, bb = Forward(A), Forward(B), Backward(A), Backward(B)
    copies = {(k, s): (0.5, 1.0) for k in (Forward, Backward) for s in (A, B)}
    spans, channel = _run((fa, fb, ba, bb), copies)
    assert spans[ba] == (2.0, 4.0) and spans[bb] == (4.0, 6.0)
    reloads = [c for c in channel if c[0] >= 2]
    assert reloads == [(2, 1.5, 2.5), (3, 2.5, 3.5)]
    # Right after its own forward, the reload starts as the backward does (once the copy out
    # is done, at 1.5) and the backward waits for it: 1 s late.
    alone, _ = _run((fa, ba), copies)
    assert alone[ba] == (1.0, 4.0)


@dataclass(frozen=True)
class _Offloading:
    """Every stage: 1 s forward, 2 s backward, 100 bytes kept of which the copy out has moved
    all but 10 when the forward ends in the cost model's estimate (50 offloaded, 40 back from
    the reload's start), copies of 1.5 s out and 0.5 s back."""

    def stage_cost(self, chunk, sub, memory=None) -> StageCost:
        return StageCost(
            1.0,
            2.0,
            100,
            copy_out=1.5,
            reload=0.5,
            reload_bytes=40,
            copy_bytes=50,
        )

    def transfer_time(self, nbytes: int) -> float:
        return 0.0


def test_memory_holds_uncopied_bytes_until_the_copy_and_reloads_from_their_start() -> None:
    """Rank 0 of 1F1B on two ranks runs F0 F1 B0 B1: B0's reload starts with F1, B1's with B0
    (their bytes held from then); F1's copy out queues behind F0's and ends at 3, so more of
    its bytes than the cost model's estimate are still on the device from F1's end until 3."""
    plan = build_1f1b_plan(num_ranks=2, num_microbatches=2)
    result = simulate(plan, _Offloading())
    spans = result.execution.spans[0]
    assert [(s, e) for _, s, e in spans][:2] == [(0.0, 1.0), (1.0, 2.0)]
    b0_start = spans[2][1]
    uncopied_f0 = int(50 * 0.5 / 1.5) - 10  # F0's copy [0, 1.5], its forward ends at 1
    uncopied_f1 = int(50 * 1.0 / 1.5) - 10  # F1's copy [1.5, 3], its forward ends at 2
    assert result.memory_timeline[0][:8] == (
        (1.0, 100),
        (1.0, 140),  # B0's reload starts with F1
        (1.0, 140 + uncopied_f0),
        (1.5, 140),
        (2.0, 240),
        (2.0, 240 + uncopied_f1),
        (3.0, 240),
        (b0_start, 280),  # B1's reload starts with B0
    )
    assert result.peak_activation_bytes[0] == 280
