"""Optimizer and learning-rate schedule, and the optimizer state by global parameter name.

On GPUs this is Megatron-Core's own optimizer (`get_megatron_optimizer`: fp32 master weights
under --bf16, gradient clipping, --use-distributed-optimizer) with explicit process groups. On CPU
Megatron's optimizer refuses non-CUDA tensors (MEGATRON-ON-CPU.md), so `PlainAdamW` stands in:
torch's AdamW on the DDP-reduced gradients, with Megatron's gradient-norm semantics (squares
summed over the replica's model-parallel ranks, tensor-parallel duplicates counted once) and
clipping. Both expose `step() -> (ok, grad_norm, zeros)`, `param_groups` and `zero_grad()`, so
Megatron-Core's `OptimizerParamScheduler` drives either.

`named_state` / `load_named_state` move optimizer state (Adam moments, step, fp32 master weights)
in and out by global parameter name, so checkpoints load under any pipeline layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .build import LocalModel
from .setup import ParallelContext
from .validate import RunSpec

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
        t = spec.config.train
        named = model.named_parameters()
        groups = param_groups(named, t.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(
            groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
            weight_decay=t.weight_decay,
        )  # fmt: skip
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
        local = torch.zeros(1, dtype=torch.float64)
        tp_rank = getattr(self.params[0], "_dip_tp_rank", 0) if self.params else 0
        for p, g in zip(self.params, grads):
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
    from megatron.core.process_groups_config import ProcessGroupCollection

    t = spec.config.train
    config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=spec.dtype == "bfloat16",
        params_dtype=torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32,
        use_distributed_optimizer=spec.config.parallel.use_distributed_optimizer,
    )  # fmt: skip
    pgs = ProcessGroupCollection()
    pgs.dp, pgs.dp_cp, pgs.tp, pgs.pp, pgs.mp = ctx.dp, ctx.dp, ctx.tp, ctx.pp, ctx.mp
    pgs.expt_dp, pgs.tp_ep_pp, pgs.intra_dist_opt = ctx.single, ctx.mp, ctx.dp
    return get_megatron_optimizer(
        config, model.ddp, use_gloo_process_groups=False, pg_collection=pgs
    )


def build_optimizer(model: LocalModel, *, spec: RunSpec, ctx: ParallelContext):
    """Megatron-Core's optimizer on GPUs, `PlainAdamW` on CPU (module docstring)."""
    if spec.cuda:
        return megatron_optimizer(model, spec=spec, ctx=ctx)
    for _, p in model.named_parameters():
        p._dip_tp_rank = ctx.tp_rank  # read by the gradient norm
    return PlainAdamW(model, spec=spec, mp_group=ctx.mp)


def build_scheduler(optimizer, *, spec: RunSpec):
    """Megatron-Core's `OptimizerParamScheduler` from the --lr* flags."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = spec.config.train
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=t.lr_decay_iters or t.train_iters,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters,
        wd_incr_style="constant",
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


def named_state(optimizer, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer state by global name (`names`: id(model parameter) -> global name)."""
    out = {}
    for p, main, inner in optimizer_pairs(optimizer):
        state = {k: v.detach().clone() for k, v in inner.state.get(main, {}).items()}
        if main is not p:
            state["master"] = main.detach().clone()
        out[names[id(p)]] = state
    return out


def load_named_state(optimizer, names: dict[int, str], state: dict[str, dict]) -> int:
    """Load `named_state` output; returns how many parameters got state."""
    loaded = 0
    for p, main, inner in optimizer_pairs(optimizer):
        saved = state.get(names[id(p)])
        if saved is None:
            continue
        saved = dict(saved)
        master = saved.pop("master", None)
        if master is not None and main is not p:
            main.data.copy_(master)
        # Adam's "step" stays on the CPU (torch's non-capturable AdamW expects it there).
        inner.state[main] = {
            k: v.clone() if k == "step" else v.clone().to(main.device) for k, v in saved.items()
        }
        loaded += 1
    return loaded
