"""The runtime's split backward (`runtime/backward_split.py`, `runtime/linear_split.py`): B runs
autograd on the inputs and keeps the graph, W computes the weight gradients from what the weight
nodes recorded, with exactly the fused backward's gradients and without running either GEMM twice.
The plan format's and the planner's side of the split: `test_backward_split.py`."""

from __future__ import annotations

import pytest
import torch


class _Counted(torch.autograd.Function):
    """x * 2, counting its backward calls (an input-side node only B may run)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Counted.calls += 1
        (x,) = ctx.saved_tensors
        return grad * 2 + 0 * x


class _Block(torch.nn.Module):
    """norm -> linear -> gelu -> counted -> linear, a residual, a learned offset that depends
    on no input, and a weight used twice (shared by two weight nodes)."""

    def __init__(self, width=8, shared=False, ratio=2, offset=True):
        super().__init__()
        f64 = torch.float64
        self.ln = torch.nn.LayerNorm(width, dtype=f64)
        self.a = torch.nn.Linear(width, ratio * width, dtype=f64)
        self.b = torch.nn.Linear(ratio * width, width, dtype=f64)
        self.q = torch.nn.Parameter(torch.randn(width, dtype=f64)) if offset else None
        self.shared = shared

    def forward(self, x):
        h = _Counted.apply(torch.nn.functional.gelu(self.a(self.ln(x))))
        out = self.b(h) + x
        out = out + self.q * 3 if self.q is not None else out
        return self.b(self.a(out)) if self.shared else out


def _split_run(model, x, grad, *, leaves=True):
    from megatron_dip.runtime.backward_split import SavedStore, backward_input, backward_weight

    params = list(model.parameters())
    accs = [p.expand_as(p).grad_fn.next_functions[0][0] for p in params]  # as Megatron's DDP
    fired = []
    for p, acc in zip(params, accs):
        acc.register_hook(lambda *_, p=p: fired.append(p))
    xs = x.clone().requires_grad_(leaves)
    store = SavedStore()
    with store.hooks():
        y = model(xs)
    _Counted.calls = 0
    pending = backward_input(
        [y], [grad], [xs] if leaves else [], params, keep_graph=True, store=store
    )
    after_b = (_Counted.calls, list(fired))
    backward_weight(pending)
    return xs, after_b, (_Counted.calls, fired[len(after_b[1]) :])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("leaves", [True, False])
def test_runtime_split_gives_fused_gradients_without_rerunning_b(shared, leaves):
    """B then W equals the fused backward in fp64 (input and every parameter gradient); B-only
    nodes run once, in B (unless two weight nodes share a parameter); the grad accumulators
    (where Megatron's DDP hooks sit) of matrices fire in W only, those of vectors (norm, bias
    added alone, learned offset) in B; a chunk whose inputs need no gradient (a first chunk)
    does all its work in W."""
    torch.manual_seed(0)
    model = _Block(shared=shared)
    twin = _Block(shared=shared)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64)
    grad = torch.randn(5, 8, dtype=torch.float64)
    xf = x.clone().requires_grad_(leaves)
    model(xf).backward(grad)
    xs, after_b, after_w = _split_run(twin, x, grad, leaves=leaves)
    if leaves:
        torch.testing.assert_close(xs.grad, xf.grad, rtol=1e-12, atol=0)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-15, msg=name)
    (b_calls, in_b), (w_calls, in_w) = after_b, after_w
    assert b_calls == (1 if leaves else 0)
    assert all(p.dim() == 1 for p in in_b) and (bool(in_b) == leaves)
    assert {id(p) for p in twin.parameters() if p.dim() > 1} <= {id(p) for p in in_w}
    assert {id(p) for p in in_b + in_w} == {id(p) for p in twin.parameters()}
    # Weight nodes sharing a parameter are one engine call in W, which reaches the input-side
    # nodes between them again (their tensors are kept for that).
    assert w_calls == (2 if shared and leaves else 1)


def test_pending_weight_holds_only_what_w_needs():
    """After B the stage's boxed saved tensors that only B unpacks are gone; the pending W holds
    the weight GEMMs' saved inputs and their recorded output gradients, what
    `CostModel.weight_bytes` prices (`Op.w_held`): less than the forward saved here."""
    from megatron_dip.runtime.backward_split import SavedStore, backward_input, backward_weight

    torch.manual_seed(0)
    model = _Block(width=64, ratio=4, offset=False)
    params = list(model.parameters())
    x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    store = SavedStore()
    with store.hooks():
        y = model(x)
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}

    def nbytes(tensors):
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(v for k, v in seen.items() if k not in param_ptrs)

    saved = nbytes(store.tensors())
    grad = torch.ones_like(y)
    pending = backward_input([y], [grad], [x], params, keep_graph=True, store=store)
    # Kept: exactly the two linears' inputs (the norm's output, the counted node's output);
    # freed: GELU's and the counted node's inputs, the norm's input and statistics (its weight
    # gradients were done in B).
    assert nbytes(store.tensors()) == (32 * 64 + 32 * 256) * 8
    # Held in all: those and the two linears' output gradients.
    assert nbytes(pending.tensors()) == 2 * (32 * 64 + 32 * 256) * 8 < saved
    backward_weight(pending)
    assert not list(pending.tensors())


class _MegatronMLP(torch.nn.Module):
    """Two of Megatron's local linear layers (its Python autograd Function) around a GELU."""

    def __init__(self, group):
        super().__init__()
        f64 = torch.float64
        self.group = group
        self.w1 = torch.nn.Parameter(torch.randn(16, 8, dtype=f64))
        self.b1 = torch.nn.Parameter(torch.randn(16, dtype=f64))
        self.w2 = torch.nn.Parameter(torch.randn(8, 16, dtype=f64))

    def forward(self, x):
        from megatron.core.tensor_parallel.layers import (
            linear_with_grad_accumulation_and_async_allreduce as linear,
        )

        flags = {"gradient_accumulation_fusion": False, "sequence_parallel": False}
        h = linear(x, self.w1, self.b1, allreduce_dgrad=False, tp_group=self.group, **flags)
        h = torch.nn.functional.gelu(h)
        return linear(h, self.w2, None, allreduce_dgrad=False, tp_group=self.group, **flags)


