"""In-run calibration of the cost model from measured compute times, window by window.

Every iteration each rank measures the seconds of its Forward/Backward instructions; the training
loop all-gathers them (summed per module over every rank, so each rank holds the same numbers)
together with the cost model's *uncalibrated* prediction of the same instructions. `Calibration`
sums both per module over `window` iterations and then sets each module's scale to
measured / predicted of that window (the least-squares factor of a sum, and robust to the
per-instruction noise that a per-iteration ratio would chase). The update is a pure function of
the gathered numbers, so every rank arrives at bit-identical scales at the same iteration; the
planner service receives them as a plain dict and applies `CostModel.calibrated`.

Each update increments `version` (0 = the loaded cost model, unscaled). A frozen calibration never
changes: plans then depend only on the seed, the batch and the loaded cost model (and the scales a
checkpoint carried). One scale per module, not per direction: `CostModel.calibrated` scales
forward and backward of a module together (the analytic backward/forward ratio of 2 stays).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


def model_error(
    measured: Mapping[str, float], predicted: Mapping[str, float], scales: Mapping[str, float]
) -> float | None:
    """Relative error of the calibrated prediction of one iteration's compute time:
    sum over modules |scale * predicted - measured| / sum of measured (None if nothing ran).

    `predicted` is the uncalibrated cost model's time; scaling it by a module's factor is exactly
    what `CostModel.calibrated` does to every stage time of that module.
    """
    total = sum(v for v in measured.values() if v > 0)
    if total <= 0:
        return None
    miss = sum(
        abs(scales.get(m, 1.0) * predicted.get(m, 0.0) - measured.get(m, 0.0))
        for m in set(measured) | set(predicted)
    )
    return miss / total


@dataclass
class Calibration:
    """Per-module measured / predicted scale factors, updated once per window (module docstring).

    `window` iterations are accumulated before each update; `frozen` disables updates (and
    accumulation) entirely. State: scales, version and the partial window's sums, all restored
    from checkpoints so a resumed run updates at the same iterations with the same numbers.
    """

    window: int = 8
    frozen: bool = False
    scales: dict[str, float] = field(default_factory=dict)
    version: int = 0
    measured_sum: dict[str, float] = field(default_factory=dict)
    predicted_sum: dict[str, float] = field(default_factory=dict)
    count: int = 0  # iterations in the current (partial) window

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"--dip-calibration-window must be >= 1, got {self.window}")

    def observe(self, measured: Mapping[str, float], predicted: Mapping[str, float]) -> bool:
        """Add one iteration's gathered per-module seconds (measured, uncalibrated prediction);
        at the end of a window update the scales. True when the scales changed."""
        if self.frozen:
            return False
        for m, v in measured.items():
            self.measured_sum[m] = self.measured_sum.get(m, 0.0) + float(v)
        for m, v in predicted.items():
            self.predicted_sum[m] = self.predicted_sum.get(m, 0.0) + float(v)
        self.count += 1
        if self.count < self.window:
            return False
        scales = dict(self.scales)
        for m in sorted(self.measured_sum):
            seconds, p = self.measured_sum[m], self.predicted_sum.get(m, 0.0)
            if seconds > 0 and p > 0:  # a module that did not run keeps its old factor
                scales[m] = seconds / p
        self.measured_sum, self.predicted_sum, self.count = {}, {}, 0
        if scales == self.scales:
            return False
        self.scales = scales
        self.version += 1
        return True

    def error(self, measured: Mapping[str, float], predicted: Mapping[str, float]) -> float | None:
        """`model_error` of one iteration under the scales now in force."""
        return model_error(measured, predicted, self.scales)

    def ratio(self, measured: Mapping[str, float], predicted: Mapping[str, float]) -> float | None:
        """Calibrated predicted / measured compute time of one iteration, all modules together
        (None if nothing ran): 1.0 is a perfect total, unlike the error it shows the direction."""
        total = sum(v for v in measured.values() if v > 0)
        if total <= 0:
            return None
        return sum(self.scales.get(m, 1.0) * v for m, v in predicted.items()) / total

    def covers(self, model) -> bool:
        """Whether every module of `model` (a `MultimodalSpec`) has a measured factor."""
        return all(m.name in self.scales for m in model.modules)

    def apply(self, cost_model):
        """`cost_model` scaled by the current factors (itself when there are none)."""
        return cost_model.calibrated(self.scales) if self.scales else cost_model

    def state_dict(self) -> dict:
        """JSON-serialisable state (floats round-trip exactly through JSON)."""
        return {
            "scales": dict(self.scales),
            "version": self.version,
            "measured_sum": dict(self.measured_sum),
            "predicted_sum": dict(self.predicted_sum),
            "count": self.count,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore `state_dict` output (older checkpoints hold only "scales"); `window` and
        `frozen` stay as configured by this run's flags."""

        def floats(key: str) -> dict[str, float]:
            return {str(k): float(v) for k, v in state.get(key, {}).items()}

        scales = floats("scales")
        bad = {k: v for k, v in scales.items() if not v > 0}
        if bad:
            raise ValueError(f"checkpoint calibration has non-positive scale factors {bad}")
        self.scales = scales
        self.version = int(state.get("version", 1 if scales else 0))
        self.measured_sum = floats("measured_sum")
        self.predicted_sum = floats("predicted_sum")
        self.count = int(state.get("count", 0))
