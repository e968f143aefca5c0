"""Emulated compute (megatron_dip.emulation, and the training's emulated backend) and the
benchmark's in-process steps (megatron_dip.benchmark).

The emulated chunks' sleeps are checked as lower bounds (a sleep never ends early), so the tests
hold on a loaded machine; what is compared exactly is where the durations come from.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_dip.benchmark.bench import (
    auto_scale,
    instruction_seconds,
    resolve_run,
    simulated_key,
    strongest_stock,
    summarize,
)
from megatron_dip.emulation import (
    EmulatedBatchSource,
    EmulatedTransport,
    EmulationConfig,
    build_emulated_chunks,
    emulated_p2p,
    emulated_plan,
    emulated_tensor_fn,
    message_bytes,
    message_spec,
)
from megatron_dip.emulation.timing import ScaledCostModel, decode_stamp, encode_stamp
from megatron_dip.planner.simulator import simulate
from megatron_dip.runtime.transport import Transport
from megatron_dip.schedule.engine import per_peer_channel
from megatron_dip.schedule.ir import (
    NO_RECOMPUTE,
    Forward,
    MemoryPolicy,
    MessageKind,
    Recompute,
    Recv,
    Send,
)
from megatron_dip.schedule.validate import validate_plan

FLAGS = [
    "--dip-emulate-compute", "--model", "tiny-vlm", "--pipeline-model-parallel-size", "2",
    "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
]  # fmt: skip


@pytest.fixture(scope="module")
def dip():
    """A tiny VLM DIP run emulated on 2 ranks: its spec and the plan of its first batch."""
    from megatron_dip.benchmark.bench import first_batches
    from megatron_dip.training.iteration.planning import make_planner, replica_plan

    spec = resolve_run([*FLAGS, "--dip-schedule", "dip"], world_size=2)
    batch = first_batches(spec, 1)[0]
    return spec, batch, replica_plan(make_planner(spec), batch, 0).plan


def _source(spec, batch, plan, scale: float) -> EmulatedBatchSource:
    metas = {s.sample_id: s for s in batch.samples}
    return EmulatedBatchSource(
        plan=plan,
        cost_model=spec.cost_model,
        config=EmulationConfig(scale=scale),
        loss_tokens={
            m.index: [metas[i].loss_tokens for i in m.sample_ids] for m in plan.microbatches
        },
    )


def test_stamps_survive_float32_messages() -> None:
    now = time.time()
    parts = torch.tensor(encode_stamp(now), dtype=torch.float32).tolist()
    assert decode_stamp(parts) == pytest.approx(now, abs=1e-6)


def test_emulated_spec_folds_tensor_parallelism_into_the_cost_model() -> None:
    spec = resolve_run(
        ["--dip-emulate-compute", "--model", "vlm-s", "--tensor-model-parallel-size", "4",
         "--pipeline-model-parallel-size", "4", "--sequence-parallel", "--train-iters", "1", "--lr", "1",
         "--dip-segments", "vit=1,llm=1", "--dip-sub-microbatch-size", "vit=32"],
        world_size=4,
    )  # fmt: skip
    assert spec.shape.tp == 1 and spec.emulate_scale == 1.0  # one process per PP rank
    assert spec.planner.shape.tp == 4 and spec.planner.shape.sequence_parallel
    assert spec.planner.shape.dtype == "bfloat16" and spec.dtype == "float32"
    assert spec.memory_limit_bytes is not None  # the emulated GPU's memory binds the plans


def test_durations_and_links_come_from_the_cost_model_and_the_plan(dip) -> None:
    spec, batch, plan = dip
    source = _source(spec, batch, plan, scale=7.0)
    sizes = message_bytes(plan)
    df = source.df
    for stage in df.stages():
        timing = source.timing(stage)
        chunk = plan.placement.module(stage.module).chunks[stage.chunk]
        cost = spec.cost_model.stage_cost(chunk, plan.submicrobatch(stage.work))
        assert timing.forward_s == pytest.approx(7.0 * cost.forward)
        assert timing.backward_for(NO_RECOMPUTE) == pytest.approx(7.0 * cost.backward)
        selective = spec.cost_model.stage_cost(
            chunk, plan.submicrobatch(stage.work), MemoryPolicy(Recompute.SELECTIVE)
        )
        assert timing.backward_for(MemoryPolicy(Recompute.SELECTIVE)) == pytest.approx(
            7.0 * selective.backward
        )
        for key, link in zip(df.forward_inputs(stage), timing.inputs):
            remote = df.sender_of(key) != df.receiver_of(key)
            assert link.remote == remote
            expected = spec.cost_model.transfer_time(sizes[key]) * 7.0 if remote else 0.0
            assert link.transfer_s == pytest.approx(expected)
            # The consumer's gradient stamp slot is its place among the producer's consumers.
            assert link.slot == 1 + df.consumers(key.producer).index(stage)
        assert len(timing.outputs) == len(df.consumers(stage))


def test_emulated_plan_keeps_the_program_with_tiny_messages(dip) -> None:
    _, _, plan = dip
    tiny = emulated_plan(plan)
    validate_plan(tiny)
    assert any(isinstance(i, Send) for p in plan.programs for i in p.instructions)
    for before, after in zip(plan.programs, tiny.programs):
        assert len(before.instructions) == len(after.instructions)
        for a, b in zip(before.instructions, after.instructions):
            if isinstance(a, (Send, Recv)):
                assert b.tensors == (message_spec(),) and b.key == a.key and b.peer == a.peer
            else:
                assert a == b


def test_scaled_cost_model_scales_the_whole_simulation(dip) -> None:
    spec, _, plan = dip
    one = simulate(plan, spec.cost_model).iteration_time
    three = simulate(plan, ScaledCostModel(spec.cost_model, 3.0)).iteration_time
    assert three == pytest.approx(3.0 * one, rel=1e-9)


def _run_stage(chunks, source, stage, inputs):
    chunk = next(
        c for c in chunks if (c.chunk.module, c.chunk.index) == (stage.module, stage.chunk)
    )
    timing = source.timing(stage)
    return chunk, timing, chunk(inputs=inputs, batch=source.sub_batch(stage.work))


def test_chunks_sleep_at_least_the_cost_model_time_and_wait_for_remote_stamps(
    dip, single_rank_world
) -> None:
    spec, batch, plan = dip
    source = _source(spec, batch, plan, scale=1.0)
    llm = [s for s in source.df.stages() if s.module == "llm" and s.chunk == 0]
    stage = llm[0]
    # Durations big enough to measure, from a scaled source.
    source = _source(spec, batch, plan, scale=0.02 / source.timing(stage).forward_s)
    chunks = build_emulated_chunks(spec.model, plan.placement, rank=source.df.rank_of(stage))
    inputs = []
    for _key in source.df.forward_inputs(stage):  # each producer's message, stamped 50 ms ahead
        message = torch.zeros(message_spec().shape)
        message[1:4] = torch.tensor(encode_stamp(time.time() + 0.05))
        inputs.append({"emulated": message.requires_grad_(True)})
    started = time.time()
    chunk, timing, out = _run_stage(chunks, source, stage, inputs)
    elapsed = time.time() - started
    remote = [link for link in timing.inputs if link.remote]
    assert elapsed >= timing.forward_s + (0.05 if remote else 0.0) - 1e-3
    stamp = decode_stamp(out["emulated"][1:4].tolist())
    assert started <= stamp <= time.time()
    # Backward: sleeps its time and stamps each producer's gradient in the consumer's slot.
    grad = torch.zeros(message_spec().shape)
    grad[0] = 1.0
    started = time.time()
    out["emulated"].backward(grad)
    assert time.time() - started >= timing.backward_for(NO_RECOMPUTE) - 1e-3
    for message, link in zip(inputs, timing.inputs):
        at = 1 + 3 * link.slot
        assert started <= decode_stamp(message["emulated"].grad[at : at + 3].tolist())
    assert chunk.weight.grad is not None


class _Sleeps:
    """Stands in for `emulation.chunk.sleep_until`: records each requested sleep, sleeps none."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def __call__(self, deadline: float, config) -> None:
        self.seconds.append(deadline - config.now())