def test_megatron_linears_split_without_computing_either_gemm_twice(single_rank_world, monkeypatch):
    """Megatron's local linears in a split backward (`runtime.linear_split`): B runs each one's
    backward through Megatron's deferral (no weight GEMM: it returns no weight gradient), W
    never runs it again and accumulates the fused backward's weight and bias gradients
    (fp64), through the accumulators; the layers' attributes are left as they were."""
    from megatron.core.tensor_parallel import layers

    from megatron_dip.runtime.backward_split import SavedStore, backward_input, backward_weight

    calls = []
    original = layers.LinearWithGradAccumulationAndAsyncCommunication.backward

    def counted(ctx, grad):
        out = original(ctx, grad)
        calls.append(out[1] is not None)  # computed a weight gradient
        return out

    monkeypatch.setattr(
        layers.LinearWithGradAccumulationAndAsyncCommunication, "backward", staticmethod(counted)
    )
    torch.manual_seed(0)
    model = _MegatronMLP(single_rank_world)
    twin = _MegatronMLP(single_rank_world)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    grad = torch.randn(2, 3, 8, dtype=torch.float64)
    xf = x.clone().requires_grad_()
    model(xf).backward(grad)
    assert calls == [True, True]
    calls.clear()
    params = list(twin.parameters())
    xs = x.clone().requires_grad_()
    store = SavedStore()
    with store.hooks():
        y = twin(xs)
    pending = backward_input([y], [grad], [xs], params, keep_graph=True, store=store)
    assert calls == [False, False] and all(p.grad is None for p in params)
    backward_weight(pending)
    assert calls == [False, False]
    torch.testing.assert_close(xs.grad, xf.grad, rtol=1e-12, atol=0)
    for (name, p), q in zip(model.named_parameters(), params):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-15, msg=name)
        assert "main_grad" not in q.__dict__ and "grad_added_to_main_grad" not in q.__dict__


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_pending_w_holds_the_graph_of_b_until_w():
    """W reads nodes of B's graph through Python handles (Megatron's linears' saved inputs).
    In torch 2.11 a Python Function's handle does not keep its node alive: on one H200 the
    split failed in its first W ("saved tensors ... already been freed") once the executor had
    dropped B's roots. So the pending W anchors the roots' graph: a C++ root node by its handle
    (the graph without the root's data), a Python Function's root by the tensor; W lets go."""
    from megatron_dip.runtime.backward_split import (
        SavedStore,
        backward_input,
        backward_weight,
        graph_anchor,
    )

    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    store = SavedStore()
    with store.hooks():
        h = x @ w
        roots = [torch.tanh(h), _Identity.apply(h)]
    grads = [torch.ones_like(r) for r in roots]
    pending = backward_input(roots, grads, [x], [w], keep_graph=True, store=store)
    assert pending.anchors[0] is roots[0].grad_fn and graph_anchor(roots[0]) is roots[0].grad_fn
    assert pending.anchors[1] is roots[1]  # a Python Function's root: the tensor itself
    backward_weight(pending)
    assert pending.anchors == ()
    torch.testing.assert_close(w.grad, x.t() @ (grads[0] * (1 - roots[0] ** 2) + grads[1]))
