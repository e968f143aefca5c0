"""Helpers, no tests: the runtime's failure scenarios on two gloo ranks, run after the other
scenarios of the PP=2 launch (`test_runtime_dist.py`'s world2 fixture targets `world2` here).

* one rank alone gets a bad plan (message shapes it cannot produce): every rank raises before
  communicating, the other ones naming the rejecting rank and its reason;
* the ranks get plans of different iterations (each valid): every rank raises;
* a ping over the pipeline group afterwards shows that no message of the refused plans was sent;
* last (a timed-out gloo group is not reused): rank 0 stalls in its first Forward, past a 2 s
  timeout. Rank 1 must time out waiting for rank 0's activations; rank 0, waking up, finds its
  peer gone (or times out waiting for gradients). Each rank returns its error instead of raising,
  so the test sees them all.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import test_runtime_scenarios as sc
import test_runtime_setups as st
import torch
import torch.distributed as dist
from test_runtime_workers import Groups, build_chunks, make_groups, pick, run_executor, singles

from megatron_dip.runtime.errors import PipelineCommError
from megatron_dip.runtime.executor import ExecutorConfig
from megatron_dip.runtime.p2p import P2PConfig
from megatron_dip.schedule.engine import PlanError

STALL_TIMEOUT_S = 2.0
STALL_S = 5.0  # rank 1 must have timed out (after 2 s) well before rank 0 wakes up


def world2(*, rank: int, world_size: int, scenarios: bool = True) -> dict:
    """`test_runtime_scenarios.world2` (unless `scenarios` is False), then the failure scenarios
    (module docstring)."""
    out = sc.world2(rank=rank, world_size=world_size) if scenarios else {}
    started = time.monotonic()
    single = singles(world_size)
    g = Groups(pp=pick(make_groups(world_size, [[0, 1]])), tp=single, single=single)
    vlm = st.make_batch("vlm", sc.vlm_microbatches(), sizes=sc.VLM_SIZES)
    pl = st.dip_placement(vlm.model, 2, {"vit": 1, "llm": 1})
    plan = st.segment_plan(vlm, pl)
    mine = _as_float32(plan) if rank == 1 else plan  # shapes rank 1's model cannot produce
    out["fault_one_bad_rank"] = _outcome(lambda: run_executor(vlm, pl, mine, g))
    other = replace(plan, iteration=plan.iteration + 1) if rank == 1 else plan
    out["fault_other_iteration"] = _outcome(lambda: run_executor(vlm, pl, other, g))
    out["fault_ping"] = _ping(g.pp)
    out["fault_stall"] = _outcome(lambda: _stalled_run(vlm, pl, plan, g))
    out["fault_seconds"] = time.monotonic() - started  # what these scenarios add to the launch
    return out


def _as_float32(plan):
    return replace(
        plan,
        programs=tuple(
            replace(p, instructions=tuple(sc._as_float32(i) for i in p.instructions))
            for p in plan.programs
        ),
    )


def _outcome(run) -> dict[str, Any]:
    """Run a scenario that must fail; its error as plain data (None fields if it did not)."""
    started = time.monotonic()
    try:
        run()
    except (PlanError, PipelineCommError) as e:
        return {
            "error": type(e).__name__,
            "message": str(e),
            "seconds": time.monotonic() - started,
            **{a: _plain(getattr(e, a, None)) for a in ("rank", "index", "peer", "key", "tensor")},
        }
    return {"error": None, "message": "", "seconds": time.monotonic() - started}


def _plain(value):
    return value if value is None or isinstance(value, (int, str)) else str(value)


def _ping(group: dist.ProcessGroup) -> list[float]:
    """Exchange one tensor with the peer: a stray message of a refused plan would be received
    (or clash in size) instead."""
    peer = 1 - group.rank()
    sent = torch.full((3,), 10.0 + group.rank(), dtype=torch.float64)
    got = torch.zeros(3, dtype=torch.float64)
    glob = dist.get_global_rank(group, peer)
    ops = [dist.P2POp(dist.isend, sent, glob, group), dist.P2POp(dist.irecv, got, glob, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got.tolist()


def _stalled_run(vlm: st.Batch, pl, plan, g: Groups) -> None:
    """The segment plan with a 2 s timeout; rank 0's first Forward sleeps 5 s first."""
    chunks = build_chunks(vlm, pl, g)
    if g.pp.rank() == 0:
        first = plan.program(0).instructions[0]
        assert first.stage.module == "vit" and first.stage.chunk == 0, first
        chunk = next(c for c in chunks if c.chunk.module == "vit")
        forward = chunk.forward

        def sleepy(*args, **kwargs):
            time.sleep(STALL_S)
            return forward(*args, **kwargs)

        chunk.forward = sleepy
    config = ExecutorConfig(p2p=P2PConfig(timeout_s=STALL_TIMEOUT_S))
    st.rank_runtime(vlm, pl, chunks, pp_group=g.pp, config=config).run(plan, vlm.by_index)