@pytest.mark.parametrize("module", ["llm", "vit"])
def test_split_backward_sleeps_the_cost_models_b_then_w(
    dip, single_rank_world, monkeypatch, module
) -> None:
    """A split plan's emulated ops follow the cost model: the runtime's B (`backward_input`)
    sleeps the stage's input-gradient seconds (`StageCost.backward_input`) and its W
    (`backward_weight`) the weight-gradient seconds (`StageCost.weight`), scaled, and nothing
    else; the weight's gradient arrives in W. An LLM chunk receives gradients-needing inputs;
    the ViT's first chunk does not: the cost model prices its whole backward as W
    (`CostModel.inputs_need_gradients`) and, as a real first chunk, it runs it all in W."""
    from megatron_dip.emulation import chunk as emulated
    from megatron_dip.runtime.backward_split import (
        SavedStore,
        backward_input,
        backward_weight,
        input_leaves,
    )
    from megatron_dip.schedule import Dataflow

    spec, batch, plan = dip
    df = Dataflow(plan.placement, plan.submicrobatches, plan.dependencies)
    stage = next(s for s in df.stages() if s.module == module and s.chunk == 0)
    cost = spec.cost_model.stage_cost(
        plan.placement.module(module).chunks[0], plan.submicrobatch(stage.work)
    )
    scale = 1.0 / cost.backward  # seconds: what a sleep's deadline is measured against
    source = _source(spec, batch, plan, scale=scale)
    chunks = build_emulated_chunks(spec.model, plan.placement, rank=source.df.rank_of(stage))
    inputs = []
    for _key in source.df.forward_inputs(stage):
        message = torch.zeros(message_spec().shape)
        message[1:4] = torch.tensor(encode_stamp(1.0))  # long arrived
        inputs.append({"emulated": message.requires_grad_(True)})
    sleeps = _Sleeps()
    monkeypatch.setattr(emulated, "sleep_until", sleeps)
    store = SavedStore()
    with store.hooks():
        chunk, timing, out = _run_stage(chunks, source, stage, inputs)
    assert timing.weight_s == pytest.approx(scale * cost.weight) and cost.weight > 0
    grad = torch.zeros(message_spec().shape)
    grad[0] = 1.0
    params = [chunk.weight]
    sleeps.seconds.clear()
    leaves = input_leaves(inputs)
    pending = backward_input(
        [out["emulated"]], [grad], leaves, params, keep_graph=True, store=store
    )
    in_b, sleeps.seconds = [x for x in sleeps.seconds if x > 1e-3], []
    assert chunk.weight.grad is None
    backward_weight(pending)
    in_w = [x for x in sleeps.seconds if x > 1e-3]
    b_s = pytest.approx(scale * cost.backward_input, abs=1e-3)
    w_s = pytest.approx(scale * cost.weight, abs=1e-3)
    assert bool(leaves) == spec.cost_model.inputs_need_gradients(
        plan.placement.module(module).chunks[0], plan.submicrobatch(stage.work)
    )
    if leaves:
        assert in_b == [b_s] and in_w == [w_s] and cost.backward_input > 0
    else:
        assert cost.backward_input == 0 and cost.weight == cost.backward
        assert in_b == [] and in_w == [w_s]
    assert chunk.weight.grad is not None


