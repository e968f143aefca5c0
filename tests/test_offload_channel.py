"""Activation offload as the runtime copies: the engine's per-rank copy channels (one per
direction), what the simulator's memory timeline holds while a copy out is queued, and the
reloads paced by the layers the backward frees (cost model and runtime)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from megatron_dip.planner.cost_model import StageCost
from megatron_dip.planner.offload_copies import reload_waits
from megatron_dip.planner.simulator import simulate
from megatron_dip.runtime.offload import ActivationOffload, offloaded_layers
from megatron_dip.schedule.baselines import build_1f1b_plan
from megatron_dip.schedule.engine import execute_programs
from megatron_dip.schedule.ir import (
    Backward,
    Forward,
    Program,
    StageId,
)

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


def test_copy_out_outlasting_its_forward_delays_nothing_and_reloads_wait_for_it() -> None:
    """A forward whose copy out outlasts it ends on time; the next copy out queues behind it on
    the rank's copy-out channel, a reload waits for its stage's copy out and behind the reloads
    before it, and the backward waits for its reload."""
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
    # 5.5]; A's as its backward starts [7, 10].
    assert channel == [(0, 0.5, 3.5), (1, 3.5, 4.5), (2, 4.5, 5.5), (3, 7.0, 10.0)]
    assert spans[bb] == pytest.approx((2.0, 7.0))  # needs its reload 0.5 s in: 3 s late
    assert spans[ba] == pytest.approx((7.0, 11.5))  # 2.5 s late


def test_a_reload_does_not_queue_behind_a_later_copy_out() -> None:
    """The link is full duplex: A's reload starts as its backward does, beside B's copy out
    (queued behind A's until 4.5), and hides behind the backward's first second."""
    fa, fb, ba = Forward(A), Forward(B), Backward(A)
    copies = {(Forward, A): (0.5, 1.0), (Forward, B): (0.5, 3.0), (Backward, A): (1.0, 1.0)}
    spans, channel = _run((fa, fb, ba), copies)
    assert channel == [(0, 0.5, 1.5), (1, 1.5, 4.5), (2, 2.0, 3.0)]
    assert spans[ba] == (2.0, 4.0)


@dataclass(frozen=True)
class _Offloading:
    """Every stage: 1 s forward, 2 s backward, 100 bytes kept after the forward, of which 10 are
    offloaded bytes the cost model expects the copy out not to have moved by then (50
    offloaded); copies of 1.5 s out (from the forward's start) and 0.5 s back."""

    def stage_cost(self, chunk, sub, memory=None) -> StageCost:
        return StageCost(1.0, 2.0, 100, copy_out=1.5, reload=0.5, copy_bytes=50, copy_residual=10)

    def transfer_time(self, nbytes: int) -> float:
        return 0.0


def test_memory_holds_what_a_queued_copy_out_has_not_moved() -> None:
    """Rank 0 of 1F1B on two ranks runs F0 F1 B0 B1: F0's copy out [0, 1.5] leaves a third of
    its bytes at its forward's end (1), F1's queues behind it [1.5, 3] and leaves two thirds at
    2; beyond the cost model's 10, they are held until their copy ends (messages of no bytes:
    no buffers in the timeline)."""
    plan = build_1f1b_plan(num_ranks=2, num_microbatches=2, tensors=lambda key: ())
    result = simulate(plan, _Offloading())
    spans = result.execution.spans[0]
    assert [(s, e) for _, s, e in spans][:2] == [(0.0, 1.0), (1.0, 2.0)]
    f0, f1 = spans[0][0], spans[1][0]
    assert result.execution.copies[0][:2] == [(f0, 0.0, 1.5), (f1, 1.5, 3.0)]
    left_f0 = int(50 * 0.5 / 1.5 - 10)
    left_f1 = int(50 * 1.0 / 1.5 - 10)
    assert result.memory_timeline[0][:6] == (
        (1.0, 100),
        (1.0, 100 + left_f0),
        (1.5, 100),
        (2.0, 200),
        (2.0, 200 + left_f1),
        (3.0, 200),
    )
    assert result.peak_activation_bytes[0] == 200 + left_f1


def testreload_waits_pace_reloads_by_the_freed_layers() -> None:
    """The cost model's reload waits (`reload_waits`): with layers after the offloaded ones,
    the second reload starts once the backward has freed one of them and hides; with none
    after, each starts as the backward reaches the offloaded layer after it and waits for what
    one layer's backward does not hide; the reload stream queues them in order."""
    # 2 offloaded, 4 after: the first (2 s) hides behind 4 s; the second, issued at 1 s after
    # the first (ready 4), is ready before the backward reaches it (5).
    assert reload_waits(2, 4, 2.0, 0.0, 1.0) == [0.0, 0.0]
    # None after: the first waits its whole reload (2.5), the others their excess (1 each).
    assert reload_waits(3, 0, 2.0, 0.5, 1.0) == pytest.approx([2.5, 1.0, 1.0])
    # 3 offloaded, 2 after, a stream too slow to keep up: the queue decides.
    assert reload_waits(3, 2, 2.0, 0.5, 1.0) == pytest.approx([0.5, 1.0, 1.0])
    # Chained one layer ahead (`paced=False`, issue 24g's runtime, the "chained" offer): the
    # first behind the layers after the offloaded ones, each later one behind one layer's
    # backward; never shorter waits than paced.
    assert reload_waits(2, 4, 2.0, 0.0, 1.0, paced=False) == [0.0, 1.0]
    assert reload_waits(3, 2, 2.0, 0.5, 1.0, paced=False) == pytest.approx([0.5, 1.0, 1.0])
    for case in [(2, 4, 2.0, 0.0, 1.0), (4, 1, 1.5, 0.2, 1.0), (3, 6, 0.9, 0.1, 1.0)]:
        paced, chained = reload_waits(*case), reload_waits(*case, paced=False)
        assert all(p <= c + 1e-12 for p, c in zip(paced, chained))


class _Layer(torch.nn.Module):
    """tanh(x W), logging ("reach", i) when the backward reaches its product's gradient."""

    def __init__(self, i: int, log: list) -> None:
        super().__init__()
        self.i, self.log = i, log
        self.weight = torch.nn.Parameter(torch.eye(4, dtype=torch.float64) * (1 + i / 10))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        y = hidden @ self.weight
        y.register_hook(lambda g: self.log.append(("reach", self.i)))
        return torch.tanh(y)


def test_the_layers_after_the_offloaded_ones_pace_the_reloads() -> None:
    """Offload of layers 0 and 1 of 4: the executor's prefetch brings layer 1 back as the
    backward starts, and layer 0's reload starts once the backward is through layer 3 (not as
    it reaches layer 1); the gradients are those without offload."""
    log: list = []
    chunk = torch.nn.Module()
    chunk.layers = torch.nn.ModuleList(_Layer(i, log) for i in range(4))

    def run(offload: bool) -> list:
        chunk.zero_grad(set_to_none=True)
        x = torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(2, 4).requires_grad_(True)
        record = ActivationOffload()
        reload = record._reload
        record._reload = lambda slot: (
            slot.reloaded is None and log.append(("reload", slot.layer)),  # a reload starts
            reload(slot),
        )
        with contextlib.ExitStack() as stack:
            if offload:
                stack.enter_context(offloaded_layers(chunk, 0, 2, record))
            hidden = x
            for layer in chunk.layers:
                hidden = layer(hidden)
        log.clear()
        record.prefetch()
        hidden.sum().backward()
        return [x.grad, *(p.grad for p in chunk.parameters())]

    plain = run(False)
    got = run(True)
    events = [e for i, e in enumerate(log) if i == 0 or e != log[i - 1]]
    assert events == [
        ("reload", 1),
        ("reach", 3),
        ("reload", 0),
        ("reach", 2),
        ("reach", 1),
        ("reach", 0),
    ]
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
