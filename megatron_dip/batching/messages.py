"""What crosses chunk boundaries: the names, shapes and dtypes of every message (torch-free).

The planner fills plans with these shapes, the runtime checks every sent tensor against them, and
the chunks produce exactly these tensors (tested). Chunk-to-chunk messages of one module and
hand-overs between modules are the modalities' (`Modality.chunk_message`, `Modality.hand_over`);
this module only resolves a `MessageKey` to the right one:

* between consecutive chunks of one sub-microbatch: the module's `chunk_message`, whose token
  dimension is a rank's share of the sequence (`ParallelShape.sequence_shard`: divided by the
  tensor-parallel size under sequence parallelism);
* from a producer's last chunk to its consumer's chunk 0: the producer's `hand_over` (a consumer
  chunk 0 receives one message per producer sub-microbatch it depends on, in dependency order);
* gradient messages carry the floating-point tensors of the activation message, same shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from megatron_dip.modalities import modality_of
from megatron_dip.modalities.base import INDEX_DTYPE
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.parallel import ONE_PROCESS, ParallelShape
from megatron_dip.schedule.ir import MessageKey, MessageKind, SubMicrobatch, TensorSpec, WorkId

SubLookup = Callable[[WorkId], SubMicrobatch]


def message_tensors(
    model: MultimodalSpec,
    *,
    key: MessageKey,
    sub_lookup: SubLookup,
    shape: ParallelShape = ONE_PROCESS,
) -> tuple[TensorSpec, ...]:
    """Names, shapes and dtypes of the tensors of message `key`, in a fixed order, for a run of
    `shape` (its activation dtype and a rank's share of a sequence).

    Activation messages carry all tensors, gradient messages the floating-point ones. The
    sub-microbatch of the producer stage sizes the message (a DiT message also needs the text
    sub-microbatches of the microbatch, found through `sub_lookup`).
    """
    producer, consumer = key.producer, key.consumer
    module = model.module(producer.module)
    sub = sub_lookup(producer.work)
    modality = modality_of(module)
    if producer.module == consumer.module:
        if consumer.chunk != producer.chunk + 1 or producer.work != consumer.work:
            raise ValueError(f"message {key} does not connect consecutive chunks of one stage")
        specs = modality.chunk_message(
            module, model, sub, sub_lookup, dtype=shape.dtype, seq=shape.sequence_shard
        )
    else:
        if module.feeds != consumer.module:
            raise ValueError(f"message {key}: {module.name!r} does not feed {consumer.module!r}")
        specs = modality.hand_over(module, sub, dtype=shape.dtype)
    if key.kind is MessageKind.GRADIENT:
        specs = [s for s in specs if s.dtype != INDEX_DTYPE]
    return tuple(specs)


def message_nbytes(specs: Iterable[TensorSpec]) -> int:
    """Total bytes of a message's tensors."""
    return sum(s.nbytes for s in specs)


@dataclass(frozen=True)
class MessageShapes:
    """`message_tensors` bound to a model and the run's parallel shape: what the built chunks
    send. `for_lookup(lookup)` is a plan's `tensor_fn` (key -> TensorSpecs)."""

    model: MultimodalSpec
    shape: ParallelShape = ONE_PROCESS

    def tensors(self, key: MessageKey, sub_lookup: SubLookup) -> tuple[TensorSpec, ...]:
        """The tensors of message `key` (`sub_lookup`: the plan's sub-microbatch table)."""
        return message_tensors(self.model, key=key, sub_lookup=sub_lookup, shape=self.shape)

    def for_lookup(self, sub_lookup: SubLookup) -> Callable[[MessageKey], tuple[TensorSpec, ...]]:
        """key -> tensors, for the sub-microbatches `sub_lookup` finds (e.g. `plan.submicrobatch`)."""
        return functools.partial(self._tensors_of, sub_lookup)

    def _tensors_of(self, sub_lookup: SubLookup, key: MessageKey) -> tuple[TensorSpec, ...]:
        return self.tensors(key, sub_lookup)