def test_summary_and_stock_choices(dip) -> None:
    records = [
        {
            "iteration": i,
            "schedule_seconds": t,
            "predicted_s": 1.0,
            "bound_s": 0.5,
            "variant": v,
            "seconds": t + w + 0.5,
            "plan_wait_seconds": w,
            "end_time": 1000.0 + 10 * i,
        }
        for i, (t, v, w) in enumerate(
            [
                (9.0, "inline", 0.0),
                (1.0, "inline", 20.0),
                (2.0, "searched", 0.0),
                (3.0, "searched", 0.0),
            ],
            start=1,
        )
    ]
    s = summarize("dip", records, warmup=1)
    # The headline is what the user waited: the inline iteration's 20 s wait counts there.
    assert (s.elapsed_s, s.elapsed_p90_s, s.inline_plans, s.iterations) == (3.5, 21.5, 1, 3)
    assert (s.median_s, s.schedule_s, s.plan_wait_s) == (3.5, 2.0, 0.0)
    assert s.first_iteration_s is None  # the launch time was not given
    # From the launch to the end of iteration 1, with the search the launcher did for the run.
    timed = summarize("dip", records[::-1], warmup=1, launched_at=990.0, spared_s=5.0)
    assert timed.first_iteration_s == 1010.0 - 990.0 + 5.0
    with pytest.raises(ValueError, match="no iteration after"):
        summarize("dip", records, warmup=4)
    (choice,) = strongest_stock(FLAGS, world_size=2, batches=1, schedules=["1f1b"])
    fitting = {k: v for k, v in choice.simulated_s.items() if v is not None}
    assert fitting[choice.key] == min(fitting.values()) and choice.key.startswith(choice.placement)
    # Every placement was tried with Megatron's partial recompute methods too.
    assert {k.split("/")[0] for k in choice.simulated_s} == {"llava", "params", "cost"}
    assert any("block" in k for k in choice.simulated_s)
    assert any("uniform" in k for k in choice.simulated_s)
    assert choice.flags()[:2] == ["--dip-schedule", "1f1b"]


