"""A model chunk that sleeps the cost model's time instead of computing (see `timing.py`).

`EmulatedChunk` keeps the `ModelChunk` contract the runtime and Megatron's stock schedules rely on
(`chunk(inputs=[...], batch=...)`, a `ChunkSpec` in `.chunk`, a Megatron `TransformerConfig` in
`.config`, one real parameter so Megatron's DDP, optimizer and gradient reductions run) and real
autograd: its forward and backward are one `torch.autograd.Function` that sleeps.

Message tensor (`timing.message_spec`): element 0 is a payload that carries the autograd value
(out = w * (1 + sum of inputs)), then (coarse, fine) stamp pairs. Forward: the producer stamps
slot 0 when its output exists; the consumer sleeps until every remote input's stamp + transfer
time, then its compute time. Backward: each consumer stamps its own slot of the gradient it sends
(so the executor's sum over consumers keeps every stamp); the producer waits for each remote
consumer's stamp + transfer time, then sleeps its backward time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_dip import megatron_compat
from megatron_dip.modelspec import MultimodalSpec
from megatron_dip.schedule.ir import NO_RECOMPUTE, ChunkSpec, MemoryPolicy, Placement

from .timing import (
    MESSAGE_NAME,
    STAMP_SLOTS,
    STAMP_WIDTH,
    EmulationConfig,
    Link,
    StageTiming,
    SubWork,
    decode_stamp,
    encode_stamp,
    sleep_until,
)

_WIDTH = 1 + STAMP_WIDTH * STAMP_SLOTS


def _stamp(message: torch.Tensor, slot: int, seconds: float) -> None:
    at = 1 + STAMP_WIDTH * slot
    message[at : at + STAMP_WIDTH] = torch.tensor(encode_stamp(seconds), dtype=message.dtype)


def _read(message: torch.Tensor, slot: int) -> float | None:
    at = 1 + STAMP_WIDTH * slot
    parts = message[at : at + STAMP_WIDTH].tolist()
    return None if parts[0] == 0.0 else decode_stamp(parts)


def _ready_at(
    messages: Sequence[torch.Tensor], links: Sequence[Link], slots: Sequence[int]
) -> float:
    """Latest arrival over the remote messages: stamp + transfer time."""
    ready = 0.0
    for message, link, slot in zip(messages, links, slots):
        stamp = _read(message, slot)
        if link.remote and stamp is not None:
            ready = max(ready, stamp + link.transfer_s)
    return ready


def _emulate_forward(ctx, timing: StageTiming, clock: EmulationConfig, backward_s, inputs) -> None:
    """Wait for the remote inputs' arrival, sleep the forward; keep what the backward needs."""
    sleep_until(_ready_at(inputs, timing.inputs, [0] * len(inputs)), clock)
    sleep_until(clock.now() + timing.forward_s, clock)
    ctx.timing, ctx.clock, ctx.backward_s = timing, clock, backward_s


def _stamped_input_grads(timing: StageTiming, grad_out: torch.Tensor, payload) -> list:
    """One gradient per input: `payload` in element 0, this stage's stamp in its slot."""
    done = EmulationConfig.now()
    grads = []
    for link in timing.inputs:
        g = torch.zeros(_WIDTH, dtype=grad_out.dtype, device=grad_out.device)
        g[0] = payload
        _stamp(g, link.slot, done)
        grads.append(g)
    return grads


