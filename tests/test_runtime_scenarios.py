"""Helpers, no tests: all distributed scenarios of one world size, run in sequence inside each
worker process (targets of `distributed_harness.run_world`).

`world2` (pipeline size 2) and `world4` (PP=4; PP=2 x TP=2; PP=2 x DP=2) return, per rank, a
dict scenario -> result; rank 0 also computes the single-process references ("ref:<batch>"), on
the dense-mask attention (`attention_reference.dense_reference`).
The test modules compare.
"""

from __future__ import annotations

from dataclasses import replace

import test_runtime_setups as st
from attention_reference import dense_reference
from test_runtime_workers import (
    Groups,
    broadcast_plan,
    expect_rejection,
    guarded,
    make_groups,
    pick,
    reference,
    run_dropin,
    run_executor,
    run_held,
    run_stock,
    singles,
)

from megatron_dip.parallel import ParallelShape
from megatron_dip.runtime.executor import ExecutorConfig
from megatron_dip.runtime.p2p import P2PConfig
from megatron_dip.schedule.passes import RECEIVE_LEAD

VLM_SIZES = {"vit": 2}
T2V_SIZES = {"text": 2, "dit": 2}
OMNI_SIZES = {"vit": 2, "audio": 1}
# Per-rank memory limits (bytes, by pipeline size) that make the planner recompute some stages.
DIP_MEMORY = {2: 3.0e6, 4: 1.5e6}


def vlm_microbatches():
    # Samples 10-19 hold 0 to 6 images each (12 and 17 none), 3 to 10 text tokens.
    return st.group_samples(st.samples("vlm", 10, start=10), [3, 2, 3, 2])


def t2v_microbatches():
    return st.group_samples(st.samples("t2v", 10), [3, 2, 3, 2])


def omni_microbatches():
    # Samples 0-9: images only, audio only, both, neither; 4 to 18 tokens each.
    return st.group_samples(st.samples("omni", 10), [3, 2, 3, 2])


def _references(out: dict, single, *, frozen: bool = False) -> None:
    """The single-process references, on the dense-mask attention the packed attention replaced
    (`attention_reference`): every scenario (PP, TP2, sequence parallelism, DP) then checks the
    packed path against it. `frozen`: also T2V with a frozen text encoder."""
    with dense_reference():
        out["ref:vlm"] = reference(vlm_microbatches(), "vlm", single)
        out["ref:t2v"] = reference(t2v_microbatches(), "t2v", single)
        out["ref:omni"] = reference(omni_microbatches(), "omni", single)
        if frozen:
            out["ref:t2v-frozen"] = reference(t2v_microbatches(), "t2v-frozen", single)


def _pipeline_scenarios(out: dict, g: Groups, p: int, tag: str) -> None:
    """Segment plans (1 and 2 chunks per rank per module, recompute) and searched plans."""
    vlm = st.make_batch("vlm", vlm_microbatches(), sizes=VLM_SIZES)
    t2v = st.make_batch("t2v", t2v_microbatches(), sizes=T2V_SIZES)
    pl1 = st.dip_placement(vlm.model, p, {"vit": 1, "llm": 1})
    guarded(f"{tag}vlm_seg_v1", out, lambda: run_executor(vlm, pl1, st.segment_plan(vlm, pl1), g))
    pl2 = st.dip_placement(vlm.model, p, {"vit": 2, "llm": 2})
    plan = st.with_recompute(st.segment_plan(vlm, pl2), st.cycle_policy(pl2))
    cfg = ExecutorConfig(debug=True, p2p=P2PConfig(batched=False))
    guarded(f"{tag}vlm_seg_v2_rc", out, lambda: run_executor(vlm, pl2, plan, g, config=cfg))
    tpl = st.dip_placement(t2v.model, p, {"text": 2, "dit": 2})
    tplan = st.with_recompute(st.segment_plan(t2v, tpl), st.cycle_policy(tpl))
    cfg = ExecutorConfig(p2p=P2PConfig(use_tags=True))
    guarded(f"{tag}t2v_seg_v2_rc", out, lambda: run_executor(t2v, tpl, tplan, g, config=cfg))
    dpl = st.dip_placement(vlm.model, p, {"vit": 1, "llm": 2})
    dplan = broadcast_plan(lambda: st.dip_plan(vlm, dpl, memory_limit=DIP_MEMORY[p]), g.pp)
    # DIP's runtime default on GPUs: one communicator per (sender, receiver) pair.
    guarded(f"{tag}vlm_dip", out, lambda: run_executor(vlm, dpl, dplan, g, channels=True))
    tdpl = st.dip_placement(t2v.model, p, {"text": 1, "dit": 2})
    tdplan = broadcast_plan(lambda: st.dip_plan(t2v, tdpl, memory_limit=DIP_MEMORY[p]), g.pp)
    guarded(f"{tag}t2v_dip", out, lambda: run_executor(t2v, tdpl, tdplan, g))
    # DIP planning on a static Megatron placement (the start-up search may pick one): the ViT
    # whole on rank 0, the LLM in 2 chunks per rank.
    spl, _ = st.stock_placement(vlm.model, p, vp=2)
    splan = broadcast_plan(lambda: st.dip_plan(vlm, spl, memory_limit=DIP_MEMORY[p]), g.pp)
    guarded(f"{tag}vlm_dip_static", out, lambda: run_executor(vlm, spl, splan, g))
    _omni_pipeline(out, g, p, tag)
    # Split backwards (B, then W now or at the end of the program) with explicit reductions:
    # a segment plan with every recompute mode, a searched DIP plan.
    vsplit = st.split_plan(plan)
    guarded(f"{tag}vlm_split", out, lambda: run_executor(vlm, pl2, vsplit, g))
    tsplit = st.split_plan(tdplan)
    guarded(f"{tag}t2v_split", out, lambda: run_executor(t2v, tdpl, tsplit, g, channels=True))
    _held_activations(out, g, tag, [(vlm, pl2)])
    _held_by_dip_plans(out, g, p, tag, [(vlm, dpl), (t2v, tdpl)])


