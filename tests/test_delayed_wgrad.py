"""Split backwards with layers that delay their own weight GEMMs (`runtime/delayed_wgrad.py`).

Transformer Engine does not build without CUDA, so its delayed-wgrad protocol is played here by
`_QueuedLinear`, written from TE's `TransformerEngineBaseModule.backward_dw` (TE >= 2.3): the
backward computes the input gradient and queues the weight GEMM in `wgrad_store`; the weight
and bias are marked `skip_backward_post_hook`; `backward_dw()` pops the *oldest* queued GEMM,
assigns (not adds) the weight gradient, sets the bias gradient where there is none, and calls
the hooks registered with `register_wgrad_accumulation_and_reduce_hooks`. Megatron-Core's own
DDP (`delay_wgrad_compute`) registers those hooks and accumulates `main_grad`, as on a GPU.
"""

from __future__ import annotations

import collections

import pytest
import torch

from megatron_dip.runtime.backward_split import SavedStore, backward_input, backward_weight
from megatron_dip.runtime.delayed_wgrad import DELAYED_MARK, compute_delayed, delayed_modules

F64 = torch.float64


class _QueuedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        layer.dgrad_calls += 1
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        if layer.delay:
            layer.wgrad_store.append((flat_x, flat_g))
            return grad @ weight, None, None, None
        return grad @ weight, flat_g.t() @ flat_x, flat_g.sum(0), None


class _QueuedLinear(torch.nn.Module):
    """A linear layer with Transformer Engine's delayed-wgrad protocol (module docstring)."""

    def __init__(self, n_in: int, n_out: int, *, delay: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in, dtype=F64) / n_in**0.5)
        self.bias = torch.nn.Parameter(torch.randn(n_out, dtype=F64))
        self.delay = delay
        self.wgrad_store: collections.deque = collections.deque()
        self.hooks: list = []
        self.dgrad_calls = self.wgrad_calls = 0
        if delay:
            for p in (self.weight, self.bias):
                setattr(p, DELAYED_MARK, True)

    def forward(self, x):
        return _QueuedLinearFn.apply(x, self.weight, self.bias, self)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.hooks.append(hook)

    def backward_dw(self) -> None:
        if not self.delay:
            return
        x, g = self.wgrad_store.popleft()  # TE raises on an empty queue too
        self.wgrad_calls += 1
        self.weight.grad = g.t() @ x
        if self.bias.grad is None:
            self.bias.grad = g.sum(0)
        for hook in self.hooks:
            hook()


class _Block(torch.nn.Module):
    """norm -> queued linear -> gelu -> queued linear, a residual; a plain linear beside."""

    def __init__(self, width: int = 8, *, delay: bool = True) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width, dtype=F64)
        self.fc1 = _QueuedLinear(width, 2 * width, delay=delay)
        self.fc2 = _QueuedLinear(2 * width, width, delay=delay)
        self.plain = torch.nn.Linear(width, width, dtype=F64)

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return self.plain(h) + x


def _twins(seed: int = 0) -> tuple[_Block, _Block]:
    torch.manual_seed(seed)
    fused = _Block(delay=False)
    split = _Block(delay=True)
    split.load_state_dict(fused.state_dict())
    return fused, split


def _inputs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(3, 5, 8, dtype=F64), torch.randn(3, 5, 8, dtype=F64)) for _ in range(n)]


def _forward(model, x, *, leaves: bool):
    xs = x.clone().requires_grad_(leaves)
    store = SavedStore()
    with store.hooks():
        y = model(xs)
    return xs, y, store


def test_only_layers_owning_marked_parameters_are_delayed():
    """The layers found are those owning a trainable marked parameter (the parent block, which
    owns none, is not called); a layer that marks parameters without `backward_dw` is refused."""
    _, split = _twins()
    assert delayed_modules(split) == (split.fc1, split.fc2)
    split.fc2.weight.requires_grad_(False)
    split.fc2.bias.requires_grad_(False)
    assert delayed_modules(split) == (split.fc1,)
    bad = torch.nn.Linear(2, 2)
    setattr(bad.weight, DELAYED_MARK, True)
    with pytest.raises(TypeError, match="backward_dw"):
        delayed_modules(torch.nn.Sequential(bad))


