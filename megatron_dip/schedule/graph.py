"""The data-flow graph of one iteration, derived from placement, sub-microbatches and dependencies.

Every sub-microbatch of module m flows through m's chunks 0..C-1 in forward and back in backward.
Cross-module `Dependency` edges connect the producer's last chunk to the consumer's first chunk.
A stage needs a backward when its module is trainable or when a trainable module lies upstream
of it (gradients must flow through a frozen LLM to reach a trainable vision encoder).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from .ir import (
    Dependency,
    MessageKey,
    MessageKind,
    Placement,
    Plan,
    StageId,
    SubMicrobatch,
    WorkId,
)


class Dataflow:
    """Producer/consumer relations between the stages of one iteration."""

    def __init__(
        self,
        placement: Placement,
        submicrobatches: Iterable[SubMicrobatch],
        dependencies: Iterable[Dependency],
    ) -> None:
        self.placement = placement
        self.works: list[WorkId] = [s.work for s in submicrobatches]
        work_set = set(self.works)
        self._producers: dict[WorkId, list[WorkId]] = defaultdict(list)
        self._consumers: dict[WorkId, list[WorkId]] = defaultdict(list)
        for d in dependencies:
            for w in (d.producer, d.consumer):
                if w not in work_set:
                    raise ValueError(f"dependency {d} names unknown sub-microbatch {w}")
            if d.producer.module == d.consumer.module:
                raise ValueError(f"dependency {d} connects a module to itself")
            self._producers[d.consumer].append(d.producer)
            self._consumers[d.producer].append(d.consumer)
        self._num_chunks = {m.name: m.num_chunks for m in placement.modules}
        for w in self.works:
            if w.module not in self._num_chunks:
                raise ValueError(f"sub-microbatch {w} of a module the placement does not have")
        self._needs_backward = self._modules_needing_backward()

    def _modules_needing_backward(self) -> set[str]:
        upstream: dict[str, set[str]] = defaultdict(set)
        for consumer, producers in self._producers.items():
            upstream[consumer.module].update(p.module for p in producers)
        trainable = {m.name for m in self.placement.modules if m.trainable}
        needs = set()
        for m in self._num_chunks:
            seen, todo = set(), [m]
            while todo:
                x = todo.pop()
                if x in seen:
                    continue
                seen.add(x)
                todo.extend(upstream[x])
            if seen & trainable:
                needs.add(m)
        return needs

    def num_chunks(self, module: str) -> int:
        return self._num_chunks[module]

    def rank_of(self, stage: StageId) -> int:
        return self.placement.rank_of(stage.module, stage.chunk)

    def needs_backward(self, module: str) -> bool:
        """True when stages of `module` run a backward (trainable, or upstream of one)."""
        return module in self._needs_backward

    def stages(self) -> list[StageId]:
        """All stages, sub-microbatch by sub-microbatch, chunks in forward order."""
        return [
            StageId(w.module, c, w.microbatch, w.sub)
            for w in self.works
            for c in range(self._num_chunks[w.module])
        ]

    def producers(self, stage: StageId) -> list[StageId]:
        """Stages whose forward output is an input of `stage`'s forward."""
        if stage.chunk > 0:
            return [StageId(stage.module, stage.chunk - 1, stage.microbatch, stage.sub)]
        return [
            StageId(p.module, self._num_chunks[p.module] - 1, p.microbatch, p.sub)
            for p in self._producers.get(stage.work, ())
        ]

    def consumers(self, stage: StageId) -> list[StageId]:
        """Stages whose forward takes `stage`'s forward output."""
        if stage.chunk < self._num_chunks[stage.module] - 1:
            return [StageId(stage.module, stage.chunk + 1, stage.microbatch, stage.sub)]
        return [
            StageId(c.module, 0, c.microbatch, c.sub) for c in self._consumers.get(stage.work, ())
        ]

    def forward_inputs(self, stage: StageId) -> list[MessageKey]:
        """Activation messages a forward of `stage` consumes (local hand-overs included)."""
        return [MessageKey(MessageKind.ACTIVATION, p, stage) for p in self.producers(stage)]

    def forward_outputs(self, stage: StageId) -> list[MessageKey]:
        return [MessageKey(MessageKind.ACTIVATION, stage, c) for c in self.consumers(stage)]

    def backward_inputs(self, stage: StageId) -> list[MessageKey]:
        """Gradient messages a backward of `stage` consumes (from its consumers' backward)."""
        return [
            MessageKey(MessageKind.GRADIENT, stage, c)
            for c in self.consumers(stage)
            if self.needs_backward(c.module)
        ]

    def backward_outputs(self, stage: StageId) -> list[MessageKey]:
        """Gradient messages a backward of `stage` produces (for producers needing backward)."""
        return [
            MessageKey(MessageKind.GRADIENT, p, stage)
            for p in self.producers(stage)
            if self.needs_backward(p.module)
        ]

    def sender_of(self, key: MessageKey) -> int:
        stage = key.producer if key.kind is MessageKind.ACTIVATION else key.consumer
        return self.rank_of(stage)

    def receiver_of(self, key: MessageKey) -> int:
        stage = key.consumer if key.kind is MessageKind.ACTIVATION else key.producer
        return self.rank_of(stage)


def dataflow_of(plan: Plan) -> Dataflow:
    """The `Dataflow` of a `Plan`."""
    return Dataflow(plan.placement, plan.submicrobatches, plan.dependencies)
