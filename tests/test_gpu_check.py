"""`scripts/gpu_check.sh` and its Python body `megatron_dip.gpu_check`, as far as a CPU can go.

The shell script refuses bad arguments before installing anything. The Python body runs on the
CPU with a tiny configuration (tiny-vlm, 2 iterations, float32: bf16 matrix products are very
slow on most CPUs): both attention runs (on a CPU the "GPU attention" is SDPA per segment too),
the memory part, the executor-overhead part from the run's metrics and traces, the profile part
on a profile file; one table printed and the JSON written. What it measures on a GPU (TE / varlen
attention against SDPA, CUDA allocator numbers, CUDA-event timelines) needs a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_script_refuses_bad_arguments_before_installing(tmp_path):
    usage = _script()
    assert usage.returncode == 2 and "usage: scripts/gpu_check.sh WHEEL_DIR" in usage.stderr
    missing = _script(str(tmp_path / "nope"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    empty = _script(str(tmp_path))
    assert empty.returncode == 2 and "holds no megatron_core-0.16.1-*.whl" in empty.stderr
    assert "pip download megatron-core==0.16.1" in empty.stderr
    (tmp_path / "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    budget = _script(str(tmp_path), str(tmp_path / "out"), "soon")
    assert budget.returncode == 2 and "PROFILE_BUDGET_S must be" in budget.stderr
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was installed


def _profile(directory: Path) -> Path:
    directory.mkdir()
    points = {
        "vit": [{"tokens": 2704, "instances": 4, "forward_ms": 12.0, "backward_ms": 25.0}],
        "llm": [{"tokens": 8192, "instances": 1, "forward_ms": 30.0, "backward_ms": 61.0}],
    }
    document = {
        "format": "megatron-dip-profile/1", "device": "H200", "software": {"torch": "2.9"},
        "attention": "torch FlashAttention varlen_attn", "tensor_parallel": 4,
        "tp_comm_included": False, "modules": points,
    }  # fmt: skip
    (directory / "vlm-s-tp4-h200-varlen.json").write_text(json.dumps(document))
    return directory


@pytest.mark.distributed  # a process of its own, like the distributed tests
def test_the_checks_run_on_the_cpu_and_write_one_table_and_a_json(tmp_path):
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "megatron_dip.gpu_check", "--out", str(out), "--iterations", "2",
        "--models", "tiny-vlm", "--train-args", "--global-batch-size 2",
        "--memory-microbatches", "1", "--dtype", "float32",
        "--profiles", str(_profile(tmp_path / "profiles")),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        args, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "work" / "rendezvous").exists()  # its process group's file: nothing left in /tmp
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["failed"] == [] and report["cuda"] is False
    assert report["environment"]["memory_model_kernels"] == {
        "attention": "segments",
        "fused_rms_norm": False,
    }
    run = report["training"]["models"]["tiny-vlm"]
    assert run["ok"] and sorted(run["losses_gpu_attention"]) == ["1", "2"]
    assert run["losses_gpu_attention"] == run["losses_cpu_attention"]  # the same kernel on a CPU
    memory = report["memory"]
    assert {(r["module"], r["chunk"], r["recompute"]) for r in memory} == {
        (m, c, r)
        for m in ("vit", "llm")
        for c in ("first", "middle", "last")
        for r in (
            *("none", "selective", "full", "block2", "uniform2", "off1", "block1+off1"),
            *("none+ln+act", "block1+ln+act"),
        )
    }
    assert all(r["error"] is None or abs(r["error"]) < 0.10 for r in memory)
    timed = report["overhead"]["iterations"]
    assert [t["iteration"] for t in timed] == [2] and timed[0]["instructions"] > 0
    assert 0 < timed[0]["device_busy_s"] <= timed[0]["host_s"]
    assert {r["module"] for r in report["profile"]} == {"vit", "llm"}
    assert all(r["analytic_forward_ms"] > 0 for r in report["profile"])
    offload = report["offload"]
    assert offload["offloaded_mb"] == 4 and offload["d2h_gb_per_s"] > 0
    split = report["split_backward"]
    assert split["ok"] and split["te_delayed_weight_gradients"] is False
    assert split["weight_instructions"] > 0  # the split run did split
    assert sorted(split["losses_split"]) == ["1", "2"] and split["max_relative_difference"] < 1e-4
    pending = report["pending_weight"]
    assert pending["ok"] and pending["te_delayed_weight_gradients"] is False
    chunks = {(r["module"], r["chunk"]) for r in pending["rows"]}
    assert ("llm", "middle") in chunks and ("vit", "middle") in chunks
    for r in pending["rows"]:  # hooks see what the model prices (no allocator on the CPU)
        assert r["predicted"] > 0 and r["saved"] > 0 and r["allocated"] == 0 and r["error"] is None
    sections = (
        "[training]",
        "[memory]",
        "[executor]",
        "[offload]",
        "[profile]",
        "[split backward]",
        "[pending W]",
    )
    for section in sections:
        assert section in done.stdout
