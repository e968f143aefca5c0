"""A chunk's backward in two halves: input gradients (B) now, weight gradients (W) later.

The split is `torch.distributed.pipelining`'s (`_backward.stage_backward_input` / `_weight`),
written for this runtime. The chunk's autograd graph has three kinds of nodes: those whose
gradient depends on the chunk's inputs (the "input side": everything B must run to produce the
input gradients), those that lead only to parameters (the weight side: the accumulators, a
weight's transpose or cast), and the rest. The input-side nodes with an edge into the weight
side are the *weight nodes* (a linear layer's GEMM node, a norm's node): they compute both an
input gradient and a weight gradient. B runs the engine from the chunk's outputs to its input
leaves, keeping the graph, and records the gradient each weight node receives (a pre-hook on
the node). W runs the engine again, but from the weight nodes with those recorded gradients
(`GradientEdge` roots) to the parameters only: the engine then evaluates just the weight
nodes' weight-gradient outputs and the weight side, never the rest of the input side, and the
parameters' gradient accumulators run as in a fused backward, so Megatron's DDP hooks
(`main_grad` accumulation) fire in W. A weight node reached in W from another weight node
would add that contribution to its recorded gradient: a pre-hook pins each weight node's
gradient to the recorded one (torch does the same). Every node's gradient is therefore the one
it receives in the fused backward, so B then W gives the fused backward's gradients (fp64 tests,
up to the order in which a parameter's contributions are summed).

Which weight gradients wait for W: those of weight nodes that reach a matrix (a GEMM's
weight), except Megatron's row-parallel linears. A weight node whose parameters are all vectors
(a norm's weight, a bias added on its own) or row-parallel weights is done in B (its parameters
are among B's `inputs=`): a vector's gradient is a cheap reduction, and deferring either would
hold an output gradient that is full hidden width on every tensor-parallel rank (a norm's, an
attention out-projection's or MLP down-projection's), about as much as the stage's activations;
the cost model prices them in B (`modalities.costs.gemm`).

Outputs that do not depend on the inputs (a first chunk, whose inputs are data) and lead to
parameters are W's roots themselves, with their output gradients: B does nothing for them.

Memory. Autograd keeps a node's saved tensors while the node lives, and the weight nodes keep
the whole input side alive through their edges. So the forward of a split stage runs under
saved-tensor hooks (`SavedStore`) that box every saved tensor; B marks the boxes it unpacks,
and those unpacked by a weight node as W's; after B every box only B needed is emptied. What a
pending W holds is then what the cost model prices as `StageCost.weight_bytes`: the weight
nodes' saved inputs and their recorded output gradients, for every GEMM its activation input
and its output gradient (and what autograd saved where other
saved-tensor hooks own the tensors: a recomputed region keeps its inputs and recomputes again
in W, an offloaded one reloads).

Python autograd Functions among the weight nodes compute all their gradients in one call (the
engine cannot ask them for one), so run as weight nodes they would repeat in W the input GEMM
they did in B and do in B the weight GEMM W does. Megatron's local linear layers are such a
Function: `linear_split` runs them through Megatron's own deferral in B and computes their
weight gradients in W. Transformer Engine's layers built with `delay_wgrad_compute` defer
their weight GEMMs themselves (`delayed_wgrad`): for autograd their weights are done in B,
where the layer's backward queues the GEMM, and W calls their `backward_dw()`.

A chunk without weight gradients (a frozen module) has no W: its B runs the whole backward and
keeps nothing.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from .delayed_wgrad import compute_delayed, is_delayed
from .linear_split import DeferredLinears, split_deferrable
from .sent_outputs import backward


class _Box:
    """One saved tensor of a split stage's forward; `tensor` None once only B needed it."""

    __slots__ = ("tensor", "in_b", "in_w")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.in_b = False  # unpacked by B
        self.in_w = False  # unpacked by a weight node in B: W unpacks it again


