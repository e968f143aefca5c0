"""Stop a run whose loss or gradient norm stays non-finite, instead of skipping updates forever.

A NaN or infinite loss (or gradient norm) makes the optimizer skip the update (or, without a
check, write NaN into the weights); a run in that state only burns its allocation and then exits
0. `NonFiniteStreak` counts consecutive non-finite iterations (the loss and the norm are global:
every rank sees the same numbers and stops at the same iteration) and raises `NonFiniteError`
naming them after --dip-max-nonfinite-iters of them (0: never). `resume_advice` is what the stop
line adds: the last checkpoint whose weights have trained with a finite loss (the only kind the
tracker names) and the ones kept unpublished.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class NonFiniteError(RuntimeError):
    """The loss or gradient norm was non-finite for too many consecutive iterations."""


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


@dataclass
class NonFiniteStreak:
    """Consecutive non-finite iterations (module docstring)."""

    limit: int
    first: int | None = None
    count: int = 0

    def observe(self, iteration: int, *, loss: float, grad_norm: float | None) -> None:
        """Record one iteration; raises `NonFiniteError` when the streak reaches the limit."""
        if finite(loss) and finite(grad_norm):
            self.first, self.count = None, 0
            return
        if self.first is None:
            self.first = iteration
        self.count += 1
        if self.limit and self.count >= self.limit:
            raise NonFiniteError(
                f"iterations {self.first}-{iteration}: loss {loss}, grad norm {grad_norm}: "
                f"non-finite for {self.count} consecutive iterations "
                f"(--dip-max-nonfinite-iters {self.limit}); stopping"
            )


def resume_advice(
    verified: tuple[Path, int] | None, rejected: Sequence[Path], *, saving: bool
) -> str:
    """The end of the stop line: where to resume (`verified`: the newest checkpoint, with its
    iteration, whose weights have trained with a finite loss and gradient norm) and the
    checkpoints kept unpublished (`rejected`)."""
    lower = "e.g. with a lower --lr and --override-opt_param-scheduler"
    if verified is not None:
        path, iteration = verified
        text = (
            f". The last verified checkpoint is {path} (iteration {iteration}, its weights "
            f"trained with a finite loss): resume with --load {path.parent} --ckpt-step "
            f"{iteration}, {lower}"
        )
    elif saving:
        text = f". No checkpoint of this run trained with a finite loss: start again, {lower}"
    else:
        text = f". Resume from the last checkpoint, {lower}"
    if rejected:
        names = ", ".join(p.name for p in rejected)
        text += f"; kept unpublished (loading ignores them, their weights gave a non-finite loss): {names}"
    return text