def test_auto_scale_makes_the_shortest_dip_instruction_the_target(dip) -> None:
    spec, _, plan = dip
    scale = auto_scale(FLAGS, world_size=2, batches=1, min_op_s=0.05)
    shortest = min(s for s in instruction_seconds(plan, spec.cost_model) if s > 0)
    assert shortest * scale == pytest.approx(0.05, rel=1e-9)
    assert any(isinstance(i, Forward) for i in plan.programs[0].instructions)
    assert MessageKind.ACTIVATION.value == "act"


def test_shortest_kept_leaves_out_only_a_small_share_of_compute() -> None:
    from megatron_dip.benchmark.bench import shortest_kept

    durations = [0.001] * 10 + [0.05] * 20 + [0.2] * 5  # sum 2.01 s; the 1 ms ones hold 0.5%
    assert shortest_kept(durations, share=0.0) == 0.001
    assert shortest_kept(durations, share=0.05) == 0.05  # 10 ms of 100 ms allowed: 1 ms ones go
    assert shortest_kept(durations, share=0.004) == 0.001  # 10 ms is more than 8 ms allowed
    with pytest.raises(ValueError, match="no instruction"):
        shortest_kept([0.0], share=0.0)


class _Recorder:
    """A stand-in inner transport: records what it is asked to do."""

    def __init__(self) -> None:
        self.posted, self.calls, self.messages_posted = [], [], 0

    @property
    def channel(self):
        return per_peer_channel

    def post(self, ops, outgoing) -> None:
        self.posted.append((list(ops), outgoing))
        self.messages_posted += len(ops)

    def wait(self, keys, *, where="", index=None) -> None:
        self.calls.append(("wait", list(keys), where, index))

    def take(self, key):
        self.calls.append(("take", key))
        return {"emulated": torch.zeros(message_spec().shape)}

    def finish(self) -> None:
        self.calls.append(("finish",))

    def pending(self):
        return {"received": [], "sending": []}