def _held_activations(out: dict, g: Groups, tag: str, cases) -> None:
    """Segment plans (two chunks per rank per module, no recompute) with sent outputs kept until
    their backward and freed once sent: the activation bytes held, at their peak."""
    for batch, placement in cases:
        plan = st.segment_plan(batch, placement)
        for deallocate, name in ((False, "kept"), (True, "freed")):
            guarded(
                f"{tag}held_{batch.kind}_{name}",
                out,
                lambda b=batch, pl=placement, q=plan, d=deallocate: run_held(
                    b, pl, q, g, deallocate=d
                ),
            )


def _held_by_dip_plans(out: dict, g: Groups, p: int, tag: str, cases) -> None:
    """DIP's plans as training runs them (receives posted one compute ahead on one communicator
    per pair of ranks, sent outputs freed, recomputation under the limit): the bytes held and
    the message buffers at their peaks, next to the simulator's memory model of the plan."""
    for batch, placement in cases:
        plan = broadcast_plan(
            lambda b=batch, pl=placement: st.dip_plan(
                b, pl, memory_limit=DIP_MEMORY[p], receive_lead=RECEIVE_LEAD
            ),
            g.pp,
        )
        guarded(
            f"{tag}held_{batch.kind}_dip",
            out,
            lambda b=batch, pl=placement, q=plan: run_held(
                b, pl, q, g, deallocate=True, channels=True
            ),
        )


def _omni_pipeline(out: dict, g: Groups, p: int, tag: str) -> None:
    """Two producers (ViT and audio encoder) feeding the LLM: a segment plan with recompute and
    a searched DIP plan, each module on its own segments."""
    omni = st.make_batch("omni", omni_microbatches(), sizes=OMNI_SIZES)
    spl = st.dip_placement(omni.model, p, {"vit": 1, "audio": 1, "llm": 1})
    splan = st.with_recompute(st.segment_plan(omni, spl), st.cycle_policy(spl))
    guarded(f"{tag}omni_seg_rc", out, lambda: run_executor(omni, spl, splan, g))
    opl = st.dip_placement(omni.model, p, {"vit": 1, "audio": 1, "llm": 2})
    oplan = broadcast_plan(lambda: st.dip_plan(omni, opl, memory_limit=DIP_MEMORY[p]), g.pp)
    guarded(f"{tag}omni_dip", out, lambda: run_executor(omni, opl, oplan, g, channels=True))
    osplit = st.split_plan(oplan)
    guarded(f"{tag}omni_split", out, lambda: run_executor(omni, opl, osplit, g))