class _SleepWeight(torch.autograd.Function):
    """[w, 1, 1, ...] (a message-wide factor carrying the chunk's weight); its backward sleeps
    the weight-gradient seconds: the W of a split backward (`runtime.backward_split`), which
    runs this node alone, or part of a fused backward."""

    @staticmethod
    def forward(ctx, weight, seconds: float, clock: EmulationConfig):
        ctx.seconds, ctx.clock, ctx.shape = seconds, clock, weight.shape
        out = torch.ones(_WIDTH, dtype=weight.dtype, device=weight.device)
        out[0] = weight.reshape(-1)[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.seconds > 0:
            sleep_until(ctx.clock.now() + ctx.seconds, ctx.clock)
        return grad[0].reshape(ctx.shape), None, None


class _Sleep(torch.autograd.Function):
    """out = a * (1 + sum(payloads)), `a` element 0 of `anchor`; sleeps the emulated forward
    and the backward's input-gradient seconds (the B of a split backward)."""

    @staticmethod
    def forward(ctx, anchor, timing: StageTiming, clock: EmulationConfig, backward_s, *inputs):
        _emulate_forward(ctx, timing, clock, backward_s, inputs)
        total = sum((x[0] for x in inputs), torch.zeros((), dtype=anchor.dtype))
        ctx.save_for_backward(anchor, total)
        out = torch.zeros(_WIDTH, dtype=anchor.dtype, device=anchor.device)
        out[0] = anchor[0] * (1 + total)
        _stamp(out, 0, clock.now())
        return out

    @staticmethod
    def backward(ctx, grad_out):
        anchor, total = ctx.saved_tensors
        timing, clock = ctx.timing, ctx.clock
        outs = timing.outputs
        sleep_until(_ready_at([grad_out] * len(outs), outs, range(1, 1 + len(outs))), clock)
        sleep_until(clock.now() + ctx.backward_s, clock)
        grad_anchor = torch.zeros_like(anchor)
        grad_anchor[0] = grad_out[0] * (1 + total)
        grads = _stamped_input_grads(timing, grad_out, grad_out[0] * anchor[0])
        return (grad_anchor, None, None, None, *grads)


class _SleepLoss(torch.autograd.Function):
    """loss = a * tokens (+ 0 * inputs, so the inputs get their stamped gradients), `a` as in
    `_Sleep`; its backward sleeps the input-gradient seconds."""

    @staticmethod
    def forward(ctx, anchor, timing: StageTiming, clock: EmulationConfig, backward_s, *inputs):
        _emulate_forward(ctx, timing, clock, backward_s, inputs)
        ctx.width = anchor.shape[0]
        return anchor[0].clone()

    @staticmethod
    def backward(ctx, grad_out):
        sleep_until(ctx.clock.now() + ctx.backward_s, ctx.clock)
        grads = _stamped_input_grads(ctx.timing, grad_out, 0.0)
        grad_anchor = torch.zeros(ctx.width, dtype=grad_out.dtype, device=grad_out.device)
        grad_anchor[0] = grad_out
        return (grad_anchor, None, None, None, *grads)


class EmulatedChunk(MegatronModule):
    """Layers [chunk.layer_start, chunk.layer_end) of one module, emulated (module docstring)."""

    def __init__(
        self, *, chunk: ChunkSpec, model: MultimodalSpec, num_chunks: int, config, trainable: bool
    ) -> None:
        super().__init__(config=config)
        self.chunk, self.num_chunks = chunk, num_chunks
        self.module_spec = model.module(chunk.module)
        self.is_loss_stage = (
            chunk.module == model.loss_module.name
            and chunk.layer_end == self.module_spec.num_layers
        )
        # A matrix, as the chunk's weights it stands for: a split backward defers its gradient
        # to W (vectors' are done in B, `runtime.backward_split`).
        self.weight = torch.nn.Parameter(torch.ones(1, 1, dtype=config.params_dtype))
        self.weight.requires_grad_(trainable)
        self._memory = NO_RECOMPUTE
        # Checkpoints name parameters globally; one emulated weight per chunk's layer range.
        self.global_aliases = {
            "weight": f"{chunk.module}.emulated.{chunk.layer_start}-{chunk.layer_end}"
        }

    @contextlib.contextmanager
    def recompute_context(self, memory: MemoryPolicy) -> Iterator[None]:
        """Selective, block and uniform recompute, and offload: the backward sleeps the cost
        model's backward of that memory policy (recomputation and exposed transfers included)."""
        previous, self._memory = self._memory, memory
        try:
            yield
        finally:
            self._memory = previous

    def forward(self, *, inputs: Sequence[dict[str, torch.Tensor]], batch: SubWork):
        timing = batch.timing(self.chunk.module, self.chunk.index)
        tensors = [m[MESSAGE_NAME] for m in inputs]
        weight_s = timing.weight_s if self.weight.requires_grad else 0.0
        input_s = timing.backward_for(self._memory) - weight_s
        # The backward is two nodes, as a layer's: the input gradients (`_Sleep`, B) and the
        # weight's (`_SleepWeight`, W), joined by a product (the weight node of a split backward).
        # A chunk whose inputs need no gradient has no B of its own: its `_Sleep` hangs off the
        # weight, so a split backward runs both in W, as it runs a real first chunk's.
        wt = _SleepWeight.apply(self.weight, weight_s, batch.config)
        first = not any(t.requires_grad for t in tensors)
        anchor = wt if first else torch.ones(_WIDTH, dtype=wt.dtype, device=wt.device)
        if self.is_loss_stage:
            loss = _SleepLoss.apply(anchor, timing, batch.config, input_s, *tensors)
            loss = loss if first else loss * wt[0]
            tokens = batch.loss_tokens
            return {
                "loss": loss * tokens,
                "num_tokens": torch.tensor(tokens, dtype=torch.int64),
            }
        out = _Sleep.apply(anchor, timing, batch.config, input_s, *tensors)
        return {MESSAGE_NAME: out if first else out * wt}

    def set_input_tensor(self, tensor) -> None:  # Megatron's hook; inputs come via `inputs=`
        del tensor


def emulated_config(*, dtype: torch.dtype = torch.float32):
    """A minimal Megatron `TransformerConfig` for emulated chunks (DDP and stock schedules read
    it; nothing computes with it)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        perform_initialization=False,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        **megatron_compat.quiet_config_defaults(),
    )


def build_emulated_chunks(
    model: MultimodalSpec, placement: Placement, *, rank: int
) -> list[EmulatedChunk]:
    """The emulated chunks `placement` puts on pipeline rank `rank`, in placement order."""
    from megatron_dip.cpu_support import apply_cpu_fixes

    if not torch.cuda.is_available():
        apply_cpu_fixes()
    chunks = []
    for c in placement.chunks_on_rank(rank):
        module = model.module(c.module)
        chunks.append(
            EmulatedChunk(
                chunk=c,
                model=model,
                num_chunks=placement.module(c.module).num_chunks,
                config=emulated_config(),
                trainable=module.trainable,
            )
        )
    return chunks
