"""Optimizer and learning-rate schedule.

On GPUs, and on the CPU under --bf16 or --use-distributed-optimizer, this is Megatron-Core's own
optimizer (`get_megatron_optimizer`: `Float16OptimizerWithFloat16Params` with fp32 master weights
under --bf16, gradient clipping, --use-distributed-optimizer) with explicit process groups
(`cpu_support` lets it run on CPU tensors). On a float32 CPU run `PlainAdamW` stands in: torch's
AdamW on the DDP-reduced gradients, with Megatron's gradient-norm semantics (squares summed over
the replica's model-parallel ranks, tensor-parallel duplicates counted once) and clipping. All
expose `step() -> (ok, grad_norm, zeros)`, `param_groups` and `zero_grad()`, so Megatron-Core's
`OptimizerParamScheduler` drives any of them.

Checkpoints hold the optimizer state in the weights' global coordinates (`optim_state.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..config.run import RunSpec
from .build import LocalModel
from .setup import ParallelContext

logger = logging.getLogger(__name__)


def _no_decay(name: str, p: torch.nn.Parameter) -> bool:
    """Megatron's default: no weight decay on biases and 1-D parameters (norms)."""
    return name.endswith(".bias") or p.dim() == 1


def param_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict]:
    decay, plain = [], []
    for name, p in named:
        if p.requires_grad:
            (plain if _no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0}, {"params": plain, "wd_mult": 0.0}]
    return [g for g in groups if g["params"]]


class PlainAdamW:
    """torch AdamW with Megatron's gradient norm and clipping (see the module docstring)."""

    def __init__(self, model: LocalModel, *, spec: RunSpec, mp_group: dist.ProcessGroup) -> None:
        t = spec.training
        named = model.named_parameters()
        groups = param_groups(named, t.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            weight_decay=t.weight_decay,
        )
        self.clip_grad = t.clip_grad
        self.mp_group = mp_group

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.params:
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = g.to(p.dtype)
            grads.append(p.grad)
        return grads

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm of the replica's whole gradient (TP duplicates counted once)."""
        # On the gradients' device: the model group's collective is NCCL on a GPU.
        device = grads[0].device if grads else torch.device("cpu")
        local = torch.zeros(1, dtype=torch.float64, device=device)
        tp_rank = getattr(self.params[0], "_dip_tp_rank", 0) if self.params else 0
        for p, g in zip(self.params, grads):
            if getattr(p, "shared", False):  # a tied embedding's second copy (Megatron's rule)
                continue
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                local += g.double().pow(2).sum()
        if self.mp_group.size() > 1:
            dist.all_reduce(local, group=self.mp_group)
        return float(local.sqrt())

    def step(self) -> tuple[bool, float, None]:
        grads = self._grads()
        norm = self.grad_norm(grads)
        if not torch.isfinite(torch.tensor(norm)):
            logger.warning("gradient norm is %s: skipping the update", norm)
            return False, norm, None
        if self.clip_grad > 0 and norm > self.clip_grad:
            for g in grads:
                g.mul_(self.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        return True, norm, None

    def pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(model parameter, parameter the torch optimizer updates): the same tensor here."""
        return [(p, p) for p in self.params]

    def inner(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]


def megatron_optimizer(model: LocalModel, *, spec: RunSpec, ctx: ParallelContext):
    """Megatron-Core's optimizer over the DDP-wrapped chunks, explicit groups (CUDA only)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = spec.training
    config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=spec.dtype == "bfloat16",
        params_dtype=torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32,
        use_distributed_optimizer=spec.distributed_optimizer,
    )
    # The run's one ProcessGroupCollection, the DDP wrappers' too (parallel/groups.py).
    return get_megatron_optimizer(
        config, model.ddp, use_gloo_process_groups=False, pg_collection=ctx.groups.collection()
    )


def build_optimizer(model: LocalModel, *, spec: RunSpec, ctx: ParallelContext):
    """Megatron-Core's optimizer on GPUs, when distributed or under --bf16 (its
    `Float16OptimizerWithFloat16Params`: fp32 master weights), else `PlainAdamW` (module
    docstring)."""
    megatron = spec.cuda or spec.distributed_optimizer
    if megatron or spec.dtype != "float32":
        return megatron_optimizer(model, spec=spec, ctx=ctx)
    for _, p in model.named_parameters():
        p._dip_tp_rank = ctx.tp_rank  # read by the gradient norm
    return PlainAdamW(model, spec=spec, mp_group=ctx.mp)


def build_scheduler(optimizer, *, spec: RunSpec):
    """Megatron-Core's `OptimizerParamScheduler` from the --lr* flags."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = spec.training
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        **t.schedule,
        wd_incr_steps=t.iterations,
        wd_incr_style="constant",
        override_opt_param_scheduler=t.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
    )


def optimizer_pairs(
    optimizer,
) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter, torch.optim.Optimizer]]:
    """(model parameter, the tensor its torch optimizer updates, that optimizer) for `PlainAdamW`
    and Megatron-Core's fp32 / mixed-precision (and chained) optimizers."""
    if isinstance(optimizer, PlainAdamW):
        return [(p, p, optimizer.optimizer) for p in optimizer.params]
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if hasattr(opt, "float16_groups"):
            for model_g, main_g in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                out += [(p, m, inner) for p, m in zip(model_g, main_g)]
            for group in opt.fp32_from_fp32_groups:
                out += [(p, p, inner) for p in group]
        else:
            out += [(p, p, inner) for g in inner.param_groups for p in g["params"]]
    return out


def distributed_parts(optimizer) -> list:
    """Megatron's `DistributedOptimizer`s inside `optimizer` (chained or not); [] if none."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in parts if isinstance(o, DistributedOptimizer)]


def uses_group_steps(inner: torch.optim.Optimizer) -> bool:
    """Whether `inner` counts Adam's step per parameter group (Transformer Engine's FusedAdam)
    rather than per parameter (torch's Adam/AdamW)."""
    return not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def group_of(inner: torch.optim.Optimizer, main: torch.Tensor) -> dict:
    """The parameter group of `inner` that holds `main`."""
    return next(g for g in inner.param_groups if any(q is main for q in g["params"]))


def set_step(inner: torch.optim.Optimizer, group: dict, state: dict, step: torch.Tensor) -> None:
    """Set Adam's step count of one parameter (and of its group where the optimizer counts
    per group)."""
    # torch's non-capturable AdamW expects its per-parameter step on the CPU.
    state["step"] = step.detach().clone().float().cpu()
    if uses_group_steps(inner):
        group["step"] = int(step)
