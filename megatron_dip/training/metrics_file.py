"""`--dip-metrics-json`: one JSON line per iteration on the logging rank, for tools.

Each line holds what `tools/bench_schedules.py` tabulates: the measured schedule time (slowest
rank, barrier-free), the whole iteration's time, the loss, which kind of plan ran, and, under
--dip-emulate-compute, the simulator's prediction of the emulated iteration (the plan simulated
with the cost model times the emulation scale, the runtime's channel semantics) and its
bubble-free bound (the busiest rank's compute).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_dip.planner.simulator import SimResult, simulate
from megatron_dip.schedule.engine import per_peer_channel, single_channel
from megatron_dip.schedule.ir import Plan

from .validate import RunSpec


def emulated_simulation(spec: RunSpec, plan: Plan) -> SimResult:
    """`plan` simulated as the emulated run executes it (iteration time, bound, ...)."""
    from megatron_dip.emulation.timing import ScaledCostModel

    cost = ScaledCostModel(spec.cost_model, spec.emulate_scale or 0.0)
    # DIP's executor gives each (sender, receiver) pair a communicator; Megatron's schedules
    # use one per pipeline group.
    channel = single_channel if spec.is_stock else per_peer_channel
    return simulate(plan, cost, channel=channel)


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line to `path` (created with its directory)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