@pytest.mark.parametrize("leaves", [True, False])
def test_split_with_delayed_layers_gives_fused_gradients_computing_each_gemm_once(leaves):
    """B then W with delayed layers gives the fused backward's input and parameter gradients
    (fp64): B runs every layer's backward once and queues its weight GEMM (no weight gradient
    yet), W pops each queue once and re-runs no layer's backward; the plain linear beside is
    split as before. Without input gradients (a first chunk) B does nothing and W runs the
    whole backward, queueing then popping."""
    fused, split = _twins()
    ((x, grad),) = _inputs(1)
    xf = x.clone().requires_grad_(leaves)
    fused(xf).backward(grad)
    xs, y, store = _forward(split, x, leaves=leaves)
    params = [p for p in split.parameters() if p.requires_grad]
    delayed = delayed_modules(split)
    pending = backward_input(
        [y], [grad], [xs] if leaves else [], params, keep_graph=True, store=store, delayed=delayed
    )
    layers = (split.fc1, split.fc2)
    assert [m.dgrad_calls for m in layers] == [int(leaves)] * 2
    assert [len(m.wgrad_store) for m in layers] == [int(leaves)] * 2
    assert all(m.weight.grad is None for m in layers) and split.plain.weight.grad is None
    backward_weight(pending)
    assert [(m.dgrad_calls, m.wgrad_calls, len(m.wgrad_store)) for m in layers] == [(1, 1, 0)] * 2
    if leaves:
        torch.testing.assert_close(xs.grad, xf.grad, rtol=1e-12, atol=0)
    for (name, p), q in zip(fused.named_parameters(), split.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)


def _ddp(model: torch.nn.Module, group, *, delay: bool):
    """Megatron-Core's DDP around `model`, as the executor drives it (asynchronous reductions
    started by the schedule; `delay_wgrad_compute` as the training build sets it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_dip.cpu_support import apply_cpu_fixes
    from megatron_dip.parallel.groups import run_collection

    apply_cpu_fixes()  # Megatron's gradient buffer asks for the current CUDA device
    model.config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=F64
    )
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        use_distributed_optimizer=False,
        bucket_size=None,
        delay_wgrad_compute=delay,
    )
    collection = run_collection(dp=group, tp=group, pp=group, mp=None, single=group)
    return DistributedDataParallel(
        config=model.config, ddp_config=config, module=model, pg_collection=collection
    )


def test_interleaved_sub_microbatches_accumulate_main_grad_through_megatrons_ddp(
    single_rank_world,
):
    """Two sub-microbatches of one chunk under Megatron's DDP, in a split plan's order (F1 F2
    B1 B2 W2 W1: each W pops the *oldest* queued GEMM, the other sub-microbatch's) and one
    fused backward (a fused Backward calls `backward_dw` right after): `main_grad` holds the
    fused backwards' sum (fp64), every weight gradient reached it through the hooks Megatron
    registered on the layers, and no `.grad` is left behind."""
    fused, split = _twins()
    batches = _inputs(3)
    for x, grad in batches:
        fused(x).backward(grad)
    ddp = _ddp(split, single_rank_world, delay=True)
    ddp.zero_grad_buffer()
    params = [p for p in split.parameters() if p.requires_grad]
    delayed = delayed_modules(split)
    with ddp.no_sync():
        runs = [_forward(ddp, x, leaves=True) for x, _ in batches[:2]]
        pendings = [
            backward_input([y], [g], [xs], params, keep_graph=True, store=s, delayed=delayed)
            for (xs, y, s), (_, g) in zip(runs, batches)
        ]
        for pending in reversed(pendings):
            backward_weight(pending)
        x, grad = batches[2]
        ddp(x).backward(grad)
        compute_delayed(delayed)
    assert [len(m.hooks) for m in (split.fc1, split.fc2)] == [2, 2]  # weight, bias
    for (name, p), q in zip(fused.named_parameters(), split.parameters()):
        torch.testing.assert_close(q.main_grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)
        assert q.grad is None, name


# -- the executor: split plans with delayed layers in real chunks ------------------------------


class _QueuedFc1(torch.nn.Module):
    """A chunk's MLP `linear_fc1` (Megatron's call: returns output and bias) as a
    `_QueuedLinear` with the same weight: a delayed layer inside a real Megatron layer."""

    def __init__(self, fc1: torch.nn.Module, *, delay: bool) -> None:
        super().__init__()
        out_features, in_features = fc1.weight.shape
        self.inner = _QueuedLinear(in_features, out_features, delay=delay)
        with torch.no_grad():
            self.inner.weight.copy_(fc1.weight)
            bias = getattr(fc1, "bias", None)
            self.inner.bias.copy_(bias if bias is not None else torch.zeros(out_features))

    def forward(self, x):
        return self.inner(x), None


def _chunks_with_queued_fc1(batch, placement, groups, *, delay: bool):
    import test_runtime_setups as st

    chunks = st.rank_chunks(batch, placement, groups)
    for chunk in chunks:
        for layer in chunk.layers:
            layer.mlp.linear_fc1 = _QueuedFc1(layer.mlp.linear_fc1, delay=delay)
    return chunks


def _executor_case(single_rank_world):
    import test_runtime_setups as st

    from megatron_dip.cpu_support import apply_cpu_fixes, seed_model_parallel_rng
    from megatron_dip.models.chunk import ModelGroups

    apply_cpu_fixes()  # Megatron's DDP asks for the current CUDA device
    seed_model_parallel_rng(st.CFG.seed)
    groups = ModelGroups(tp=single_rank_world, cp=single_rank_world)
    mbs = st.group_samples(st.samples("vlm", 10), [3, 2, 3, 2])
    batch = st.make_batch("vlm", mbs, sizes={"vit": 2})
    placement = st.dip_placement(batch.model, 1, {m.name: 2 for m in batch.model.modules})
    return batch, placement, groups, st.segment_plan(batch, placement)


def _wrapped(chunks, world, *, delay: bool):
    """The chunks in Megatron's DDP as the training build wraps them (`delay_wgrad_compute` on
    under a split backward)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_dip.runtime.ddp import DataParallelGroups, wrap_chunks_ddp

    config = DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        use_distributed_optimizer=False,
        bucket_size=None,
        delay_wgrad_compute=delay,
    )
    groups = DataParallelGroups(dp=world, tp=world, pp=world, single=world)
    wrapped = wrap_chunks_ddp(chunks, groups=groups, ddp_config=config)
    for chunk in wrapped:
        chunk.zero_grad_buffer()
    return wrapped


