"""tools/profile_costs.py and megatron_dip.profiling: measured layer times the cost model uses.

In-process on the CPU with the tiny models and tiny grids; the timed numbers themselves are
noise here, so the tests check what is done with them (format, interpolation, fallback) and
that the timed layers are the right ones (per-rank shapes, packed attention = dense masks).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_dip.modelspec import tiny_t2v, tiny_vlm
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.cost_model import CostModel
from megatron_dip.planner.devices import H100, load_profile
from megatron_dip.schedule.ir import ChunkSpec, SubMicrobatch

_TOOL = Path(__file__).resolve().parent.parent / "tools" / "profile_costs.py"
FAST = ["--warmup", "0", "--iters", "2"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("profile_costs", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_costs"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vit_profile(tool, tmp_path_factory) -> Path:
    """A TP1 profile of the tiny VLM's ViT only, written by the CLI."""
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    args = ["--preset", "tiny-vlm", "--modules", "vit", "--grid", "vit=8,16,32@1,3", *FAST]
    assert tool.main([*args, "--out", str(out)]) == 0
    return out


def _mid(module: str) -> ChunkSpec:
    return ChunkSpec(module, 1, 0, 2, 4)  # two layers, no input or output layers


def _sub(module: str, instances: int, tokens: int) -> SubMicrobatch:
    return SubMicrobatch(module, 0, 0, 0, instances, tokens, tokens)


def _points(path: Path, module: str) -> dict[tuple[int, int], tuple[float, float]]:
    raw = json.loads(path.read_text())["modules"][module]
    return {(p["tokens"], p["instances"]): (p["forward_ms"], p["backward_ms"]) for p in raw}


def test_cli_writes_a_profile_load_profile_reads(vit_profile) -> None:
    profile = load_profile(vit_profile)
    assert profile.device == "cpu" and profile.dtype == "float32"
    assert profile.tensor_parallel == 1 and profile.tp_comm_included
    assert profile.attention.startswith("megatron-dip PackedAttention: torch SDPA per segment")
    assert {"torch", "megatron_core", "python"} <= set(profile.software)
    assert set(profile.modules) == {"vit"}
    points = _points(vit_profile, "vit")
    assert set(points) == {(t, n) for t in (8, 16, 32) for n in (1, 3)}
    assert all(f > 0 and b > 0 for f, b in points.values())
    details = profile.details
    assert details["timing"] == "time.perf_counter" and details["iters"] == 2
    assert details["per_rank_shapes"]["vit"] == {
        "hidden": 32,
        "heads": 4,
        "kv_groups": 4,
        "head_dim": 8,
        "ffn": 64,
    }
    assert details["command"].startswith("tools/profile_costs.py --preset tiny-vlm")


def test_cost_model_uses_measurements_and_interpolates(vit_profile) -> None:
    model = tiny_vlm()
    cm = CostModel(model, H100, profile=load_profile(vit_profile))
    pts = _points(vit_profile, "vit")
    # At a grid point: exactly the measurement (two layers in the chunk).
    for (tokens, n), (f, b) in pts.items():
        c = cm.stage_cost(_mid("vit"), _sub("vit", n, n * tokens))
        assert (c.forward, c.backward) == pytest.approx((2 * f / 1e3, 2 * b / 1e3), rel=1e-12)
    # Between token counts: linear in tokens per instance (per-instance times, times n).
    c = cm.stage_cost(_mid("vit"), _sub("vit", 3, 3 * 12))
    f = 3 * (pts[(8, 3)][0] / 3 + pts[(16, 3)][0] / 3) / 2
    assert c.forward == pytest.approx(2 * f / 1e3, rel=1e-9)
    # Between instance counts: linear in the per-instance times of the bracketing counts.
    c = cm.stage_cost(_mid("vit"), _sub("vit", 2, 2 * 16))
    per = (pts[(16, 1)][1] + pts[(16, 3)][1] / 3) / 2
    assert c.backward == pytest.approx(2 * 2 * per / 1e3, rel=1e-9)
    # More instances than measured: the largest count's per-instance time, times n.
    c = cm.stage_cost(_mid("vit"), _sub("vit", 6, 6 * 16))
    assert c.forward == pytest.approx(2 * 6 * pts[(16, 3)][0] / 3 / 1e3, rel=1e-9)


