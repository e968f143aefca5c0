"""`--dip-metrics-json`: one JSON line per iteration on the logging rank, for tools.

Each line holds what `tools/bench_schedules.py` tabulates: the measured schedule time (slowest
rank, barrier-free), the whole iteration's time, the loss, which kind of plan ran, and the compute
backend's fields (`backend.ComputeBackend.metrics`): the emulation scale, and under
--dip-emulate-compute the simulator's prediction of the emulated iteration (the plan simulated
with the cost model times the emulation scale, on the channel model the iteration ran on) and its
bubble-free bound (the busiest rank's compute).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def append_record(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line to `path` (created with its directory)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
