"""Stop a run whose loss or gradient norm stays non-finite, instead of skipping updates forever.

A NaN or infinite loss (or gradient norm) makes the optimizer skip the update (or, without a
check, write NaN into the weights); a run in that state only burns its allocation and then exits
0. `NonFiniteStreak` counts consecutive non-finite iterations (the loss and the norm are global:
every rank sees the same numbers and stops at the same iteration) and raises `NonFiniteError`
naming them after --dip-max-nonfinite-iters of them (0: never).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class NonFiniteError(RuntimeError):
    """The loss or gradient norm was non-finite for too many consecutive iterations."""


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


@dataclass
class NonFiniteStreak:
    """Consecutive non-finite iterations (module docstring)."""

    limit: int
    first: int | None = None
    count: int = 0

    def observe(self, iteration: int, *, loss: float, grad_norm: float | None) -> None:
        """Record one iteration; raises `NonFiniteError` when the streak reaches the limit."""
        if _finite(loss) and _finite(grad_norm):
            self.first, self.count = None, 0
            return
        if self.first is None:
            self.first = iteration
        self.count += 1
        if self.limit and self.count >= self.limit:
            raise NonFiniteError(
                f"iterations {self.first}-{iteration}: loss {loss}, grad norm {grad_norm}: "
                f"non-finite for {self.count} consecutive iterations "
                f"(--dip-max-nonfinite-iters {self.limit}); stopping without saving. Resume "
                "from the last checkpoint, e.g. with a lower --lr"
            )
