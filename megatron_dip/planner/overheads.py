"""Host time the runtime spends per instruction, per posted batch of messages and per message.

A plan's compute is priced by the cost model, but every instruction also costs the host: Python,
autograd and the kernel launches around a Forward/Backward, the call that posts a batch of
sends/receives, and the latency a message adds on top of its bytes' transfer time. On a GPU
these are tens of microseconds; in the CPU-emulated cluster they are milliseconds
(docs/design.md, "Emulated clusters"). Ignored, they make the planner favour many tiny instructions.

`HostOverheads` holds the three numbers. `CostModel(overheads=...)` carries them, the planner's
stage graph adds `instruction` to every compute duration and `message` to every transfer, and
`simulate` charges all three (`batch` on the posting rank's clock, `message` on the message) when
the caller passes none. The cost model's `stage_cost` stays compute only: emulated chunks sleep
it, bounds and placements are priced on it.

Measured by `tools/measure_overhead.py` (`megatron_dip.benchmark.overhead`) and stored as JSON
(`OVERHEADS_FORMAT`); training loads it with `--dip-host-overheads FILE`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OVERHEADS_FORMAT = "megatron-dip-host-overheads/1"


@dataclass(frozen=True)
class HostOverheads:
    """Host seconds: per compute instruction (`instruction`), per posted batch of
    sends/receives on the posting rank (`batch`), and per message on top of its transfer time
    (`message`). All zero: the cost model prices compute and bytes only."""

    instruction: float = 0.0
    batch: float = 0.0
    message: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"host overhead {name!r} must be a finite number >= 0, got {value}"
                )

    @property
    def is_zero(self) -> bool:
        return self.instruction == 0 and self.batch == 0 and self.message == 0

    def scaled(self, factor: float) -> HostOverheads:
        """Every term times `factor` (e.g. host seconds in an emulated run's time units)."""
        return HostOverheads(self.instruction * factor, self.batch * factor, self.message * factor)

    def instruction_times(self, forward: float, backward: float) -> tuple[float, float]:
        """(forward, backward) durations of a stage's two compute instructions: its compute
        seconds plus the host time of each instruction."""
        return forward + self.instruction, backward + self.instruction

    def per_pass(self, instructions: int) -> float:
        """Host seconds of `instructions` compute instructions, each next to about one posted
        batch of messages (what one sub-microbatch's pass through a pipelined module costs)."""
        return instructions * (self.instruction + self.batch)


NO_OVERHEADS = HostOverheads()


def host_overheads(cost_model: Any) -> HostOverheads:
    """The overheads `cost_model` charges (zero for stand-ins that carry none)."""
    found = getattr(cost_model, "overheads", None)
    return found if isinstance(found, HostOverheads) else NO_OVERHEADS


@dataclass(frozen=True)
class OverheadsFile:
    """What `tools/measure_overhead.py` writes: the fitted DIP executor overheads, the same fit
    for Megatron-Core's stock schedules, and how they were measured."""

    dip: HostOverheads
    stock: HostOverheads | None = None
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {"format": OVERHEADS_FORMAT, "dip": asdict(self.dip)}
        if self.stock is not None:
            out["stock"] = asdict(self.stock)
        out["details"] = self.details
        return out


def _parse_terms(raw: Any, where: str) -> HostOverheads:
    if not isinstance(raw, dict) or set(raw) - {"instruction", "batch", "message"}:
        raise ValueError(f"{where} must map instruction/batch/message to seconds, got {raw!r}")
    return HostOverheads(**{k: float(v) for k, v in raw.items()})


def load_overheads(path: str | Path) -> OverheadsFile:
    """Read an overheads JSON (`OVERHEADS_FORMAT`); `ValueError` names the file and the fault."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != OVERHEADS_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is not a {OVERHEADS_FORMAT} file (format: {found!r})")
    try:
        dip = _parse_terms(data.get("dip"), f"{path}: 'dip'")
        stock = _parse_terms(data["stock"], f"{path}: 'stock'") if "stock" in data else None
    except (TypeError, ValueError) as e:
        text = str(e)
        raise ValueError(text if text.startswith(str(path)) else f"{path}: {text}") from None
    return OverheadsFile(dip, stock, dict(data.get("details") or {}))


def save_overheads(path: str | Path, overheads: OverheadsFile) -> None:
    """Write `overheads` as JSON (`load_overheads` reads it back)."""
    Path(path).write_text(json.dumps(overheads.to_json(), indent=2) + "\n")


__all__ = [
    "NO_OVERHEADS",
    "OVERHEADS_FORMAT",
    "HostOverheads",
    "OverheadsFile",
    "host_overheads",
    "load_overheads",
    "save_overheads",
]
