"""The split and loss-token counts of samples with arrays (reference runs, runtime, tests).

The planner splits metadata; runs that hold the samples themselves derive the same metadata from
the arrays (`data.meta.sample_meta`) and split it the same way, so a reference run splits
exactly as plans do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_dip.data.meta import sample_meta
from megatron_dip.data.sample import Sample
from megatron_dip.modalities import modality_of
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.schedule.ir import SubMicrobatch

from .split import WHOLE, split_microbatch


def split_samples(
    model: MultimodalSpec,
    samples: Sequence[Sample],
    *,
    microbatch: int,
    seq_length: int,
    sizes: Mapping[str, int] | None = None,
    pad_multiple: int = 1,
) -> tuple[SubMicrobatch, ...]:
    """Sub-microbatches of every module for one microbatch of `samples`: `split_microbatch` on
    their metadata. `sizes[module]` instances per sub-microbatch at most (default: all in one)."""
    metas = [sample_meta(s, model=model) for s in samples]
    sub_sizes = {m.name: (sizes or {}).get(m.name, WHOLE) for m in model.modules}
    work = split_microbatch(
        model,
        metas,
        index=microbatch,
        seq_length=seq_length,
        sub_sizes=sub_sizes,
        pad_multiple=pad_multiple,
    )
    return work.submicrobatches


def loss_tokens_of(
    model: MultimodalSpec, samples: Sequence[Sample], sub: SubMicrobatch | None = None
) -> int:
    """Tokens of `samples` (one microbatch, in order) that carry a loss: exactly the
    "num_tokens" the loss module's last chunk reports for them. With `sub`, a sub-microbatch of
    the loss module, only its instances count. Equals the sum of the samples'
    `SampleMeta.loss_tokens`."""
    module = model.loss_module
    modality = modality_of(module)
    if sub is None:
        return sum(modality.sample_loss_tokens(module, model, s) for s in samples)
    if sub.module != module.name:
        raise ValueError(f"{sub.work} is not a sub-microbatch of loss module {module.name}")
    return modality.microbatch_loss_tokens(module, model, samples, sub)