def test_executor_runs_split_plans_with_delayed_layers_exactly(single_rank_world):
    """A tiny VLM whose MLP input projections delay their weight GEMMs, on one rank under
    Megatron's DDP: the split plan (mixed fused and split backwards, W deferred past other
    stages' backwards, so the queues hold several sub-microbatches' GEMMs at once) gives the
    fused plan's gradients on the same layers without delay (fp64, `main_grad`); each layer ran
    every backward once and every queued GEMM was popped."""
    import test_runtime_setups as st
    import torch.distributed as dist

    from megatron_dip.runtime.ddp import main_grads

    batch, placement, groups, plan = _executor_case(single_rank_world)
    grads = {}
    for delay, run_plan in ((False, plan), (True, st.split_plan(plan))):
        chunks = _chunks_with_queued_fc1(batch, placement, groups, delay=delay)
        wrapped = _wrapped(chunks, single_rank_world, delay=delay)
        runtime = st.rank_runtime(batch, placement, wrapped, pp_group=dist.group.WORLD)
        runtime.run(run_plan, batch.by_index)
        grads[delay] = {
            f"{c.chunk.module}.{c.chunk.index}.{n}": g.clone()
            for w, c in zip(wrapped, chunks)
            for n, g in main_grads(w).items()
        }
        layers = [m for c in chunks for m in c.modules() if isinstance(m, _QueuedLinear)]
        assert layers and all(m.dgrad_calls > 0 for m in layers)
        if delay:
            assert all(m.wgrad_calls == m.dgrad_calls and not m.wgrad_store for m in layers)
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_executor_refuses_delayed_layers_whose_gradients_nothing_sums(single_rank_world):
    """Delayed layers in a chunk without Megatron's DDP, or in DDP built without
    `delay_wgrad_compute`, are refused before anything runs: `backward_dw` assigns each popped
    gradient, so their sum over sub-microbatches would be lost."""
    import test_runtime_setups as st
    import torch.distributed as dist

    batch, placement, groups, _ = _executor_case(single_rank_world)
    chunks = _chunks_with_queued_fc1(batch, placement, groups, delay=True)
    for held in (chunks, _wrapped(chunks, single_rank_world, delay=False)):
        with pytest.raises(ValueError, match="delay_wgrad_compute=True"):
            st.rank_runtime(batch, placement, held, pp_group=dist.group.WORLD).run(
                st.segment_plan(batch, placement), batch.by_index
            )