class SavedStore:
    """The saved tensors of one split stage's forward (module docstring, "Memory")."""

    def __init__(self) -> None:
        self.boxes: list[_Box] = []
        self.owners: set[Node] = set()  # weight nodes whose saved tensors B unpacked from here
        self._local = threading.local()  # which thread is inside a weight node

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks to run the stage's forward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Box:
        box = _Box(tensor)
        self.boxes.append(box)
        return box

    def _unpack(self, box: _Box) -> torch.Tensor:
        if box.tensor is None:
            raise RuntimeError("a split backward's W needed a tensor only B was to use")
        box.in_b = True
        if getattr(self._local, "inside", 0) > 0:
            box.in_w = True
            self.owners.add(self._local.node)
        return box.tensor

    def enter_weight_node(self, node: Node, *_) -> None:
        """Pre-hook of a weight node in B: what it unpacks, W unpacks again."""
        self._local.inside = getattr(self._local, "inside", 0) + 1
        self._local.node = node

    def leave_weight_node(self, *_) -> None:
        """Post-hook of a weight node in B."""
        self._local.inside -= 1

    def release(self) -> None:
        """After B: empty every box that only B needed."""
        kept = []
        for box in self.boxes:
            if box.in_b and not box.in_w:
                box.tensor = None
            else:
                kept.append(box)
        self.boxes = kept

    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors still held (for `memory_probe.HeldActivations`); a box may hold a
        `module_recompute.Recipe` instead of a tensor: what it holds."""
        for box in self.boxes:
            if isinstance(box.tensor, torch.Tensor):
                yield box.tensor
            elif box.tensor is not None:
                yield from box.tensor.tensors()


@dataclass
class _Group:
    """Roots of one engine call of W and the parameters it accumulates."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


@dataclass
class PendingWeight:
    """What a stage's W needs from its B: one engine call per group of weight nodes that share
    parameters (and one for the outputs B did not differentiate), the weight nodes whose
    gradient is pinned, and the saved tensors kept for them."""

    groups: list[_Group] = field(default_factory=list)
    pinned: list[tuple[Node, tuple]] = field(default_factory=list)  # weight node, its gradient
    store: SavedStore | None = None
    linears: DeferredLinears = field(default_factory=lambda: DeferredLinears([]))
    delayed: tuple[torch.nn.Module, ...] = ()  # layers whose `backward_dw` W calls
    # What keeps B's graph alive until W (`graph_anchor`): W reads nodes B left behind.
    anchors: tuple = ()

    def tensors(self) -> Iterator[torch.Tensor]:
        """Tensors this pending W holds: recorded gradients and kept saved tensors."""
        for group in self.groups:
            yield from group.grads
        yield from self.linears.tensors()
        if self.store is not None:
            yield from self.store.tensors()


@dataclass
class _Graph:
    """A chunk's graph as B and W see it (module docstring): the weight nodes W runs, in groups
    that share parameters, with each group's parameters; the parameters B accumulates itself
    (vectors only: norms' weights, biases); the outputs W starts from itself."""

    groups: list[tuple[list[Node], list[Node]]]  # (weight nodes, their parameters' nodes)
    in_b: list[Node]  # parameter nodes B accumulates
    w_roots: list[int]
    linear_groups: list[tuple[list[Node], list[Node]]] = field(default_factory=list)


