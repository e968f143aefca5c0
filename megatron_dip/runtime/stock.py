"""Megatron-Core's own, unmodified pipeline schedules on our model chunks: the honest baseline.

`StockPipeline` makes our `ModelChunk`s look like Megatron model chunks, so that
`forward_backward_pipelining_without_interleaving` / `..._with_interleaving` (or
`forward_backward_no_pipelining` on one rank) run them exactly as they would run a GPT or LLaVA
model. Layout, as Megatron's LLaVA does: every producer module (ViT, text encoder) runs entirely
inside the first virtual stage, in front of the loss module's first chunk(s); the loss module's
chunks are spread over the virtual stages (`stage_units[j]` lists the (module, chunk) units of
this rank's virtual stage j, as for `schedule.baselines.build_megatron_plan`).

Megatron sends ONE tensor of a fixed shape [seq_length, micro_batch_size, hidden_size] between
stages. A stage boundary here carries one message of possibly several tensors (a DiT message is
hidden + temb + cond + cond_index), so each message is packed: its tensors, flattened in
TensorSpec order and cast to the pipeline dtype, are concatenated and zero-padded to
`seq_length` elements, and unpacked as views on the other side (gradients flow through the
concatenation, the index tensor travels as exact small floats). The adapter's config sets
`hidden_size=1`, so `seq_length` is the packed length (`boundary_length`). Within a stage the
units are chained without detaching: one autograd graph per stage, as in Megatron.

What a Megatron user gets, the baseline gets too: `memory` runs every unit under the same
activation recomputation the DIP runtime applies (`runtime.recompute.run_chunk`: "full" keeps
each unit's input and recomputes it in backward, "selective" recomputes the attention cores,
"block" / "uniform" with `MemoryPolicy.layers` N are Megatron's partial methods per unit), and
`overlap_grad_reduce` hands the schedule Megatron-LM's DDP hooks (`no_sync_func` and
`grad_sync_func` per virtual stage, over the DDP-wrapped units of the stage, and a
`finalize_model_grads_func` that waits for the reductions), so the data-parallel reduction of a
stage overlaps the rest of the backward exactly where Megatron's schedules put it. Without it the
caller reduces after the schedule (Megatron without --overlap-grad-reduce).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from megatron_dip import megatron_compat
from megatron_dip.parallel.groups import schedule_collection
from megatron_dip.schedule.graph import Dataflow
from megatron_dip.schedule.ir import (
    NO_RECOMPUTE,
    MemoryPolicy,
    MessageKey,
    StageId,
    TensorSpec,
    WorkId,
)

from .checks import TensorFn, chunks_device, unwrap_chunk
from .data import BatchSource
from .loss import megatron_loss_func
from .p2p import torch_dtype_of
from .recompute import run_chunk

Unit = tuple[str, int]


def pack_message(
    tensors: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec], *, length: int, dtype
) -> torch.Tensor:
    """`tensors` flattened in spec order, cast to `dtype`, zero-padded to [length, 1, 1]."""
    parts = [tensors[s.name].reshape(-1).to(dtype) for s in specs]
    used = sum(p.numel() for p in parts)
    if used > length:
        raise ValueError(f"message of {used} elements does not fit the {length}-element buffer")
    device = parts[0].device if parts else torch.device("cpu")
    parts.append(torch.zeros(length - used, dtype=dtype, device=device))
    return torch.cat(parts).reshape(length, 1, 1)


def unpack_message(flat: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Inverse of `pack_message` (views of `flat`, cast back to each spec's dtype)."""
    data = flat.reshape(-1)
    out, at = {}, 0
    for s in specs:
        piece = data[at : at + s.numel].reshape(s.shape)
        want = torch_dtype_of(s)
        out[s.name] = piece.round().to(want) if not want.is_floating_point else piece.to(want)
        at += s.numel
    return out