def test_outside_tokens_scales_by_analytic_and_uncovered_module_is_analytic(vit_profile) -> None:
    model = tiny_vlm()
    cm = CostModel(model, H100, profile=load_profile(vit_profile))
    analytic = CostModel(model, H100)
    edge, beyond = (analytic.stage_cost(_mid("vit"), _sub("vit", 1, t)).forward for t in (32, 64))
    c = cm.stage_cost(_mid("vit"), _sub("vit", 1, 64))
    assert c.forward == pytest.approx(
        2 * _points(vit_profile, "vit")[(32, 1)][0] / 1e3 * beyond / edge
    )
    # The LLM is not in the profile: the analytic model, unchanged.
    assert cm.stage_cost(_mid("llm"), _sub("llm", 1, 64)) == analytic.stage_cost(
        _mid("llm"), _sub("llm", 1, 64)
    )


def test_tensor_parallel_shards_are_timed_without_collectives(tmp_path) -> None:
    from megatron_dip.profiling import ProfileConfig, ProfileGrid, profile_model, write_profile

    cfg = ProfileConfig(tensor_parallel=2, warmup=0, iters=1, max_tokens=16)
    doc = profile_model(tiny_vlm(), {"llm": ProfileGrid((8, 16), (1, 2))}, cfg)
    path = write_profile(doc, tmp_path / "tp2.json")
    profile = load_profile(path)
    assert profile.tensor_parallel == 2 and not profile.tp_comm_included
    assert profile.details["per_rank_shapes"]["llm"] == {
        "hidden": 32,
        "heads": 2,
        "kv_groups": 1,
        "head_dim": 8,
        "ffn": 32,
    }
    assert {(p.tokens, p.instances) for p in profile.modules["llm"]} == {(8, 1), (16, 1), (8, 2)}
    assert profile.details["skipped"] == [
        {"module": "llm", "tokens": 16, "instances": 2, "reason": "> max_tokens 16"}
    ]
    cm = CostModel(tiny_vlm(), H100, shape=ParallelShape(tp=2), profile=profile)
    # The shard was timed alone: the cost model adds its own TP all-reduce term per layer.
    f, b = next((p.forward_ms, p.backward_ms) for p in profile.modules["llm"] if p.tokens == 8)
    comm = cm._tp_comm(tiny_vlm().module("llm"), 8)
    assert comm > 0
    c = cm.stage_cost(_mid("llm"), _sub("llm", 1, 8))
    assert (c.forward, c.backward) == pytest.approx(
        (2 * (f / 1e3 + comm), 2 * (b / 1e3 + comm)), rel=1e-9
    )
    with pytest.raises(ValueError, match="'tensor_parallel' is 2"):
        CostModel(tiny_vlm(), H100, shape=ParallelShape(tp=1), profile=profile)
    with pytest.raises(RuntimeError, match="no grid point could be timed"):
        profile_model(tiny_vlm(), {"llm": ProfileGrid((8,), (1,))}, cfg.__class__(time_budget_s=0))


def _stack(module, cfg, groups, *, kernel: str):
    from megatron_dip.profiling import (
        _init_parameters,
        build_layer_stack,
        sharded_transformer_config,
    )

    tconfig = sharded_transformer_config(module, cfg, dtype=cfg.dtype)
    stack = build_layer_stack(module, tconfig, use_te=False, kernel=kernel, groups=groups)
    stack.to(dtype=torch.float64)
    _init_parameters(stack, seed=5)
    return stack