def _stock_scenarios(out: dict, g: Groups, p: int, tag: str) -> None:
    """Megatron's interleaved and 1F1B orders: our executor vs. Megatron's own functions."""
    vlm = st.make_batch("vlm", vlm_microbatches())
    pl, units = st.stock_placement(vlm.model, p, vp=2)
    plan = st.megatron_plan(vlm, pl, units, vp=2)
    guarded(f"{tag}vlm_meg_interleaved", out, lambda: run_executor(vlm, pl, plan, g))
    batched = p > 2  # PP=2: Megatron's batched p2p swaps activations and gradients
    guarded(
        f"{tag}vlm_stock_interleaved",
        out,
        lambda: run_stock(vlm, pl, units, g, batch_p2p=batched),
    )
    t2v = st.make_batch("t2v", t2v_microbatches())
    tpl, tunits = st.stock_placement(t2v.model, p, vp=1)
    tplan = st.megatron_plan(t2v, tpl, tunits, vp=1)
    guarded(f"{tag}t2v_meg_1f1b", out, lambda: run_executor(t2v, tpl, tplan, g))
    guarded(f"{tag}t2v_stock_1f1b", out, lambda: run_stock(t2v, tpl, tunits, g, batch_p2p=True))
    # Both producers whole on the first stage, as Megatron's multimodal models put encoders.
    omni = st.make_batch("omni", omni_microbatches())
    opl, ounits = st.stock_placement(omni.model, p, vp=1)
    oplan = st.megatron_plan(omni, opl, ounits, vp=1)
    guarded(f"{tag}omni_meg_1f1b", out, lambda: run_executor(omni, opl, oplan, g))
    guarded(f"{tag}omni_stock_1f1b", out, lambda: run_stock(omni, opl, ounits, g, batch_p2p=True))


def _rejections(out: dict, g: Groups, p: int) -> None:
    vlm = st.make_batch("vlm", vlm_microbatches(), sizes=VLM_SIZES)
    pl = st.dip_placement(vlm.model, p, {"vit": 1, "llm": 1})
    other = st.dip_placement(vlm.model, p, {"vit": 1, "llm": 2})
    wrong_place = st.segment_plan(vlm, other)
    out["reject_placement"] = expect_rejection(lambda: run_executor(vlm, pl, wrong_place, g))
    plan = st.segment_plan(vlm, pl)
    wrong_shapes = replace(
        plan,
        programs=tuple(
            replace(prog, instructions=tuple(_as_float32(i) for i in prog.instructions))
            for prog in plan.programs
        ),
    )
    out["reject_shapes"] = expect_rejection(lambda: run_executor(vlm, pl, wrong_shapes, g))


def _as_float32(ins):
    from megatron_dip.schedule import Recv, Send

    if isinstance(ins, (Send, Recv)):
        specs = tuple(
            replace(s, dtype="float32") if s.dtype == "float64" else s for s in ins.tensors
        )
        return replace(ins, tensors=specs)
    return ins


def world2(*, rank: int, world_size: int) -> dict:
    """PP=2: segment, baseline and searched plans; Megatron's own schedules; rejections."""
    single = singles(world_size)
    pp = pick(make_groups(world_size, [[0, 1]]))
    g = Groups(pp=pp, tp=single, single=single)
    out: dict = {}
    if rank == 0:
        _references(out, single, frozen=True)
    _pipeline_scenarios(out, g, 2, "")
    # A frozen text encoder: split plans give it no weight half (and no reduction).
    frozen = st.make_batch("t2v-frozen", t2v_microbatches(), sizes=T2V_SIZES)
    fpl = st.dip_placement(frozen.model, 2, {"text": 1, "dit": 2})
    fplan = st.split_plan(st.segment_plan(frozen, fpl))
    guarded("t2vfrozen_split", out, lambda: run_executor(frozen, fpl, fplan, g))
    _stock_scenarios(out, g, 2, "")
    # The known trap, kept as a sensitivity check: Megatron's batched p2p at PP=2 interleaved.
    vlm = st.make_batch("vlm", vlm_microbatches())
    pl, units = st.stock_placement(vlm.model, 2, vp=2)
    guarded(
        "vlm_stock_interleaved_batched", out, lambda: run_stock(vlm, pl, units, g, batch_p2p=True)
    )
    _rejections(out, g, 2)
    return out


def _data_parallel(out: dict, g: Groups, replica: int) -> None:
    """PP=2 x DP=2, replicas with unequal microbatch counts and token counts."""
    for kind, mbs, sizes in (
        ("vlm", vlm_microbatches(), VLM_SIZES),
        ("t2v", t2v_microbatches(), T2V_SIZES),
        ("omni", omni_microbatches(), OMNI_SIZES),
    ):
        mine = mbs[:3] if replica == 0 else mbs[3:]
        batch = st.make_batch(kind, mine, sizes=sizes, all_microbatches=mbs, data_parallel=2)
        segs = {m.name: 2 for m in batch.model.modules}
        pl = st.dip_placement(batch.model, 2, segs)
        plan = replace(st.segment_plan(batch, pl), replica=replica)
        if kind != "vlm":  # offload and recompute across replicas (vlm also runs the drop-in)
            plan = st.with_recompute(plan, st.cycle_policy(pl))
        guarded(
            f"dp2_{kind}", out, lambda b=batch, p=pl, q=plan: run_executor(b, p, q, g, ddp=True)
        )
        if kind == "vlm":
            # Split backwards, each reduction started where the plan's ReduceGrads says.
            split = st.split_plan(plan)
            guarded(
                "dp2_vlm_split",
                out,
                lambda b=batch, p=pl, q=split: run_executor(b, p, q, g, ddp=True),
            )
            _drop_in(out, g, batch, pl, plan, replica)


