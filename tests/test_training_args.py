"""Flags: generated from the config dataclasses, filled from presets, and every bad value or
combination refused with a message naming the flag BEFORE any process group exists (in-process,
no torch.distributed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import warnings

import pytest
import torch.distributed as dist

from megatron_dip.planner.placement_ties import MAX_FINALISTS, TIE_MARGIN
from megatron_dip.schedule.ir import Channels, MemoryPolicy, Recompute
from megatron_dip.training.config import arguments as args_module
from megatron_dip.training.config.arguments import TrainConfig, build_parser, parse_config
from megatron_dip.training.config.validate import ConfigError, resolve

BASE = ["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1e-3"]


def _resolve(extra, *, world_size=1, base=BASE):
    return resolve(parse_config([*base, *extra]), world_size=world_size, cuda=False)


def _profile(tmp_path, **changes):
    data = {
        "format": "megatron-dip-profile/1",
        "device": "H100",
        "software": {"torch": "2.6"},
        "attention": "flash",
        "tensor_parallel": 1,
        "modules": {"vit": [{"tokens": 16, "instances": 2, "forward_ms": 1.0, "backward_ms": 2.0}]},
    }
    data.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


BAD = [
    # (extra flags, world size, flag named in the message, words in the message)
    (
        ["--pipeline-model-parallel-size", "4"],
        6,
        "--tensor-model-parallel-size/--pipeline-model-parallel-size",
        "not divisible",
    ),
    (["--pipeline-model-parallel-size", "16"], 16, "--pipeline-model-parallel-size", "layers"),
    (["--dip-sub-microbatch-size", "0"], 1, "--dip-sub-microbatch-size", ">= 1"),
    (["--dip-sub-microbatch-size", "vit=0"], 1, "--dip-sub-microbatch-size", ">= 1"),
    (["--dip-sub-microbatch-size", "llm=2"], 1, "--dip-sub-microbatch-size", "packed sequence"),
    (["--dip-sub-microbatch-size", "x"], 1, "--dip-sub-microbatch-size", "MODULE=N"),
    (["--model", "nope"], 1, "--model", "unknown preset"),
    (["--micro-batch-size", "2"], 1, "--micro-batch-size", "must be 1"),
    (["--dip-planner-workers", "64"], 1, "--dip-planner-workers", "half"),
    (["--dip-planner-workers", "0"], 1, "--dip-planner-workers", "must lie"),
    (["--dip-split-search"], 1, "--dip-split-search", "needs --dip-split-backward"),
    (
        ["--dip-split-backward-always"],
        1,
        "--dip-split-backward-always",
        "needs --dip-split-backward",
    ),
    (["--dip-lookahead", "-1"], 1, "--dip-lookahead", ">= 0"),
    (["--dip-receive-lead", "2"], 1, "--dip-receive-lead", "must be 0 or 1"),
    (["--dip-comm-timeout-s", "0"], 1, "--dip-comm-timeout-s", "> 0 seconds"),
    (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes", "> 0 minutes"),
    (["--dip-search-time-ms", "-5"], 1, "--dip-search-time-ms", ">= 0"),
    (["--dip-segments", "vit=0"], 1, "--dip-segments", "MODULE=N"),
    (["--dip-segments", "foo=1"], 1, "--dip-segments", "unknown module"),
    (
        ["--pipeline-model-parallel-size", "2", "--dip-segments", "static:nope"],
        2,
        "--dip-segments",
        "unknown static placement 'static:nope'; known: static:stock-v1",
    ),
    (["--dip-memory-limit-gb", "1e-9"], 1, "--dip-memory-limit-gb", "no plan fits"),
    (["--dip-memory-limit-gb", "0"], 1, "--dip-memory-limit-gb", "> 0"),
    (["--dip-host-overheads", "/does/not/exist.json"], 1, "--dip-host-overheads", "cannot read"),
    (["--dip-data", "synthetic-nope"], 1, "--dip-data", "unknown synthetic mixture"),
    (["--dip-data", "synthetic-t2v"], 1, "--dip-data", "diffusion"),
    (["--dip-data", "llava:/does/not/exist.json"], 1, "--dip-data", "does not exist"),
    (["--dip-data", "webdataset:/x"], 1, "--dip-data", "is not synthetic-MIXTURE"),
    (["--dip-attention", "varlen"], 1, "--dip-attention", "needs CUDA and --bf16"),
    (
        ["--recompute-method", "block"],
        1,
        "--recompute-method",
        "needs --recompute-granularity full",
    ),
    (
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "0"],
        1,
        "--recompute-num-layers",
        ">= 1",
    ),
    (["--recompute-num-layers", "2"], 1, "--recompute-num-layers", "needs --recompute-method"),
    (["--sequence-parallel"], 1, "--sequence-parallel", "needs tensor parallelism"),
    (
        ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "63"],
        2,
        "--sequence-parallel",
        "multiple of TP=2",
    ),
    (["--global-batch-size", "1"], 2, "--global-batch-size", "2 data-parallel replicas"),
    (["--dip-schedule", "interleaved"], 1, "--pipeline-model-parallel-size", "PP >= 2"),
    (
        ["--dip-schedule", "1f1b", "--pipeline-model-parallel-size", "16"],
        16,
        "--pipeline-model-parallel-size",
        "stages",
    ),
    (["--dip-schedule", "1f1b", "--global-batch-size", "3"], 2, "--global-batch-size", "DP=2"),
    (
        ["--dip-schedule", "interleaved", "--pipeline-model-parallel-size", "4"]
        + ["--global-batch-size", "4"],
        8,
        "--global-batch-size",
        "multiple of PP=4",
    ),
    (["--dip-schedule", "1f1b", "--dip-segments", "vit=1"], 1, "--dip-segments", "dip"),
    (
        ["--num-virtual-stages-per-pipeline-rank", "4"],
        1,
        "--num-virtual-stages-per-pipeline-rank",
        "DIP's start-up search chooses",
    ),
    (
        ["--dip-schedule", "1f1b", "--num-virtual-stages-per-pipeline-rank", "2"],
        1,
        "--num-virtual-stages-per-pipeline-rank",
        "not 1f1b",
    ),
    (
        ["--dip-schedule", "interleaved", "--pipeline-model-parallel-size", "2"]
        + ["--num-virtual-stages-per-pipeline-rank", "1"],
        2,
        "--num-virtual-stages-per-pipeline-rank",
        ">= 2 model chunks",
    ),
    (
        ["--dip-schedule", "interleaved", "--pipeline-model-parallel-size", "2"]
        + ["--num-layers-per-virtual-pipeline-stage", "3"],
        2,
        "--num-layers-per-virtual-pipeline-stage",
        "do not divide the 8 layers",
    ),
    (
        ["--dip-schedule", "interleaved", "--pipeline-model-parallel-size", "2"]
        + ["--num-layers-per-virtual-pipeline-stage", "1"]
        + ["--num-virtual-stages-per-pipeline-rank", "2"],
        2,
        "--num-layers-per-virtual-pipeline-stage",
        "exclude each other",
    ),
    (
        ["--dip-schedule", "interleaved", "--pipeline-model-parallel-size", "2"]
        + ["--num-virtual-stages-per-pipeline-rank", "8"],
        2,
        "--pipeline-model-parallel-size",
        "PP x V = 2 x 8 stages",
    ),
    (["--save-interval", "5"], 1, "--save-interval", "needs --save"),
    (["--async-save"], 1, "--async-save", "needs --save"),
    (["--ckpt-step", "3"], 1, "--ckpt-step", "needs --load"),
    (["--dip-max-nonfinite-iters", "-1"], 1, "--dip-max-nonfinite-iters", ">= 0"),
    (["--tensor-model-parallel-size", "3"], 3, "--tensor-model-parallel-size", "heads"),
    (["--tensor-model-parallel-size", "0"], 1, "--tensor-model-parallel-size", ">= 1"),
    (["--lr-warmup-iters", "2"], 1, "--lr-decay-iters", "--lr-warmup-iters"),
    (["--min-lr", "1"], 1, "--min-lr", "[0, --lr"),
    (["--seq-length", "2"], 1, "--seq-length", "fits in no microbatch"),
    # a module with fewer layers than the pipeline chunks it must be cut into
    (
        ["--encoder-num-layers", "1", "--pipeline-model-parallel-size", "2"],
        2,
        "--pipeline-model-parallel-size",
        "module 'vit' has 1 layers",
    ),
    (
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--dip-segments", "llm=2"],
        2,
        "--pipeline-model-parallel-size",
        "fewer than the 4 chunks",
    ),
    (
        [
            "--num-layers",
            "3",
            "--pipeline-model-parallel-size",
            "2",
            "--dip-schedule",
            "interleaved",
        ],
        2,
        "--pipeline-model-parallel-size",
        "PP x V = 2 x 2 stages",
    ),
    (["--global-batch-size", "0"], 1, "--global-batch-size", "cannot feed"),
    (["--num-layers", "0"], 1, "--num-layers", ">= 1"),
    (["--vocab-size", "2"], 1, "--vocab-size", ">= 3"),
    (["--log-interval", "0"], 1, "--log-interval", ">= 1"),
]


@pytest.mark.parametrize(
    ("extra", "world", "flag", "words"), BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)]
)
def test_bad_flags_are_refused_before_any_process_group(extra, world, flag, words):
    with pytest.raises(ConfigError) as info:
        _resolve(extra, world_size=world)
    message = str(info.value)
    assert message.startswith(flag + ":"), message
    assert words in message, message
    assert not dist.is_initialized()


def test_missing_required_flags():
    for missing, flag in (("--train-iters", "--train-iters"), ("--lr", "--lr")):
        base = [a for i, a in enumerate(BASE) if missing not in BASE[max(0, i - 1) : i + 1]]
        with pytest.raises(ConfigError, match=f"^{flag}:"):
            _resolve([], base=base)


def test_cost_profile_that_does_not_parse_or_fit(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="^--dip-cost-profile: profile .*cannot read JSON"):
        _resolve(["--dip-cost-profile", str(bad)])
    with pytest.raises(ConfigError, match="^--dip-cost-profile: .*tensor_parallel"):
        _resolve(["--dip-cost-profile", _profile(tmp_path, tensor_parallel=2)])
    with pytest.raises(ConfigError, match="^--dip-cost-profile: .*'format'"):
        _resolve(["--dip-cost-profile", _profile(tmp_path, format="v0")])
    with pytest.raises(ConfigError, match="^--dip-cost-profile: .*modules .*'dit'"):
        _resolve(
            [
                "--dip-cost-profile",
                _profile(
                    tmp_path,
                    modules={
                        "dit": [
                            {"tokens": 4, "instances": 1, "forward_ms": 1.0, "backward_ms": 2.0}
                        ]
                    },
                ),
            ]
        )
    spec = _resolve(["--dip-cost-profile", _profile(tmp_path)])
    assert spec.cost_model.profile is not None


def test_bf16_runs_on_the_cpu_and_prices_what_the_cpu_runs():
    spec = _resolve(["--bf16"])
    assert spec.dtype == "bfloat16" and spec.planner.shape.dtype == "bfloat16"
    cost = spec.cost_model
    assert cost._ctx.dt == 2 and cost.kernels.attention == "segments"
    assert not cost.kernels.fused_rms_norm  # torch's composite RMSNorm on the CPU
    assert _resolve([]).dtype == "float32"


class _FakeProperties:
    total_memory = 40 * 2**30


def _resolve_on_gpu(monkeypatch, name: str, extra=()):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: _FakeProperties())
    return resolve(parse_config([*BASE, *extra]), world_size=1, cuda=True)


def test_the_gpu_is_priced_as_its_preset_or_refused(monkeypatch, tmp_path):
    """An A100 is priced as an A100 (with its own memory), not as an H100; a GPU that is no
    preset is refused unless a profile measured on it is given."""
    a100 = _resolve_on_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB").device
    assert a100.name == "A100" and a100.peak_flops == 312e12
    assert a100.memory_bytes == 40 * 2**30
    assert _resolve_on_gpu(monkeypatch, "NVIDIA B200").device.name == "B200"
    with pytest.raises(ConfigError, match="^--dip-device: the CUDA device 'NVIDIA L40S' is none"):
        _resolve_on_gpu(monkeypatch, "NVIDIA L40S")
    profiled = _resolve_on_gpu(
        monkeypatch, "NVIDIA L40S", ["--dip-cost-profile", _profile(tmp_path)]
    )
    assert profiled.device.name == "NVIDIA L40S" and profiled.cost_model.profile is not None
    named = _resolve_on_gpu(monkeypatch, "NVIDIA L40S", ["--dip-device", "A100"])
    assert named.device.name == "A100"


@pytest.mark.parametrize(
    ("setup", "gpus"), [("vlm-s", 16), ("t2v-s", 16), ("vlm-m", 32), ("vlm-l", 64), ("t2v-l", 64)]
)
def test_paper_setup_launcher_submits_each_setup_at_its_real_size(setup, gpus):
    """`scripts/train_paper_setup.sh` asks SLURM for the setup's GPUs, and the run's flags
    resolve at that world size with the paper's TP x PP (one data-parallel replica)."""
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "train_paper_setup.sh"
    done = subprocess.run(
        ["bash", str(script), "--print", setup, "--train-iters", "2"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    words = done.stdout.split()
    nodes = int(re.fullmatch(r"--nodes=(\d+)", words[1]).group(1))
    assert words[0] == "sbatch" and nodes * 8 == gpus
    flags = words[words.index("--model") :]
    kind = "diffusion" if setup.startswith("t2v") else "vlm"
    # Fixed segments: the start-up placement search at paper scale takes minutes (tested at
    # tiny scale elsewhere); what is checked here is the launch's world size and parallelism.
    segments = "text=1,dit=1" if kind == "diffusion" else "vit=1,llm=1"
    flags += ["--lr", "1e-4", "--dip-segments", segments]
    spec = resolve(parse_config(flags), world_size=gpus, cuda=False)
    assert spec.shape.tp * spec.shape.pp == gpus and spec.shape.dp == 1
    assert words[words.index("--model") - 1].endswith(f"train_{kind}_slurm.sbatch")


def test_presets_fill_unset_flags_and_flags_win():
    spec = _resolve(
        [], world_size=4, base=["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1"]
    )
    assert (spec.shape.pp, spec.shape.dp) == (1, 4)
    assert spec.training.global_batch_size == 8 and spec.training.seq_length == 128
    assert spec.sub_sizes == {"vit": 2} and spec.segments == {"vit": 1, "llm": 2}
    spec = _resolve(
        ["--global-batch-size", "6", "--pipeline-model-parallel-size", "2", "--dip-segments",
         "vit=2,llm=2", "--dip-sub-microbatch-size", "3", "--num-layers", "12"],
        world_size=2,
    )  # fmt: skip
    assert spec.training.global_batch_size == 6 and spec.sub_sizes == {"vit": 3}
    assert spec.model.module("llm").num_layers == 12
    assert [m.num_chunks for m in spec.placement.modules] == [4, 4]
    assert spec.planner.sub_size_scales == ()  # plans at the configured sizes only
    # receives posted one compute ahead on the pipeline's per-pair communicators
    assert spec.planner.receive_lead == 1 and spec.planner.channels is Channels.PER_PEER
    lead0 = [
        "--global-batch-size",
        "6",
        "--pipeline-model-parallel-size",
        "2",
        "--dip-receive-lead",
        "0",
    ]
    assert _resolve(lead0, world_size=2).planner.channels is Channels.SINGLE
    assert _resolve([], world_size=1).planner.receive_lead == 0  # one pipeline rank: no messages
    with pytest.raises(ValueError, match="receive_lead must be 0 or 1, got 2"):
        dataclasses.replace(spec.planner, receive_lead=2)  # one lead only (`add_communication`)
    coarser = _resolve(
        ["--dip-coarser-sub-microbatches"],
        world_size=4,
        base=["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1"],
    )
    assert coarser.planner.sub_size_scales == (1.5, 2.0) and coarser.sub_sizes == {"vit": 2}
    paper = _resolve(  # explicit segments: no start-up placement search at paper scale here
        ["--dip-segments", "vit=1,llm=2"],
        world_size=16,
        base=["--model", "vlm-s", "--train-iters", "2", "--lr", "1"],
    )
    assert (paper.shape.tp, paper.shape.pp) == (4, 4)
    assert paper.training.seq_length == 8192 and (paper.data.kind, paper.data.value) == (
        "synthetic",
        "mixed",
    )


def test_sequence_parallel_reaches_chunks_planner_and_message_shapes():
    from megatron_dip.modalities import modality_of
    from megatron_dip.models.common import transformer_config
    from megatron_dip.training.assembly.backend import model_config

    spec = _resolve(["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2)
    assert spec.shape.sequence_parallel and spec.planner.shape.sequence_parallel
    assert spec.cost_model.shape.sequence_parallel
    # The chunks' Megatron config takes it from the run's shape (`megatron_chunks`).
    llm = spec.model.module("llm")
    style = modality_of(llm).layer_style(llm)
    tconfig = transformer_config(llm, model_config(spec), shape=spec.shape, style=style)
    assert tconfig.sequence_parallel and tconfig.tensor_model_parallel_size == 2
    assert not _resolve(["--tensor-model-parallel-size", "2"], world_size=2).shape.sequence_parallel


def test_split_backward_delays_te_weight_gradients_in_the_chunks_and_their_ddp(monkeypatch):
    """Under --dip-split-backward (DIP's schedule only) the chunks' Megatron config asks
    Transformer Engine layers to queue their weight GEMMs for `backward_dw` (set past the
    config's MoE-only check) where TE can (>= 2.3), and the DDP wrappers hook those layers;
    without TE, or with Megatron's stock schedules, nothing changes."""
    from megatron_dip import megatron_compat
    from megatron_dip.modalities import modality_of
    from megatron_dip.models.common import transformer_config
    from megatron_dip.training.assembly.backend import model_config
    from megatron_dip.training.assembly.build import ddp_config
    from megatron_dip.training.config.pricing import run_kernels

    def chunk_config(spec):
        llm = spec.model.module("llm")
        style = modality_of(llm).layer_style(llm)
        return transformer_config(llm, model_config(spec), shape=spec.shape, style=style)

    split = _resolve(["--dip-split-backward"], world_size=1)
    assert split.delays_weight_gradients and ddp_config(split).delay_wgrad_compute
    assert not chunk_config(split).delay_wgrad_compute  # no Transformer Engine here
    monkeypatch.setattr(megatron_compat, "resolve_use_te", lambda use_te: True)
    monkeypatch.setattr(megatron_compat, "te_delays_weight_gradients", lambda: True)
    assert chunk_config(split).delay_wgrad_compute
    # ... and the cost model prices what TE's queue holds for W (every linear's tensors)
    config = parse_config([*BASE, "--dip-split-backward"], default_model="tiny-vlm")
    for cuda, delay in ((True, True), (True, False), (False, True)):
        kernels = run_kernels(config, cuda=cuda, dtype="bfloat16", emulate=False, delay_wgrad=delay)
        assert kernels.te_delayed_wgrad == (cuda and delay)
    fused = _resolve([], world_size=1)
    assert not fused.delays_weight_gradients and not chunk_config(fused).delay_wgrad_compute
    assert not ddp_config(fused).delay_wgrad_compute
    stock = _resolve(["--dip-schedule", "1f1b", "--dip-split-backward"], world_size=1)
    assert not stock.delays_weight_gradients and not chunk_config(stock).delay_wgrad_compute


def test_stock_schedules_get_megatrons_placement():
    spec = _resolve(
        ["--dip-schedule", "interleaved", "--pipeline-model-parallel-size", "2"], world_size=2
    )
    assert spec.is_stock and len(spec.stage_units[0]) == 2
    assert spec.shape.vp == 2  # Megatron's usual virtual pipeline size by default
    vit = spec.placement.module("vit")
    assert vit.num_chunks == 1 and vit.chunks[0].rank == 0  # the whole encoder on stage 0


def test_the_interleaved_schedule_takes_megatrons_virtual_pipeline_size():
    flags = ["--dip-schedule", "interleaved", "--pipeline-model-parallel-size", "2"]
    for placement in ("llava", "cost"):
        spec = _resolve(
            [*flags, "--dip-stock-placement", placement]
            + ["--num-virtual-stages-per-pipeline-rank", "3"],
            world_size=2,
        )
        assert spec.shape.vp == 3 and all(len(units) == 3 for units in spec.stage_units)
        assert all(stage for units in spec.stage_units for stage in units)  # none empty
    # Megatron-LM's older flag: V = layers / (PP x layers per virtual stage)
    layers = _resolve(flags, world_size=2).model.loss_module.num_layers
    older = _resolve(
        [*flags, "--num-layers-per-virtual-pipeline-stage", str(layers // 4)], world_size=2
    )
    assert older.shape.vp == 2


def test_every_field_is_a_flag_with_help_and_unique_names():
    flags, names = set(), set()
    for _, section in args_module.SECTIONS:
        for f in dataclasses.fields(section):
            meta = f.metadata
            assert meta["flag"].startswith("--") and meta["help"], f.name
            assert meta["flag"][2:].replace("-", "_") == f.name  # Megatron-LM's destinations
            flags.add(meta["flag"])
            names.add(f.name)
            if f.name.startswith("dip_"):
                assert not meta["megatron"]
    assert (
        len(flags) == len(names) == sum(len(dataclasses.fields(s)) for _, s in args_module.SECTIONS)
    )
    help_text = build_parser().format_help()
    assert "--dip-sub-microbatch-size" in help_text and "--tensor-model-parallel-size" in help_text


def test_extra_args_provider_extends_a_megatron_parser():
    """Megatron-LM defines its own flags; the provider adds only ours, and the whole run reads
    back from Megatron's namespace."""
    megatron = argparse.ArgumentParser()
    args_module.add_arguments(megatron)  # stands in for Megatron-LM's own definitions ...
    for action in list(megatron._actions):
        if any(o.startswith("--dip-") or o == "--model" for o in action.option_strings):
            megatron._remove_action(action)
            for o in action.option_strings:
                megatron._option_string_actions.pop(o)
    args_module.extra_args_provider(megatron)  # ... no conflicting flag definitions
    ns = megatron.parse_args([*BASE, "--dip-schedule", "1f1b", "--tensor-model-parallel-size", "1"])
    config = TrainConfig.from_namespace(ns)
    assert config.dip.dip_schedule == "1f1b" and config.train.lr == 1e-3
    assert config.replace(lr=2.0).train.lr == 2.0
    with pytest.raises(KeyError):
        config.replace(no_such_flag=1)
    # Megatron-LM's --ckpt-format offers more formats than this plugin reads and writes
    torch_format = config.replace(ckpt_format="torch", train_iters=2)
    with pytest.raises(ConfigError, match="^--ckpt-format: only torch_dist"):
        resolve(torch_format, world_size=1, cuda=False)


def test_megatrons_distributed_timeout_bounds_the_wait_for_rank_0s_sizing():
    """Megatron-LM's launch scripts pass --distributed-timeout-minutes: it is accepted, and
    bounds the other ranks' wait for rank 0's start-up sizing (else --dip-comm-timeout-s)."""
    from megatron_dip.training.config.settings import startup_timeout_s

    default = parse_config([*BASE, "--dip-comm-timeout-s", "45"], default_model="tiny-vlm")
    assert startup_timeout_s(default) == 45.0
    given = default.replace(distributed_timeout_minutes=30)
    assert startup_timeout_s(given) == 1800.0
    assert resolve(given, world_size=1, cuda=False).runtime.comm_timeout_s == 45.0
    parsed = parse_config([*BASE, "--distributed-timeout-minutes", "30"], default_model="tiny-vlm")
    assert parsed.parallel.distributed_timeout_minutes == 30


def test_entry_point_exits_2_on_a_bad_flag_without_initialising(monkeypatch, caplog):
    from megatron_dip.training.entry import main

    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.ERROR):
        status = main([*BASE, "--pipeline-model-parallel-size", "4"], default_model="tiny-vlm")
    assert status == 2
    assert "world size 6 is not divisible" in caplog.text
    assert not dist.is_initialized()


@pytest.mark.parametrize("rank", [0, 3])
def test_a_configuration_warning_is_said_once_per_job_by_rank_0(rank):
    from megatron_dip.training.entry import setup_logging

    names = ("megatron", "megatron_dip.planner.service", "megatron_dip.training.config")
    levels = {n: logging.getLogger(n).level for n in names}
    # setup_logging sets these loggers' levels and filters Megatron's CPU fallback warnings
    with warnings.catch_warnings():
        try:
            setup_logging(rank)
            config = logging.getLogger("megatron_dip.training.config.data_source")
            assert config.isEnabledFor(logging.WARNING) == (rank == 0)
            assert config.isEnabledFor(logging.ERROR)  # a refusal still names itself everywhere
            data = logging.getLogger("megatron_dip.data.energon")  # what this rank's shards hold
            assert data.isEnabledFor(logging.WARNING)
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def test_log_line_has_megatrons_fields_and_ours():
    """(Of a resumed run: the consumed-samples counter continues the checkpoint's 62.)"""
    from megatron_dip.training.iteration.log import IntervalLog, IterationRecord

    log = IntervalLog(train_iters=10, world_size=4, global_batch=8)
    for it, variant in ((1, "inline"), (2, "searched")):
        log.add(
            IterationRecord(
                iteration=it,
                loss=4.0 + it,
                lr=1e-3,
                grad_norm=0.5,
                seconds=0.5,
                schedule_seconds=0.4,
                samples=10,
                consumed=62 + 10 * it,
                tokens=1000,
                flops=2e12,
                bound_efficiency=0.8,
                variant=variant,
                planned_seconds=0.38,
            )
        )
    line = log.line()
    for text in (
        "iteration      2/    10",
        "consumed samples:         82",
        "elapsed time per iteration (ms): 500.0",
        "lm loss: 5.500000E+00",
        "grad norm: 0.500",
        "tokens/s: 2000",
        "TFLOP/s/GPU: 1",
        "planned/measured (ms): 380.0/400.0",
        "bound efficiency: 80.0%",
        "plans searched/greedy/inline: 1/0/1",
    ):
        assert text in line, line


def test_tensorboard_scalars_when_tensorboard_is_importable(monkeypatch, tmp_path):
    import sys
    import types

    from megatron_dip.training.iteration.log import IntervalLog, IterationRecord

    written = []

    class Writer:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, name, value, step):
            written.append((name, step))

        def close(self):
            written.append(("closed", -1))

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer)
    )
    log = IntervalLog(train_iters=1, world_size=1, global_batch=1, tensorboard_dir=str(tmp_path))
    log.add(
        IterationRecord(
            iteration=1,
            loss=1.0,
            lr=0.1,
            grad_norm=0.2,
            seconds=1.0,
            schedule_seconds=0.9,
            samples=1,
            consumed=1,
            tokens=1,
            flops=1.0,
            bound_efficiency=0.5,
            variant="inline",
            planned_seconds=0.8,
        )
    )
    log.close()
    names = {n for n, _ in written}
    assert {"lm loss", "learning-rate", "grad-norm", "dip/bound-efficiency"} <= names
    assert {"dip/planned-iteration-time", "closed"} <= names


@pytest.mark.parametrize("model", ["tiny-vlm", "tiny-t2v"])
def test_startup_placement_search_scores_static_placements_and_keeps_the_best(
    model, caplog, monkeypatch
):
    """Without --dip-segments, DIP's placement is the best-scoring of its segment counts and
    the static Megatron placements; a static one keeps its virtual stages for the planner."""
    from megatron_dip.training.config import layout
    from megatron_dip.training.iteration.planning import make_planner

    base = ["--model", model, "--train-iters", "2", "--lr", "1"]
    bounds, scored, planned = {}, {}, {}
    real_bound, real_score = layout._Sizing.bound, layout._Sizing.score
    real_plan_score = layout._Sizing.plan_score

    def bound(self, cand):
        bounds[cand.name] = real_bound(self, cand)
        return bounds[cand.name]

    def score(self, cand):
        scored[cand.name] = real_score(self, cand)
        return scored[cand.name]

    def plan_score(self, cand):
        planned[cand.name] = real_plan_score(self, cand)
        return planned[cand.name]

    monkeypatch.setattr(layout._Sizing, "bound", bound)
    monkeypatch.setattr(layout._Sizing, "score", score)
    monkeypatch.setattr(layout._Sizing, "plan_score", plan_score)
    with caplog.at_level(logging.INFO, logger="megatron_dip.training.config.layout"):
        spec = _resolve(  # one process: the recording `score` above does not pickle
            ["--pipeline-model-parallel-size", "2", "--dip-segments", "auto"]
            + ["--dip-startup-workers", "1"],
            world_size=2,
            base=base,
        )
    # The bound is one (no candidate scores below it); candidates skipped had a bound above
    # the best score, so they could not have won.
    assert set(scored) <= set(bounds) and scored
    assert all(bounds[n] <= scored[n] * (1 + 1e-9) for n in scored)
    assert all(bounds[n] > min(scored.values()) for n in set(bounds) - set(scored))
    (record,) = [r for r in caplog.records if "chosen" in r.getMessage()]
    count, _seconds, workers, chosen, flag, scores = record.args
    assert workers == 1
    assert count == len(scores)
    assert {"static stock v1", "static cost-split v1", "static cost-split v2"} <= set(bounds)
    # Near-ties of the best greedy score are planned again as the run plans (placement_ties):
    # the finalists are the best and those within the margin whose bound does not exceed it,
    # and where the best is a moved cut, the cut its climb started from.
    best = min(scores.values())
    near = sorted(
        (s, n) for n, s in scores.items() if s <= best * (1 + TIE_MARGIN) and bounds[n] <= best
    )
    finalists = {n for _, n in near[:MAX_FINALISTS]} | {near[0][1].split(" cut ")[0]}
    assert set(planned) == (finalists if len(finalists) > 1 else set())
    if planned:
        assert planned[chosen] == min(planned.values())
    else:
        assert scores[chosen] == best
    static = chosen.startswith("static ")
    assert (spec.stage_units is not None) == static and (spec.segments == {}) == static
    assert make_planner(spec).stage_units == spec.stage_units
    # The logged --dip-segments value gives the same placement without searching again.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_dip.training.config.layout"):
        again = _resolve(
            ["--pipeline-model-parallel-size", "2", "--dip-segments", flag],
            world_size=2,
            base=base,
        )
    assert not [r for r in caplog.records if "chosen" in r.getMessage()]
    assert again.placement == spec.placement and again.stage_units == spec.stage_units
    assert again.sub_sizes == spec.sub_sizes


@pytest.mark.parametrize(
    "mode",
    [
        MemoryPolicy(Recompute.NONE, 0),
        MemoryPolicy(Recompute.SELECTIVE, 0),
        MemoryPolicy(Recompute.FULL, 0),
        MemoryPolicy(Recompute.BLOCK, 3),
        MemoryPolicy(Recompute.UNIFORM, 1),
    ],
)
def test_recompute_flags_are_read_back_as_their_mode(mode) -> None:
    """The benchmark passes the strongest stock configuration's recompute setting as Megatron's
    flags: they must mean that setting again."""
    from megatron_dip.training.config.recompute_flags import recompute_flags, recompute_mode

    assert recompute_mode(parse_config(recompute_flags(mode))) == mode