def test_emulated_transport_posts_the_real_plan_as_stand_ins(dip) -> None:
    """The executor runs the plan as planned; the transport hands the real one each Send/Recv
    with the stand-in tensor instead of the real model's (same key, peer and order)."""
    _, _, plan = dip
    program = next(p for p in plan.programs if any(isinstance(i, Send) for i in p.instructions))
    ops = [(i, ins) for i, ins in enumerate(program.instructions) if isinstance(ins, (Send, Recv))]
    assert any(ins.tensors != (message_spec(),) for _, ins in ops)  # real shapes in the plan
    inner = _Recorder()
    transport = EmulatedTransport(inner)
    assert isinstance(transport, Transport) and transport.channel is per_peer_channel
    outgoing = {ins.key: {"emulated": torch.zeros(message_spec().shape)} for _, ins in ops}
    transport.post(ops, outgoing)
    ((posted, given),) = inner.posted
    assert given is outgoing and transport.messages_posted == len(ops)
    assert [(i, type(o), o.key, o.peer) for i, o in posted] == [
        (i, type(o), o.key, o.peer) for i, o in ops
    ]
    assert all(o.tensors == (message_spec(),) for _, o in posted)
    key = ops[0][1].key
    transport.wait([key], where="instruction 3", index=3)
    assert set(transport.take(key)) == {"emulated"}
    transport.finish()
    assert inner.calls == [("wait", [key], "instruction 3", 3), ("take", key), ("finish",)]
    assert transport.pending() == {"received": [], "sending": []}


def test_the_backend_is_chosen_once_and_emulation_plugs_in_as_its_parts(dip) -> None:
    """--dip-emulate-compute selects `EmulatedCompute`: metadata samples, the cost model's
    batch source, stand-in messages (not held to the plan's real shapes), the emulated
    transport, and the scaled simulation as its prediction; without it, `RealCompute`."""
    from megatron_dip.runtime.p2p import PipelineP2P
    from megatron_dip.training.assembly.backend import EmulatedCompute, RealCompute, select_backend

    spec, batch, plan = dip
    backend = select_backend(spec)
    assert isinstance(backend, EmulatedCompute) and backend.transport is emulated_p2p
    samples = backend.samples_for(None, batch, plan)  # metadata: no stream is read
    assert {mb: [s.sample_id for s in metas] for mb, metas in samples.items()} == {
        m.index: list(m.sample_ids) for m in plan.microbatches
    }
    source = backend.batch_source(plan=plan, samples=samples, device=torch.device("cpu"))
    assert isinstance(source, EmulatedBatchSource) and source.config.scale == spec.emulate_scale
    assert backend.checked_shapes(plan) is None
    assert backend.tensor_fn(plan) is emulated_tensor_fn
    want = simulate(plan, ScaledCostModel(spec.cost_model, 1.0), channel=per_peer_channel)
    got = backend.metrics(plan, sim=None, channel=per_peer_channel)
    assert got == {
        "emulate_scale": 1.0,
        "predicted_s": want.iteration_time,
        "bound_s": want.lower_bound,
    }
    real = select_backend(resolve_run([*FLAGS[1:], "--dip-schedule", "dip"], world_size=2))
    assert isinstance(real, RealCompute) and real.transport is PipelineP2P
    assert real.metrics(plan, sim=None, channel=per_peer_channel) == {"emulate_scale": None}


def test_fit_recovers_known_overheads_from_measured_plans(dip) -> None:
    """Times made by the simulator's own model (known overheads + a constant) are fitted back;
    the plans differ in how instructions, batches and messages lie on their critical paths."""
    from megatron_dip.benchmark.overhead import fit_overheads, predicted
    from megatron_dip.planner.overheads import HostOverheads
    from megatron_dip.schedule.baselines import build_1f1b_plan, build_interleaved_plan
    from megatron_dip.schedule.engine import single_channel

    _, _, dip_plan = dip
    plans = [
        (dip_plan, per_peer_channel),
        (build_1f1b_plan(num_ranks=4, num_microbatches=8), single_channel),
        (build_1f1b_plan(num_ranks=2, num_microbatches=3), single_channel),
        (build_interleaved_plan(num_ranks=4, num_model_chunks=2, num_microbatches=8), single_channel),
        (build_interleaved_plan(num_ranks=2, num_model_chunks=3, num_microbatches=4), single_channel),
    ]  # fmt: skip
    true = HostOverheads(instruction=1.5e-3, batch=0.8e-3, message=0.3e-3)
    points = [(p, ch, predicted(p, true, ch) + 0.02) for p, ch in plans]
    fit = fit_overheads(points)
    assert fit.rms_relative_error < 1e-3
    assert fit.overheads.instruction == pytest.approx(true.instruction, rel=0.05)
    assert fit.constant == pytest.approx(0.02, rel=0.05)
    pinned = fit_overheads(points, instruction=true.instruction)
    assert pinned.overheads.instruction == true.instruction
    assert pinned.rms_relative_error < 1e-3
    with pytest.raises(ValueError, match="at least two"):
        fit_overheads(points[:1])