def _post_order(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from `roots`, each after all nodes its edges lead to."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(n, False) for n in roots]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in seen)
    return order


def _share_groups(reach: dict[Node, frozenset]) -> list[tuple[list[Node], list[Node]]]:
    """Weight nodes grouped so that no two groups reach a common parameter (union-find)."""
    owner: dict[Node, int] = {}  # parameter node -> group id
    groups: dict[int, tuple[list[Node], set[Node]]] = {}
    for gid, (node, params) in enumerate(reach.items()):
        nodes, ps = [node], set(params)
        for other in {owner[p] for p in params if p in owner}:
            more_nodes, more_params = groups.pop(other)
            nodes, ps = more_nodes + nodes, ps | more_params
        for p in ps:
            owner[p] = gid
        groups[gid] = (nodes, ps)
    return [(nodes, list(ps)) for nodes, ps in groups.values()]


def classify(
    roots: Sequence[GradientEdge], leaves: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> _Graph:
    """The weight nodes of the graph under `roots` (input-side nodes with an edge into the
    weight side), grouped by the parameters they reach through the weight side, and the roots
    that do not depend on `leaves` but lead to `params`."""
    leaf_nodes = {get_gradient_edge(t).node for t in leaves}
    param_nodes = {get_gradient_edge(p).node for p in params}
    inputs_side: dict[Node, bool] = {}
    reach: dict[Node, frozenset] = {}  # weight side: the parameter nodes a node leads to
    weights: dict[Node, frozenset] = {}  # weight node -> parameters it reaches on the weight side
    for node in _post_order(e.node for e in roots):
        kids = [c for c, _ in node.next_functions if c is not None]
        inputs_side[node] = node in leaf_nodes or any(inputs_side[c] for c in kids)
        side = frozenset().union(*(reach[c] for c in kids if not inputs_side[c]))
        if inputs_side[node]:
            if side:
                weights[node] = side
            continue
        reach[node] = side | {node} if node in param_nodes else side
    w_roots = [i for i, e in enumerate(roots) if reach.get(e.node)]
    groups, in_b = [], []
    for nodes, pnodes in _share_groups(weights):
        if all(_done_in_b(p.variable) for p in pnodes):
            in_b.extend(pnodes)
        else:
            groups.append((nodes, pnodes))
    return _Graph(groups, in_b, w_roots)


def _done_in_b(param: torch.Tensor) -> bool:
    """Whether a split backward accumulates `param`'s gradient in B: a vector (a norm's weight,
    a bias added alone), the weight of Megatron's row-parallel linear (its output gradient,
    full width on every TP rank, would cost W about the stage's activations to hold), or a
    weight whose layer delays its GEMM itself (`delayed_wgrad`: B only queues it)."""
    row_parallel = getattr(param, "tensor_model_parallel", False) and (
        getattr(param, "partition_dim", None) == 1
    )
    return param.dim() <= 1 or row_parallel or is_delayed(param)


def input_leaves(inputs: Iterable[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The input tensors of a chunk that receive gradients (autograd leaves with grad)."""
    return [t for msg in inputs for t in msg.values() if t.requires_grad]


def _record(recorded: dict, node: Node, grads: tuple) -> None:
    """Pre-hook of a weight node in B: remember the gradient it receives."""
    recorded[node] = grads


def _hook_weight_nodes(graph: _Graph, recorded: dict, store: SavedStore | None) -> list:
    handles = []
    for nodes, _ in graph.groups:
        for node in nodes:
            handles.append(node.register_prehook(functools.partial(_record, recorded, node)))
            if store is not None:
                enter = functools.partial(store.enter_weight_node, node)
                handles.append(node.register_prehook(enter))
                handles.append(node.register_hook(store.leave_weight_node))
    return handles


def _pending(graph: _Graph, recorded: dict, params: Sequence[torch.Tensor]) -> PendingWeight:
    """W's engine calls: one per group of weight nodes, one for the outputs B left alone."""
    by_node = {get_gradient_edge(p).node: p for p in params}
    pending = PendingWeight()
    for nodes, pnodes in graph.groups:
        group = _Group(params=[by_node[p] for p in pnodes])
        for node in nodes:
            got = recorded.get(node)
            if got is None:  # no gradient reached it: its weights get none in a fused backward
                continue
            if len(nodes) > 1:  # one may feed another in W: pin each to its recorded gradient
                pending.pinned.append((node, got))
            for k, g in enumerate(got):
                if g is not None:
                    group.edges.append(GradientEdge(node, k))
                    group.grads.append(g)
        if group.edges:
            pending.groups.append(group)
    return pending


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    leaves: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    *,
    keep_graph: bool,
    store: SavedStore | None = None,
    delayed: Sequence[torch.nn.Module] = (),
) -> PendingWeight | None:
    """B: accumulate the gradients of `leaves` (the chunk's inputs). With `keep_graph` (a W
    follows for `params`) only those, recording what W needs (module docstring); without, the
    whole backward (no W). `store`: the stage forward's saved tensors, emptied of B's own.
    `delayed`: the chunk's layers that queue their weight GEMMs (`delayed_wgrad`), for W."""
    if not roots:
        return None
    if not keep_graph:
        backward(roots, grads)
        compute_delayed(delayed)
        return None
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
    edges = [get_gradient_edge(r) for r in roots]
    graph = classify(edges, leaves, params)
    recorded: dict[Node, tuple] = {}
    handles = _hook_weight_nodes(graph, recorded, store)
    by_node = {get_gradient_edge(p).node: p for p in params}
    linears = _deferred_linears(graph, store)
    linears.before_b()
    try:
        if leaves:
            backward(
                roots, grads, inputs=[*leaves, *(by_node[n] for n in graph.in_b)], keep_graph=True
            )
    finally:
        linears.after_b()
        for h in handles:
            h.remove()
    _keep_own_linears(graph, linears, store)
    pending = _pending(graph, recorded, params)
    pending.anchors = tuple(graph_anchor(r) for r in roots)
    pending.linears = linears
    pending.delayed = tuple(delayed)
    if graph.w_roots:
        pending.groups.append(
            _Group(
                [edges[i] for i in graph.w_roots], [grads[i] for i in graph.w_roots], list(params)
            )
        )
    if store is not None and not pending.pinned and not _foreign(graph, recorded, store):
        store.release()  # pinned: W may run input-side nodes too
    pending.store = store
    return pending


def _deferred_linears(graph: _Graph, store: SavedStore | None) -> DeferredLinears:
    """Megatron's linears among the weight nodes, taken out of `graph`'s groups: B runs them
    through Megatron's deferral, W computes their weight gradients (`linear_split`). Only with
    a `store`, which tells afterwards whether their saved tensors stay at hand."""
    if store is None:
        return DeferredLinears([])
    rest, nodes = split_deferrable(graph.groups)
    graph.linear_groups = [g for g in graph.groups if g not in rest]
    graph.groups = rest
    return DeferredLinears(nodes)


def _keep_own_linears(graph: _Graph, linears: DeferredLinears, store: SavedStore | None) -> None:
    """After B: a deferred linear whose saved tensors other saved-tensor hooks own (a
    recomputed or offloaded region: reading them in W outside the engine would recompute the
    region for each) goes back to W's engine calls, which re-run its whole backward."""
    keep, buffers = [], []
    for node, buffer in zip(linears.nodes, linears.buffers):
        if store is not None and node in store.owners:
            keep.append(node)
            buffers.append(buffer)
        else:
            graph.groups.extend(g for g in graph.linear_groups if g[0][0] is node)
    linears.nodes, linears.buffers = keep, buffers


def _foreign(graph: _Graph, recorded: dict, store: SavedStore) -> bool:
    """Whether W re-runs a weight node that took no saved tensor from `store` in B: its
    tensors are other hooks' (a recomputed region's), whose W may need any of the store's boxes
    (a checkpoint's inputs, unpacked in B by whichever node came first), so B frees none."""
    return any(n in recorded and n not in store.owners for nodes, _ in graph.groups for n in nodes)


def _pin(grads: tuple, _incoming: tuple) -> tuple:
    """Pre-hook of a weight node in W: its gradient is the one recorded in B."""
    return grads


def backward_weight(pending: PendingWeight | None) -> None:
    """W: accumulate the gradients of the chunk's parameters from what B recorded (its groups
    name them), one engine call per group (so no call reaches back into the input side), then
    the delayed layers' queued GEMMs (after the engine calls, which may queue some: a first
    chunk's whole backward is W), and free it all."""
    if pending is None:
        return
    handles = [node.register_prehook(functools.partial(_pin, g)) for node, g in pending.pinned]
    try:
        pending.linears.weight_gradients()
        for group in pending.groups:  # graph retained: groups may share weight-side nodes; it
            # dies with the references dropped below
            torch.autograd.backward(
                group.edges, group.grads, inputs=group.params, retain_graph=True
            )
        compute_delayed(pending.delayed)
    finally:
        for h in handles:
            h.remove()
    pending.groups.clear()
    pending.pinned.clear()
    pending.delayed = ()
    pending.store = None
    pending.anchors = ()


def graph_anchor(root: torch.Tensor) -> object:
    """What keeps `root`'s autograd graph alive while W needs it, holding as little as it can.

    W reads nodes of B's graph through Python handles: Megatron's linears (their saved input,
    `linear_split`) and the weight nodes of its engine calls. A Python autograd Function's
    handle (its `ctx`) keeps its node alive in some torch releases only: in torch 2.11 the node
    dies with the last tensor or node pointing to it, and its saved tensors with it (autograd's
    "already been freed"), as soon as the executor drops B's roots. A root's C++ `grad_fn`
    handle owns its node, hence the graph below it, without the root's data; a root made by a
    Python Function (a sent output's hand-over) is held itself (its data is then the freed
    output's one-element placeholder)."""
    fn = root.grad_fn
    if fn is None or isinstance(fn, torch.autograd.function.BackwardCFunction):
        return root
    return fn


def trainable_parameters(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters whose gradients a chunk's W accumulates."""
    return [p for p in chunk.parameters() if p.requires_grad]