class StockStage(torch.nn.Module):
    """One virtual pipeline stage for Megatron's schedules: a run of our chunks."""

    def __init__(
        self,
        *,
        units: Sequence[Unit],
        chunks: Mapping[Unit, torch.nn.Module],
        dataflow: Dataflow,
        batches: BatchSource,
        tensor_fn: TensorFn,
        config: Any,
        length: int,
        memory: MemoryPolicy = NO_RECOMPUTE,
    ) -> None:
        super().__init__()
        self.units = list(units)
        self.parts = torch.nn.ModuleList(chunks[u] for u in self.units)
        self.df, self.batches, self.tensor_fn = dataflow, batches, tensor_fn
        self.config = config
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder
        self.length = length
        if memory.offload:  # Megatron refuses layer offload with pipeline parallelism
            raise ValueError(f"memory policy {memory.label}: the stock schedules do not offload")
        self.memory = memory
        self._input: torch.Tensor | None = None
        self._input_used = False

    @property
    def ddp_units(self) -> list[torch.nn.Module]:
        """The stage's units wrapped in Megatron's DDP (frozen units are not)."""
        return [p for p in self.parts if hasattr(p, "start_grad_sync")]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Megatron's `no_sync_func` for this stage: no DDP unit reduces while inside."""
        with contextlib.ExitStack() as stack:
            for unit in self.ddp_units:
                stack.enter_context(unit.no_sync())
            yield

    def start_grad_sync(self, *unused: Any) -> None:
        """Megatron's `grad_sync_func` for this stage: start every DDP unit's reduction."""
        for unit in self.ddp_units:
            unit.start_grad_sync()

    def set_input_tensor(self, tensors: list[torch.Tensor | None] | torch.Tensor | None) -> None:
        """Megatron's hook: the tensor received from the previous stage (None on the first)."""
        self._input = tensors[0] if isinstance(tensors, list) else tensors

    def _works(self, module: str, microbatch: int) -> list[WorkId]:
        return sorted(w for w in self.df.works if w.module == module and w.microbatch == microbatch)

    def forward(self, microbatch: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Run every unit on every sub-microbatch of `microbatch`; pack what leaves the stage."""
        values: dict[StageId, dict[str, torch.Tensor]] = {}
        order: list[StageId] = []
        self._input_used = False
        for (module, chunk), part in zip(self.units, self.parts):
            for work in self._works(module, microbatch):
                stage = StageId(module, chunk, work.microbatch, work.sub)
                inputs = [self._input_of(key, values) for key in self.df.forward_inputs(stage)]
                batch = self.batches.sub_batch(work)
                values[stage] = run_chunk(
                    unwrap_chunk(part), self.memory.method, part, inputs, batch, self.memory.layers
                )
                order.append(stage)
        if not order:  # no unit has work in this microbatch (e.g. a ViT-only stage, no images)
            return self._pass_through()
        leaving = [
            key
            for stage in order
            for key in self.df.forward_outputs(stage)
            if key.consumer not in values
        ]
        last = values[order[-1]]
        if "loss" in last:
            return {**last, "loss": self._connected(last["loss"])}
        if len(leaving) != 1:
            raise ValueError(
                f"a stock pipeline stage must hand exactly one message to the next, this one "
                f"hands {[str(k) for k in leaving]}"
            )
        key = leaving[0]
        packed = pack_message(
            values[key.producer],
            tuple(self.tensor_fn(key)),
            length=self.length,
            dtype=self.config.pipeline_dtype,
        )
        return self._connected(packed)

    def _pass_through(self) -> torch.Tensor:
        """What a stage without work in a microbatch hands on: the message it received (the
        next stages may need it) or, on the first stage, zeros. Megatron's schedules still send
        and receive one tensor per stage and microbatch, and the backward hands the gradient on."""
        if self._input is not None:
            self._input_used = True
            return self._input.clone()
        device = chunks_device(self.parts)
        return torch.zeros(
            self.length, 1, 1, dtype=self.config.pipeline_dtype, device=device, requires_grad=True
        )

    def _connected(self, out: torch.Tensor) -> torch.Tensor:
        """`out`, made to depend on a received input the stage did not use (with a zero
        coefficient), so Megatron's backward sends the previous stage the (zero) gradient
        it waits for."""
        unused = self._input is not None and self._input.requires_grad and not self._input_used
        return out + 0.0 * self._input.sum().to(out.dtype) if unused else out

    def _input_of(self, key: MessageKey, values: Mapping[StageId, dict]) -> dict:
        if key.producer in values:
            return values[key.producer]
        if self._input is None:
            raise ValueError(f"{key.consumer} needs {key.producer}, which is not in this stage")
        self._input_used = True
        return unpack_message(self._input, tuple(self.tensor_fn(key)))


def boundary_length(
    dataflow: Dataflow, stage_units: Sequence[Sequence[Sequence[Unit]]], tensor_fn: TensorFn
) -> int:
    """Elements of the largest message crossing a stage boundary (all ranks' stages)."""
    where = {
        u: (j, r)
        for r, stages in enumerate(stage_units)
        for j, units in enumerate(stages)
        for u in units
    }
    biggest = 1
    for stage in dataflow.stages():
        for key in dataflow.forward_outputs(stage):
            a = where[(key.producer.module, key.producer.chunk)]
            b = where[(key.consumer.module, key.consumer.chunk)]
            if a != b:
                biggest = max(biggest, sum(s.numel for s in tensor_fn(key)))
    return biggest


def stock_config(
    template: Any,
    *,
    pp_size: int,
    vp_size: int | None,
    dtype,
    batch_p2p: bool,
    per_token: bool,
    group_size: int | None,
) -> Any:
    """A copy of a chunk's TransformerConfig set up for the stock schedules and packed p2p.

    The DDP hooks (`no_sync_func`, `grad_sync_func`, `param_sync_func`,
    `finalize_model_grads_func`) are cleared: the stages are not DDP modules; `StockPipeline`
    sets the stages' own hooks when it overlaps the reduction. `grad_scale_func` is kept.
    """
    config = copy.copy(template)
    config.hidden_size = 1
    config.pipeline_dtype = dtype
    config.pipeline_model_parallel_size = pp_size
    config.virtual_pipeline_model_parallel_size = vp_size
    config.variable_seq_lengths = False
    config.sequence_parallel = False
    config.batch_p2p_comm = batch_p2p
    config.overlap_p2p_comm = False
    config.deallocate_pipeline_outputs = False
    config.calculate_per_token_loss = per_token
    config.microbatch_group_size_per_vp_stage = group_size or pp_size
    for name in (
        "no_sync_func",
        "grad_sync_func",
        "param_sync_func",
        "finalize_model_grads_func",
        "timers",
    ):
        setattr(config, name, None)
    return config


def _finish_grad_sync(units: Sequence[torch.nn.Module], model: Any, num_tokens: Any, **_: Any):
    """`finalize_model_grads_func`: wait for the reductions the hooks started (per-token loss
    scaling and the sequence-parallel sums stay with the caller, as without overlap).

    Megatron's DDP starts a bucket from its backward hooks only when the last microbatch gave
    every parameter the gradients the first iteration's did; a unit that did not run in this
    iteration's last microbatch (an encoder on a text-only microbatch) never started: start it.
    """
    del model, num_tokens
    for unit in units:
        for group in unit.bucket_groups + unit.expert_parallel_bucket_groups:
            if group.grad_reduce_handle is None and not group.is_first_batch:
                group.start_grad_sync()
        unit.finish_grad_sync()


def _forward_step(name: str, data_iterator: Iterable[int], model: StockStage):
    microbatch = next(data_iterator)
    out = model(microbatch)
    if isinstance(out, dict):
        return out["loss"], functools.partial(megatron_loss_func, out["num_tokens"], name)
    return out, None


class StockPipeline:
    """Runs one rank's part of a stock Megatron schedule on our chunks (module docstring).

    `all_stage_units[r][j]`: the units of rank r's virtual stage j (all ranks', so that every
    rank sizes the packed messages alike). `dataflow`: producers and consumers of the batch's
    sub-microbatches. `single_group`: a group of this rank only, standing in for the tensor-,
    context- and data-parallel groups of the schedule's process-group collection.
    `batch_p2p`: Megatron's `batch_p2p_comm` (leave it off for interleaving at PP=2, where it
    swaps messages). `memory`: the activation recomputation of every unit (Megatron's flags;
    no offload). `overlap_grad_reduce`:
    install Megatron's DDP hooks (module docstring); otherwise the caller reduces after `run`.
    """

    def __init__(
        self,
        *,
        chunks: Sequence[torch.nn.Module],
        all_stage_units: Sequence[Sequence[Sequence[Unit]]],
        dataflow: Dataflow,
        microbatches: Sequence[int],
        batches: BatchSource,
        tensor_fn: TensorFn,
        pp_group: torch.distributed.ProcessGroup,
        single_group: torch.distributed.ProcessGroup,
        batch_p2p: bool = True,
        per_token: bool = False,
        report_name: str = "lm loss",
        memory: MemoryPolicy = NO_RECOMPUTE,
        overlap_grad_reduce: bool = False,
    ) -> None:
        by_unit = {}
        self._chunks = {}
        for c in chunks:
            spec = unwrap_chunk(c).chunk
            by_unit[(spec.module, spec.index)] = c
            self._chunks[(spec.module, spec.index)] = c
        rank, self.pp_size = pp_group.rank(), pp_group.size()
        units = all_stage_units[rank]
        self.vp_size = len(units) if len(units) > 1 else None
        template = unwrap_chunk(chunks[0]).config
        dtype = next(unwrap_chunk(chunks[0]).parameters()).dtype
        self.config = stock_config(
            template,
            pp_size=self.pp_size,
            vp_size=self.vp_size,
            dtype=dtype,
            batch_p2p=batch_p2p,
            per_token=per_token,
            group_size=None,
        )
        self.length = boundary_length(dataflow, all_stage_units, tensor_fn)
        self.stages = [
            StockStage(
                units=u,
                chunks=by_unit,
                dataflow=dataflow,
                batches=batches,
                tensor_fn=tensor_fn,
                config=self.config,
                length=self.length,
                memory=memory,
            )
            for u in units
        ]
        if overlap_grad_reduce:
            self._install_grad_sync_hooks()
        self.microbatches = list(microbatches)
        self.pp_group, self.single = pp_group, single_group
        self.report_name = report_name

    def _install_grad_sync_hooks(self) -> None:
        """Megatron-LM's `--overlap-grad-reduce` set-up, one hook per virtual stage."""
        no_sync: list[Callable] = [s.no_sync for s in self.stages]
        grad_sync: list[Callable] = [s.start_grad_sync for s in self.stages]
        one = self.vp_size is None
        self.config.no_sync_func = no_sync[0] if one else no_sync
        self.config.grad_sync_func = grad_sync[0] if one else grad_sync
        self.config.finalize_model_grads_func = functools.partial(
            _finish_grad_sync, [u for s in self.stages for u in s.ddp_units]
        )

    def _collection(self):
        return schedule_collection(pp=self.pp_group, single=self.single)

    def run(self, *, forward_only: bool = False) -> list[dict[str, torch.Tensor]]:
        """One iteration of the stock schedule; returns Megatron's loss reports. Gradients of
        sequence-parallel parameters are then summed over the TP group (as the executor does)."""
        func = megatron_compat.get_forward_backward_func(pp_size=self.pp_size, vp_size=self.vp_size)
        kwargs: dict[str, Any] = {"pg_collection": self._collection()}
        if self.pp_size > 1:
            kwargs["p2p_communicator"] = megatron_compat.pipeline_communicator(
                self.pp_group, self.config
            )
        iters = [iter(self.microbatches) for _ in self.stages]
        model: Any = self.stages if self.vp_size else self.stages[0]
        data: Any = iters if self.vp_size else iters[0]
        reports = func(
            forward_step_func=functools.partial(_forward_step, self.report_name),
            data_iterator=data,
            model=model,
            num_microbatches=len(self.microbatches),
            seq_length=self.length,
            micro_batch_size=1,
            forward_only=forward_only,
            **kwargs,
        )
        if not forward_only:
            from .ddp import reduce_sequence_parallel_grads

            reduce_sequence_parallel_grads([self._chunks[k] for k in sorted(self._chunks)])
        return reports


__all__: list[str] = [
    "StockPipeline",
    "StockStage",
    "boundary_length",
    "pack_message",
    "unpack_message",
]