def test_bench_tool_plans_the_strongest_stock_and_dip_s_own_granularity(tmp_path, caplog) -> None:
    """The benchmark's smoke test (tiny-vlm, no launch): the stock runs carry their strongest
    configuration's flags, DIP runs the planner's granularity with the host overheads, every
    run shares the scale and the overheads file; the table and summaries come out."""
    import importlib.util
    import logging
    import sys
    from pathlib import Path

    from megatron_dip.benchmark.bench import BENCH_PRESETS, RunSummary, resolve_run
    from megatron_dip.planner.overheads import HostOverheads, OverheadsFile, save_overheads
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.layout import placement_flag
    from megatron_dip.training.config.recompute_flags import recompute_mode

    path = Path(__file__).resolve().parent.parent / "tools" / "bench_schedules.py"
    spec = importlib.util.spec_from_file_location("bench_schedules", path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules["bench_schedules"] = tool
    spec.loader.exec_module(tool)
    overheads = tmp_path / "o.json"
    save_overheads(overheads, OverheadsFile(HostOverheads(1e-3, 1e-3, 1e-4)))
    args = tool.parse_args(
        ["--preset", "tiny-vlm", "--host-overheads", str(overheads), "--calibration-batches", "1"]
    )
    runs, scale = tool.plan_runs(args, BENCH_PRESETS["tiny-vlm"])
    assert scale > 0 and [r["label"].split(" ")[0] for r in runs] == [
        "megatron-1f1b",
        "megatron-interleaved",
        "dip",
    ]
    for run in runs:
        flags = run["flags"]
        assert flags[flags.index("--dip-host-overheads") + 1] == str(overheads)
        assert float(flags[flags.index("--dip-emulate-scale") + 1]) == scale
    # Megatron's virtual pipeline size is tuned on the cost cut as in the study's grid (tiny-vlm's
    # layers fill 2, 3 and 4 chunks per rank, not 6 or 8).
    tried = {k.split("/")[0] for k in runs[1]["simulated"]}
    assert tried == {"llava", "params", "cost v2", "cost v3", "cost v4"}
    for run in runs[:2]:  # the chosen setting is the fastest fitting one, passed as flags
        fitting = {k: v for k, v in run["simulated"].items() if v is not None}
        config = parse_config(run["flags"])
        virtual = config.parallel.num_virtual_stages_per_pipeline_rank
        key = simulated_key(config.dip.dip_stock_placement, virtual, recompute_mode(config))
        assert fitting[key] == min(fitting.values())
    dip_flags = runs[2]["flags"]
    segments = dip_flags[dip_flags.index("--dip-segments") + 1]
    chosen = runs[2]["granularity"]["placement"]
    assert segments == placement_flag(chosen, runs[2]["granularity"]["segments"])
    # The run places as the tool's search chose, without searching again (static ones too).
    with caplog.at_level(logging.INFO, logger="megatron_dip.training.config.layout"):
        again = resolve_run(dip_flags, world_size=2)
    assert "start-up placement search" not in caplog.text
    assert (again.stage_units is not None) == chosen.startswith("static ")
    rows = [
        {"label": r["label"], "summary": RunSummary(r["label"], t, t, t, 0.0, t, t / 2, 0, 3)}
        for r, t in zip(runs, (3.0, 2.0, 1.0))
    ]
    table = tool.format_table(rows)
    assert "2.00x" in table  # DIP against the strongest stock run (2.0 s)