@pytest.mark.parametrize(("make", "name"), [(tiny_vlm, "llm"), (tiny_t2v, "dit")])
def test_sharded_layers_run_the_packed_attention_of_the_chunks(single_rank_world, make, name):
    """Per-rank weight shapes; the profiled layers' packed attention gives the outputs and
    gradients of the dense-mask attention (grouped-query, causal and documents for the LLM;
    cross-attention for the DiT)."""
    from attention_reference import dense_reference

    from megatron_dip import megatron_compat
    from megatron_dip.cpu_support import seed_model_parallel_rng
    from megatron_dip.models.common import ModelGroups
    from megatron_dip.profiling import ProfileConfig, _layer_runner

    megatron_compat.ensure_global_memory_buffer()
    seed_model_parallel_rng(0)
    module = make().module(name)
    groups = ModelGroups(tp=single_rank_world, cp=single_rank_world)
    cfg = ProfileConfig(tensor_parallel=2, layers=2, dtype="float64", caption_tokens=3)
    results = []
    for dense in (True, False):
        with dense_reference() if dense else contextlib.nullcontext():
            stack = _stack(module, cfg, groups, kernel="segments")
            run, hidden = _layer_runner(module, stack, tokens=5, instances=2, cfg=cfg, device="cpu")
            x = hidden.detach().requires_grad_(True)
            out = run(x)
            out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad))
    weights = dict(stack.named_parameters())
    qkv = "0.self_attention.linear_qkv.weight"
    kv_rows = 2 * 8 * (module.layer.kv_groups // 2)
    assert weights[qkv].shape == (2 * 8 + kv_rows, 32)  # 2 of 4 heads, hidden 32
    fc1 = 2 * 32 if module.layer.gated_mlp else 32  # ffn 64 / TP 2 (gate and up for SwiGLU)
    assert weights["0.mlp.linear_fc1.weight"].shape == (fc1, 32)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "nope"], "--preset: unknown preset 'nope'; known: tiny-vlm"),
        (
            ["--preset", "tiny-vlm", "--modules", "vit,dit"],
            "--modules: tiny-vlm has no module 'dit'",
        ),
        (["--preset", "tiny-vlm", "--grid", "vit=8,16"], "expected TOKENS@INSTANCES"),
        (["--preset", "tiny-vlm", "--grid", "vit=8,x@1"], "--grid 'vit=8,x@1'"),
        (["--preset", "tiny-vlm", "--grid", "vit=8,0@1"], "must be positive integers"),
        (["--preset", "tiny-vlm", "--grid", "8@1"], "expected MODULE=TOKENS@INSTANCES"),
        (
            ["--preset", "tiny-vlm", "--modules", "llm", "--grid", "vit=8@1"],
            "module 'vit' is not profiled",
        ),
        (["--preset", "vlm-s", "--tensor-parallel", "3"], "--tensor-parallel 3: module 'vit'"),
        (["--preset", "tiny-vlm", "--attention", "flash"], "--attention: invalid choice"),
        (["--preset", "tiny-vlm", "--dtype", "float8"], "dtype must be auto, float32"),
        (["--preset", "tiny-vlm", "--iters", "0"], "layers and iters must be >= 1"),
    ],
)
def test_cli_argument_errors_name_the_flag(tool, tmp_path, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tool.parse_args([*args, "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_profile_format_additions_are_optional_and_checked(vit_profile, tmp_path) -> None:
    raw = json.loads(vit_profile.read_text())
    old = {k: v for k, v in raw.items() if k not in ("dtype", "tp_comm_included", "details")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = load_profile(path)  # a profile from before the additions: comm included
    assert profile.tp_comm_included and profile.dtype == "" and profile.details == {}
    for field, value in (("tp_comm_included", "no"), ("dtype", 16), ("details", [])):
        path.write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ValueError, match=f"old.json: field '{field}'"):
            load_profile(path)
