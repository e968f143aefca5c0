"""Segment ordering by Monte-Carlo tree search, scored by the list scheduler.

The search decides the priority order of *units*: all segments of one module for one microbatch
(e.g. "the ViT work of microbatch 3"). Units of one module keep their microbatch order and a
producer's unit precedes its consumer's unit of the same microbatch, which prunes the space to
the interleavings that matter (how far the vision encoder runs ahead of the LLM, and where).

Tree nodes are unit-order prefixes. Selection by UCB1, expansion of one child per iteration,
a few random completions (rollouts) per expansion, each scored by the list scheduler's makespan.
The budget is a number of rollouts (deterministic for a seed) capped by wall time; the canonical
greedy order is always evaluated first, so the search never returns anything worse than it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from .process import die_with_parent

Unit = tuple[str, int]  # (module, microbatch)


@dataclass(frozen=True)
class SearchConfig:
    """Budget and determinism of the segment-order search."""

    max_rollouts: int = 200
    time_budget_s: float = 2.0
    rollouts_per_expansion: int = 2
    exploration: float = 0.5
    greedy_rollout_bias: float = 0.5  # chance a rollout step follows the canonical order
    seed: int = 0
    workers: int = 1


@dataclass(frozen=True)
class UnitConstraints:
    """Which units exist and which must come first."""

    units: tuple[Unit, ...]  # canonical order
    before: dict[Unit, tuple[Unit, ...]] = field(default_factory=dict)

    def allowed(self, placed: set[Unit]) -> list[Unit]:
        return [
            u
            for u in self.units
            if u not in placed and all(b in placed for b in self.before.get(u, ()))
        ]


def unit_constraints(
    units_by_module: dict[str, list[int]], feeds: dict[str, str | None], *, lookahead: int = 1
) -> UnitConstraints:
    """Units and their precedence; canonical order lets producers run `lookahead` microbatches
    ahead of their consumer (the order the greedy plan uses)."""
    before: dict[Unit, list[Unit]] = {}
    for module, mbs in units_by_module.items():
        for a, b in zip(mbs, mbs[1:]):
            before.setdefault((module, b), []).append((module, a))
        consumer = feeds.get(module)
        if consumer:
            for mb in mbs:
                if mb in units_by_module.get(consumer, []):
                    before.setdefault((consumer, mb), []).append((module, mb))

    def canonical_key(u: Unit) -> tuple[int, int]:
        depth = _depth(u[0], feeds)
        return (u[1] - lookahead * depth, -depth)

    units = sorted(((m, mb) for m, mbs in units_by_module.items() for mb in mbs), key=canonical_key)
    frozen = {u: tuple(v) for u, v in before.items()}
    ordered = _topological_fix(units, frozen)
    return UnitConstraints(tuple(ordered), frozen)


def _depth(module: str, feeds: dict[str, str | None]) -> int:
    depth, m = 0, module
    while feeds.get(m):
        depth, m = depth + 1, feeds[m]
    return depth


def _topological_fix(units: list[Unit], before: dict[Unit, tuple[Unit, ...]]) -> list[Unit]:
    placed: set[Unit] = set()
    out: list[Unit] = []
    pending = list(units)
    while pending:
        for i, u in enumerate(pending):
            if all(b in placed for b in before.get(u, ())):
                out.append(u)
                placed.add(u)
                del pending[i]
                break
    return out


class _Node:
    __slots__ = ("children", "untried", "visits", "value")

    def __init__(self, untried: list[Unit]) -> None:
        self.children: dict[Unit, _Node] = {}
        self.untried = untried
        self.visits = 0
        self.value = 0.0


@dataclass(frozen=True)
class SearchResult:
    order: tuple[Unit, ...]
    makespan: float
    greedy_makespan: float
    rollouts: int


def mcts_order(
    constraints: UnitConstraints,
    score: Callable[[Sequence[Unit]], float],
    config: SearchConfig,
) -> SearchResult:
    """Search a unit order minimising `score` (the list scheduler's makespan)."""
    rng = random.Random(config.seed)
    greedy = score(constraints.units)
    best_order, best = constraints.units, greedy
    root = _Node(constraints.allowed(set()))
    deadline = time.monotonic() + config.time_budget_s
    rollouts = 1
    while rollouts < config.max_rollouts and time.monotonic() < deadline:
        path, prefix = _select_and_expand(root, constraints, config.exploration)
        rewards = []
        for _ in range(min(config.rollouts_per_expansion, config.max_rollouts - rollouts)):
            order = _rollout(prefix, constraints, rng, config.greedy_rollout_bias)
            t = score(order)
            rollouts += 1
            rewards.append(greedy / t if t > 0 else 1.0)
            if t < best - 1e-12:
                best, best_order = t, tuple(order)
        reward = max(rewards)
        for node in path:
            node.visits += 1
            node.value += reward
    return SearchResult(tuple(best_order), best, greedy, rollouts)


def _select_and_expand(
    root: _Node, constraints: UnitConstraints, c: float
) -> tuple[list[_Node], list[Unit]]:
    node, path, prefix = root, [root], []
    while not node.untried and node.children:
        log_n = math.log(node.visits + 1)
        unit, node = max(
            node.children.items(),
            key=lambda kv: (
                kv[1].value / max(1, kv[1].visits) + c * math.sqrt(log_n / max(1, kv[1].visits))
            ),
        )
        path.append(node)
        prefix.append(unit)
    if node.untried:
        unit = node.untried.pop(0)
        prefix.append(unit)
        child = _Node(constraints.allowed(set(prefix)))
        node.children[unit] = child
        path.append(child)
    return path, prefix


def _rollout(
    prefix: list[Unit], constraints: UnitConstraints, rng: random.Random, bias: float
) -> list[Unit]:
    order = list(prefix)
    placed = set(order)
    while len(order) < len(constraints.units):
        allowed = constraints.allowed(placed)
        unit = allowed[0] if rng.random() < bias else rng.choice(allowed)
        order.append(unit)
        placed.add(unit)
    return order


def parallel_mcts_order(
    constraints: UnitConstraints,
    score_factory: Callable[[], Callable[[Sequence[Unit]], float]],
    config: SearchConfig,
) -> SearchResult:
    """Root-parallel search: `config.workers` independent trees (seeds seed, seed+1, ...) share
    the rollout budget; the best order wins (ties to the lowest worker, so the answer is
    deterministic whenever the rollout budget, not the clock, ends the search)."""
    if config.workers <= 1:
        return mcts_order(constraints, score_factory(), config)
    per_worker = max(1, config.max_rollouts // config.workers)
    configs = [
        SearchConfig(
            max_rollouts=per_worker,
            time_budget_s=config.time_budget_s,
            rollouts_per_expansion=config.rollouts_per_expansion,
            exploration=config.exploration,
            greedy_rollout_bias=config.greedy_rollout_bias,
            seed=config.seed + w,
            workers=1,
        )
        for w in range(config.workers)
    ]
    # The workers die with the planner process that forked them (a killed planner would
    # otherwise leave them behind, reparented to init).
    with ProcessPoolExecutor(max_workers=config.workers, initializer=die_with_parent) as pool:
        results = list(pool.map(_run_worker, [(constraints, score_factory, c) for c in configs]))
    best = min(results, key=lambda r: r.makespan)
    return SearchResult(
        best.order, best.makespan, results[0].greedy_makespan, sum(r.rollouts for r in results)
    )


def _run_worker(args: tuple) -> SearchResult:
    constraints, score_factory, config = args
    return mcts_order(constraints, score_factory(), config)