def _drop_in(out: dict, g: Groups, batch: st.Batch, pl, plan, replica: int) -> None:
    """A PP=2 x DP=2 plan through Megatron's drop-in signature, with the replica group,
    per-pair channels and timing; then replica 1 alone holds a plan its model cannot produce:
    the drop-in agrees on the verdict over the replica group, so replica 0 refuses too."""
    pipelines = [[0, 1], [2, 3]]
    name = f"dropin_dp2_{batch.kind}"
    guarded(name, out, lambda: run_dropin(batch, pl, plan, g, pipelines=pipelines))
    bad = replace(
        plan,
        programs=tuple(
            replace(prog, instructions=tuple(_as_float32(i) for i in prog.instructions))
            for prog in plan.programs
        ),
    )
    mine = bad if replica == 1 else plan
    out[f"{name}_reject"] = expect_rejection(
        lambda: run_dropin(batch, pl, mine, g, pipelines=pipelines)
    )


def world4(*, rank: int, world_size: int, parts: tuple = ("pp", "tp", "dp")) -> dict:
    """PP=4 (segment/searched/interleaved plans, Megatron's schedule); PP=2 x TP=2; PP=2 x DP=2."""
    single = singles(world_size)
    pp4 = pick(make_groups(world_size, [[0, 1, 2, 3]]))
    # PP=2 x TP=2: rank = 2 * pp_rank + tp_rank.
    tp_groups = make_groups(world_size, [[0, 1], [2, 3]])
    pp_tp = make_groups(world_size, [[0, 2], [1, 3]])
    # PP=2 x DP=2: rank = 2 * replica + pp_rank (the same groups, other roles).
    out: dict = {}
    if rank == 0:
        _references(out, single)
    if "pp" in parts:
        g4 = Groups(pp=pp4, tp=single, single=single)
        _pipeline_scenarios(out, g4, 4, "pp4_")
        _stock_scenarios(out, g4, 4, "pp4_")
    if "tp" in parts:
        _tensor_parallel(out, Groups(pp=pick(pp_tp), tp=pick(tp_groups), single=single))
    if "dp" in parts:
        gdp = Groups(pp=pick(tp_groups), tp=single, single=single, dp=pick(pp_tp))
        _data_parallel(out, gdp, replica=rank // 2)
    out["layout"] = {"tp_rank": rank % 2, "pp_rank_tp": rank // 2, "replica": rank // 2}
    return out


def _tensor_parallel(out: dict, gtp: Groups) -> None:
    """PP=2 x TP=2, two chunks per rank per module, with recompute; without and with sequence
    parallelism."""
    vlm = st.make_batch("vlm", vlm_microbatches(), sizes=VLM_SIZES)
    pl = st.dip_placement(vlm.model, 2, {"vit": 2, "llm": 2})
    plan = st.with_recompute(st.segment_plan(vlm, pl), st.cycle_recompute)
    guarded("tp2_vlm", out, lambda: run_executor(vlm, pl, plan, gtp))
    t2v = st.make_batch("t2v", t2v_microbatches(), sizes=T2V_SIZES)
    tpl = st.dip_placement(t2v.model, 2, {"text": 2, "dit": 2})
    tplan = st.with_recompute(st.segment_plan(t2v, tpl), st.cycle_recompute)
    guarded("tp2_t2v", out, lambda: run_executor(t2v, tpl, tplan, gtp))
    # The same with sequence parallelism: sub-microbatches padded to a multiple of TP, hidden
    # states between chunks [padded_tokens / 2, 1, hidden], norm gradients summed over TP.
    sp = ParallelShape(tp=2, sp=True)
    vlm = st.make_batch("vlm", vlm_microbatches(), sizes=VLM_SIZES, sequence_parallel=2)
    plan = st.with_recompute(st.segment_plan(vlm, pl), st.cycle_recompute)
    guarded("tp2sp_vlm", out, lambda: run_executor(vlm, pl, plan, gtp, shape=sp))
    t2v = st.make_batch("t2v", t2v_microbatches(), sizes=T2V_SIZES, sequence_parallel=2)
    tplan = st.with_recompute(st.segment_plan(t2v, tpl), st.cycle_recompute)
    guarded("tp2sp_t2v", out, lambda: run_executor(t2v, tpl, tplan, gtp, shape=sp))
    vsplit = st.split_plan(st.with_recompute(st.segment_plan(vlm, pl), st.cycle_recompute))
    guarded("tp2sp_vlm_split", out, lambda: run_executor(vlm, pl, vsplit, gtp, shape=sp))
