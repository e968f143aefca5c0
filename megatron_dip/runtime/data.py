"""Where the executor gets each sub-microbatch's input data from.

Data tensors never travel between pipeline ranks: every rank builds the inputs of the
sub-microbatches its chunks compute on from the microbatch's samples (each modality's
`build_sub_batch`). The
executor asks a `BatchSource` for them and tells it when a sub-microbatch is no longer needed on
this rank, so cached masks and rotary tables are freed early.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from megatron_dip.schedule.ir import Plan, WorkId


class BatchSource(Protocol):
    """Inputs of sub-microbatches, built on demand."""

    def sub_batch(self, work: WorkId) -> Any:
        """The `batch=` argument of the chunks for sub-microbatch `work`."""

    def loss_tokens(self, work: WorkId) -> int:
        """Tokens of loss sub-microbatch `work` that carry a loss (the normalisation count)."""

    def release(self, work: WorkId) -> None:
        """`work` is not used on this rank any more."""


class SampleBatchSource:
    """Sub-batches built with `modalities.build_sub_batch` from each microbatch's samples.

    `samples[mb]` lists the samples of microbatch `mb` of `plan` in order; `seq_length` caps
    the LLM sequence; `seed` seeds diffusion noise with each sample's id.
    """

    def __init__(
        self,
        *,
        model: Any,
        plan: Plan,
        samples: Mapping[int, Sequence[Any]],
        seq_length: int,
        seed: int,
        device: torch.device | str | None = None,
    ) -> None:
        missing = [m.index for m in plan.microbatches if m.index not in samples]
        if missing:
            raise ValueError(f"no samples for microbatch(es) {missing} of plan {plan.name!r}")
        for m in plan.microbatches:
            ids = tuple(s.sample_id for s in samples[m.index])
            if ids != tuple(m.sample_ids):
                raise ValueError(
                    f"microbatch {m.index}: samples {ids}, the plan was made for {m.sample_ids}"
                )
        self.model = model
        self.plan = plan
        self.samples = samples
        self.seq_length = seq_length
        self.seed = seed
        self.device = device
        self._cache: dict[WorkId, Any] = {}

    def sub_batch(self, work: WorkId) -> Any:
        if work not in self._cache:
            from megatron_dip.modalities import build_sub_batch

            batch = build_sub_batch(
                self.model,
                self.samples[work.microbatch],
                self.plan.submicrobatch(work),
                seq_length=self.seq_length,
                seed=self.seed,
            )
            self._cache[work] = batch.to(self.device) if self.device is not None else batch
        return self._cache[work]

    def loss_tokens(self, work: WorkId) -> int:
        """From the samples alone (`batching.loss_tokens_of`): no sub-batch is built."""
        from megatron_dip.batching import loss_tokens_of

        return loss_tokens_of(
            self.model, self.samples[work.microbatch], self.plan.submicrobatch(work)
        )

    def release(self, work: WorkId) -> None:
        self._cache.pop(work, None)

    def cached(self) -> list[WorkId]:
        """Sub-microbatches currently held."""
        return list(self._cache)
