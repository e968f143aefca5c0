"""The checks that only a GPU can answer, on one GPU, in one command (`scripts/gpu_check.sh`).

    python -m megatron_dip.gpu_check --out OUT_DIR [--iterations 5] [--profiles DIR]

1. Training: tiny-vlm and tiny-t2v, --bf16, one rank, a few iterations, once with the GPU
   attention (Transformer Engine's THD attention when it imports, else torch's FlashAttention
   varlen kernel: `--dip-attention auto`) and once with our CPU attention (SDPA per segment:
   `--dip-attention segments`): the losses must agree within 2% (relative) at every iteration.
2. Memory: every chunk of the two models (first / middle / last chunk of each module), bf16,
   each recompute mode, through the reference pipeline (`memory_probe`): the cost model's
   prediction for the kernels that run next to what autograd saved, the allocator's growth
   over the forward (`torch.cuda.memory_allocated`) and its peak (`max_memory_allocated`).
3. Executor overhead: the GPU-attention tiny-vlm run's per-instruction CUDA-event timeline
   (`--dip-trace-dir`) against the host's schedule time (`--dip-metrics-json`): device-busy
   time, the gaps between consecutive instructions and the host time not covered by them.
4. Offload: the copies of activation offload (`runtime/offload.py`, pinned host buffers on a
   side stream) timed with CUDA events against a chain of matrix products, alone and together
   (`offload_probe.transfer_overlap`): host-link bandwidth per direction and the overlap. The
   memory part (2) also runs the offload policies (one layer offloaded, alone and after block
   recomputation): the allocator's growth then shows what offload left on the device.
5. Layer profile: a summary of the profiles `scripts/profile_gpu.sh` wrote into `--profiles`
   (VLM-S layers at TP4), next to the analytic cost model's times for the same points.
6. Split backward: the first model trained in fp32 with every backward split into B and W
   (`--dip-split-backward --dip-split-backward-always`; with Transformer Engine >= 2.3 its
   layers queue their weight GEMMs for `backward_dw`, `runtime/delayed_wgrad.py`) against
   the same run with fused backwards: losses and gradient norms must agree within 1e-4
   (relative; the same arithmetic, summed in another order).
7. Pending W: the first model's chunks (first / middle / last of each module) built as part 6
   builds them, each backward split through the reference pipeline (`memory_probe.
   measure_pending_weights`): the bytes W releases on the device (the allocator's drop, with
   the weight gradients it allocates added back, plus the received messages), what the
   saved-tensor hooks see, and `CostModel.weight_bytes` priced for the kernels that run
   (Transformer Engine's weight-GEMM queue where it queues). On CUDA the middle chunks must be
   within 15% of the model.

It prints one table and writes `OUT_DIR/gpu_check.json`; each part that fails is reported with
its error and the others still run; the exit status is 1 when any part failed or a check did
not hold. On a machine without CUDA the same code runs on the CPU (the tests run it so): the
"GPU attention" is then SDPA per segment too and the times are host times.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import statistics
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dip import megatron_compat
from megatron_dip.models import attention as packed_attention
from megatron_dip.models.kernels import resolve_kernels

logger = logging.getLogger("megatron_dip.gpu_check")

MODELS = ("tiny-vlm", "tiny-t2v")
LOSS_TOLERANCE = 0.02
SPLIT_TOLERANCE = 1e-4
# What a pending W holds on the device against `CostModel.weight_bytes` (middle chunks): the
# CPU test holds our own split's within 7%; on a GPU Transformer Engine's queue is priced too.
PENDING_W_TOLERANCE = 0.15
_BYTES = {"bfloat16": 2, "float32": 4}


def _train(model: str, *, attention: str, iterations: int, cuda: bool, extra=()) -> dict:
    """One training run of `model` on this single rank (`extra` flags: --bf16, ...); its losses
    and gradient norms."""
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.validate import resolve
    from megatron_dip.training.iteration.loop import pretrain

    argv = [
        "--model", model, "--train-iters", str(iterations), "--lr", "1e-3",
        "--seed", "7", "--dip-lookahead", "0", "--dip-search-time-ms", "0",
        "--dip-calibration-frozen", "--log-interval", str(iterations),
        "--dip-attention", attention, *extra,
    ]  # fmt: skip
    result = pretrain(resolve(parse_config(argv), world_size=1, cuda=cuda))
    return {"losses": dict(result.losses), "grad_norms": dict(result.grad_norms)}


def gpu_attention_label(cuda: bool) -> str:
    """What `--dip-attention auto` runs in bf16 here."""
    if cuda and megatron_compat.transformer_engine_available():
        return "Transformer Engine THD (TEDotProductAttention)"
    if cuda and packed_attention.varlen_available():
        return "torch FlashAttention varlen_attn"
    return "SDPA per segment (no GPU kernel here)"


def training_check(models, *, iterations: int, cuda: bool, work: Path, flags=()) -> dict:
    """Part 1 (module docstring); the GPU-attention tiny-vlm run also writes the metrics and
    traces part 3 reads. `flags`: more training flags for every run."""
    out = {"gpu_attention": gpu_attention_label(cuda), "models": {}}
    for model in models:
        timing = [*flags]
        if model == "tiny-vlm":
            timing += ["--dip-metrics-json", str(work / "metrics.jsonl")]
            timing += ["--dip-trace-dir", str(work / "traces"), "--dip-trace-interval", "1"]
        gpu = _train(model, attention="auto", iterations=iterations, cuda=cuda, extra=timing)
        cpu = _train(model, attention="segments", iterations=iterations, cuda=cuda, extra=flags)
        diffs = [
            abs(gpu["losses"][i] - cpu["losses"][i]) / abs(cpu["losses"][i]) for i in cpu["losses"]
        ]
        out["models"][model] = {
            "losses_gpu_attention": gpu["losses"],
            "losses_cpu_attention": cpu["losses"],
            "max_relative_difference": max(diffs),
            "ok": max(diffs) < LOSS_TOLERANCE and len(gpu["losses"]) == iterations,
        }
    return out


def split_backward_check(model: str, *, iterations: int, cuda: bool, work: Path, flags=()) -> dict:
    """Part 6 (module docstring): `model` in fp32 (`flags` less --bf16), fused against split;
    the split run's traces (in `work`) count the weight halves it ran."""
    flags = [f for f in flags if f != "--bf16"]
    traces = work / "split-traces"
    split_flags = [*flags, "--dip-split-backward", "--dip-split-backward-always"]
    split_flags += ["--dip-trace-dir", str(traces), "--dip-trace-interval", "1"]
    fused = _train(model, attention="auto", iterations=iterations, cuda=cuda, extra=flags)
    split = _train(model, attention="auto", iterations=iterations, cuda=cuda, extra=split_flags)
    weights = sum(_measured_names(t).count("BW") for t in sorted(traces.glob("*.json")))
    diffs = [
        abs(split[k][i] - fused[k][i]) / max(abs(fused[k][i]), 1e-12)
        for k in ("losses", "grad_norms")
        for i in fused[k]
    ]
    return {
        "model": model,
        "te_delayed_weight_gradients": cuda and megatron_compat.te_delays_weight_gradients(),
        "losses_fused": fused["losses"],
        "losses_split": split["losses"],
        "grad_norms_fused": fused["grad_norms"],
        "grad_norms_split": split["grad_norms"],
        "weight_instructions": weights,
        "max_relative_difference": max(diffs),
        "ok": max(diffs) < SPLIT_TOLERANCE and len(split["losses"]) == iterations and weights > 0,
    }


def _microbatches(model, preset, *, count: int):
    """`count` packed microbatches of the preset's synthetic data (arrays)."""
    from megatron_dip.batching import packing_limits
    from megatron_dip.data.packing import pack_microbatches
    from megatron_dip.data.synthetic import generate_meta, generate_samples

    mixture = preset.data.removeprefix("synthetic-")
    kwargs = {"model": model, "num_samples": 8 * count, "seed": 3, "scale": preset.data_scale}
    if preset.image_size is not None:
        kwargs["image_size"] = preset.image_size
    samples = {s.sample_id: s for s in generate_samples(mixture, **kwargs)}
    limits = packing_limits(model, preset.seq_length)
    packing = pack_microbatches(
        generate_meta(mixture, **kwargs),
        seq_length=preset.seq_length,
        max_instances_per_microbatch=limits.max_instances or 8,
    )
    return [[samples[m.sample_id] for m in mb.samples] for mb in packing[:count]]


def memory_check(
    models, *, cuda: bool, microbatches: int = 2, dtype: str = "bfloat16"
) -> list[dict]:
    """Part 2 (module docstring): one row per (model, module, chunk, recompute), over
    `microbatches` microbatches of the preset's data."""
    from megatron_dip.memory_probe import MEASURED_MODES, measure_model, mode_name
    from megatron_dip.models import ModelConfig
    from megatron_dip.models.chunk import ModelGroups
    from megatron_dip.planner.cost_model import CostModel, Kernels
    from megatron_dip.planner.devices import H100
    from megatron_dip.training.config.presets import get_run_preset

    kernel, fused = resolve_kernels(cuda=cuda, dtype=dtype)
    kernels = Kernels(attention=kernel, fused_rms_norm=fused)
    groups = ModelGroups(tp=dist.group.WORLD, cp=dist.group.WORLD)
    rows = []
    for name in models:
        preset = get_run_preset(name)
        model = preset.model()
        ranges = {m.name: _three_chunks(m.num_layers) for m in model.modules}
        cost = CostModel(model, H100, dtype_bytes=_BYTES[dtype], kernels=kernels)
        batches = _microbatches(model, preset, count=microbatches)
        sizes = dict(p.split("=") for p in (preset.sub_microbatch_size or "").split(",") if p)
        for mode in MEASURED_MODES:
            records = measure_model(
                model,
                batches,
                cost_model=cost,
                recompute=mode,
                groups=groups,
                config=ModelConfig(dtype=dtype, seed=7),
                seq_length=preset.seq_length,
                ranges=ranges,
                sizes={k: int(v) for k, v in sizes.items()},
            )
            rows += _memory_rows(name, mode_name(mode), records)
    return rows


def pending_weight_check(
    model_name: str, *, cuda: bool, microbatches: int = 2, dtype: str = "bfloat16"
) -> dict:
    """Part 7 (module docstring): one row per (module, chunk) of `model_name`."""
    from megatron_dip.memory_probe import measure_pending_weights
    from megatron_dip.models import ModelConfig
    from megatron_dip.models.chunk import ModelGroups
    from megatron_dip.planner.cost_model import CostModel, Kernels
    from megatron_dip.planner.devices import H100
    from megatron_dip.training.config.presets import get_run_preset

    queued = cuda and megatron_compat.te_queues_weight_gradients(True, None)
    kernel, fused = resolve_kernels(cuda=cuda, dtype=dtype)
    kernels = Kernels(attention=kernel, fused_rms_norm=fused, te_delayed_wgrad=queued)
    preset = get_run_preset(model_name)
    model = preset.model()
    sizes = dict(p.split("=") for p in (preset.sub_microbatch_size or "").split(",") if p)
    records = measure_pending_weights(
        model,
        _microbatches(model, preset, count=microbatches),
        cost_model=CostModel(model, H100, dtype_bytes=_BYTES[dtype], kernels=kernels),
        config=ModelConfig(dtype=dtype, seed=7, delay_wgrad=True),
        groups=ModelGroups(tp=dist.group.WORLD, cp=dist.group.WORLD),
        seq_length=preset.seq_length,
        ranges={m.name: _three_chunks(m.num_layers) for m in model.modules},
        sizes={k: int(v) for k, v in sizes.items()},
    )
    rows: dict = {}
    for r in records:
        where = "first" if r.first else ("last" if r.last else "middle")
        row = rows.setdefault(
            (r.module, where), dict.fromkeys(("predicted", "saved", "allocated"), 0)
        )
        row.update(module=r.module, chunk=where)
        row["predicted"] += r.predicted
        row["saved"] += r.measured
        row["allocated"] += r.allocated
    out = list(rows.values())
    for row in out:
        row["error"] = (
            row["allocated"] / row["predicted"] - 1 if cuda and row["predicted"] else None
        )
    middle = [r["error"] for r in out if r["chunk"] == "middle" and r["error"] is not None]
    ok = all(abs(e) <= PENDING_W_TOLERANCE for e in middle)
    return {"model": model_name, "te_delayed_weight_gradients": queued, "rows": out, "ok": ok}


def _three_chunks(num_layers: int) -> list[tuple[int, int]]:
    """A module's first layer, its middle layers and its last layer, as three chunks."""
    return [(0, 1), (1, num_layers - 1), (num_layers - 1, num_layers)]


def _memory_rows(model: str, mode: str, records) -> list[dict]:
    totals: dict = {}
    for r in records:
        where = "first" if r.first else ("last" if r.last else "middle")
        row = totals.setdefault(
            (r.module, where),
            {
                "model": model,
                "module": r.module,
                "chunk": where,
                "recompute": mode,
                "predicted": 0,
                "saved": 0,
                "allocated": 0,
                "peak": 0,
            },
        )
        row["predicted"] += r.predicted
        row["saved"] += r.measured
        row["allocated"] += r.allocated
        row["peak"] = max(row["peak"], r.peak)
    rows = list(totals.values())
    for row in rows:
        row["error"] = row["predicted"] / row["saved"] - 1 if row["saved"] else None
    return rows


def offload_check(cuda: bool) -> dict:
    """Part 4 (module docstring); small on a CPU, where only the round trip is checked."""
    from megatron_dip.offload_probe import transfer_overlap

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        return transfer_overlap(device)
    return transfer_overlap(device, megabytes=4, matmuls=2, size=128)


def overhead_check(work: Path) -> dict:
    """Part 3 (module docstring), from the GPU-attention tiny-vlm run's files."""
    records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    traces = sorted((work / "traces").glob("*.json"))
    per_iteration = []
    for record, trace in zip(records[1:], traces[1:]):  # the first iteration warms up
        spans = _measured_spans(trace)
        busy = sum(end - start for start, end in spans)
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
        host = record["schedule_seconds"]
        per_iteration.append(
            {
                "iteration": record["iteration"],
                "instructions": len(spans),
                "host_s": host,
                "device_busy_s": busy,
                "median_gap_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
                "overhead_per_instruction_ms": 1e3 * (host - busy) / max(1, len(spans)),
            }
        )
    if not per_iteration:
        raise RuntimeError("no timed iteration after the warm-up: raise --iterations")
    mean = statistics.mean(p["overhead_per_instruction_ms"] for p in per_iteration)
    return {"iterations": per_iteration, "overhead_per_instruction_ms": mean}


def _measured_events(trace: Path) -> list[dict]:
    """The measured compute instructions of pipeline rank 0 in a runtime trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    measured = [p for p, n in names.items() if n.startswith("measured")]
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in measured[:1]]


def _measured_spans(trace: Path) -> list[tuple[float, float]]:
    """(start, end) seconds of the measured compute instructions of pipeline rank 0, in order."""
    return sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in _measured_events(trace))


def _measured_names(trace: Path) -> list[str]:
    """The compute labels (`ir.compute_label`: F, B, BI, BW) of `_measured_events`."""
    return [e["name"].split()[0] for e in _measured_events(trace)]


def profile_check(directory: Path) -> list[dict]:
    """Part 4 (module docstring): per profile and module, its largest point measured and the
    analytic model's time for it on the profile's device."""
    from megatron_dip.modelspec import PAPER_SETUPS
    from megatron_dip.parallel import ParallelShape
    from megatron_dip.planner.cost_model import CostModel
    from megatron_dip.planner.devices import DEVICES, H100, load_profile
    from megatron_dip.schedule.ir import ChunkSpec, SubMicrobatch

    rows = []
    setup = PAPER_SETUPS["vlm-s"]
    for path in sorted(directory.glob("*.json")):
        profile = load_profile(path)
        device = DEVICES.get(profile.device, H100)
        analytic = CostModel(setup.model, device, shape=ParallelShape(tp=profile.tensor_parallel))
        for module, points in profile.modules.items():
            p = max(points, key=lambda q: q.tokens * q.instances)
            n = p.tokens * p.instances
            sub = SubMicrobatch(module, 0, 0, 0, p.instances, n, n, p.instances * p.tokens**2)
            c = analytic.stage_cost(ChunkSpec(module, 1, 0, 1, 2), sub)
            rows.append(
                {
                    "profile": path.name,
                    "attention": profile.attention,
                    "module": module,
                    "points": len(points),
                    "tokens": p.tokens,
                    "instances": p.instances,
                    "forward_ms": p.forward_ms,
                    "backward_ms": p.backward_ms,
                    "analytic_forward_ms": 1e3 * c.forward,
                    "analytic_backward_ms": 1e3 * c.backward,
                }
            )
    return rows


def environment(cuda: bool) -> dict:
    """What ran: versions, device, kernels."""
    from megatron_dip.profiling import device_names, software_versions

    short, full = device_names()
    kernel, fused = resolve_kernels(cuda=cuda, dtype="bfloat16")
    return {
        "device": short,
        "device_name": full,
        "software": software_versions(),
        "transformer_engine": megatron_compat.transformer_engine_available(),
        "varlen_attn": packed_attention.varlen_available(),
        "memory_model_kernels": {"attention": kernel, "fused_rms_norm": fused},
    }


def _part(report: dict, name: str, run: Callable[[], object]) -> None:
    """Run one part into `report[name]`; a failure is recorded (with its traceback), not raised."""
    try:
        report[name] = run()
    except Exception as e:  # every part runs whatever the others did
        logger.error("gpu check part %s failed: %s", name, e)
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["failed"].append(name)


def _fmt(value, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _rows(report: dict, name: str) -> list:
    part = report.get(name)
    return part if isinstance(part, list) else []


def _training_lines(training: dict) -> list[str]:
    lines = [f"[training] GPU attention = {training.get('gpu_attention', '?')}"]
    for model, r in training.get("models", {}).items():
        last = max(r["losses_gpu_attention"])
        gpu, cpu = r["losses_gpu_attention"][last], r["losses_cpu_attention"][last]
        verdict = "OK" if r["ok"] else "FAIL"
        lines.append(
            f"  {model:9} loss at iteration {last}: GPU attention {gpu:.5f}, CPU attention "
            f"{cpu:.5f}; largest relative difference {r['max_relative_difference']:.2e} "
            f"{verdict} (< {LOSS_TOLERANCE:.0%})"
        )
    return lines


def _memory_lines(rows: list) -> list[str]:
    lines = ["[memory] model module chunk recompute: predicted / saved / allocated / peak MiB"]
    for r in rows:
        mib = " / ".join(
            _fmt(r[k] / 2**20, ".3f") for k in ("predicted", "saved", "allocated", "peak")
        )
        err = "n/a" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        lines.append(
            f"  {r['model']:9} {r['module']:6} {r['chunk']:6} {r['recompute']:9} {mib}"
            f"  (model vs saved {err})"
        )
    return lines


def _overhead_lines(over: dict) -> list[str]:
    if "overhead_per_instruction_ms" not in over:
        return []
    lines = [f"[executor] overhead per instruction {_fmt(over['overhead_per_instruction_ms'])} ms"]
    for p in over["iterations"]:
        lines.append(
            f"  iteration {p['iteration']}: {p['instructions']} compute instructions, host "
            f"{_fmt(1e3 * p['host_s'])} ms, device busy {_fmt(1e3 * p['device_busy_s'])} ms, "
            f"median gap {_fmt(p['median_gap_ms'])} ms"
        )
    return lines


def _profile_lines(rows: list) -> list[str]:
    return [
        f"[profile] {r['profile']} {r['module']} {r['instances']} x {r['tokens']} tokens: "
        f"forward {_fmt(r['forward_ms'])} ms (analytic, with TP comm: "
        f"{_fmt(r['analytic_forward_ms'])}), backward {_fmt(r['backward_ms'])} ms "
        f"({_fmt(r['analytic_backward_ms'])})"
        for r in rows
    ]


def _offload_lines(over: dict) -> list[str]:
    if "overlap" not in over:
        return []
    return [
        f"[offload] {over['offloaded_mb']} MiB out and back: copy out "
        f"{_fmt(over['d2h_gb_per_s'])} GB/s, round trip {_fmt(over['round_trip_gb_per_s'])} GB/s; "
        f"with {_fmt(1e3 * over['compute_s'])} ms of compute: together "
        f"{_fmt(1e3 * over['together_s'])} ms, overlap {_fmt(over['overlap'], '.0%')}"
    ]


def _pending_weight_lines(part: dict) -> list[str]:
    if "rows" not in part:
        return []
    how = "TE's weight-GEMM queue" if part["te_delayed_weight_gradients"] else "our split"
    lines = [f"[pending W] {part['model']} ({how}) module chunk: predicted / saved / allocated MiB"]
    for r in part["rows"]:
        mib = " / ".join(_fmt(r[k] / 2**20, ".3f") for k in ("predicted", "saved", "allocated"))
        err = "n/a" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        lines.append(f"  {r['module']:6} {r['chunk']:6} {mib}  (allocated vs model {err})")
    return lines


def _split_lines(split: dict) -> list[str]:
    if "ok" not in split:
        return []
    how = "TE delayed weight GEMMs" if split["te_delayed_weight_gradients"] else "autograd"
    return [
        f"[split backward] {split['model']} fp32, B/W split ({how}, "
        f"{split['weight_instructions']} weight halves) vs fused: largest "
        f"relative difference of losses and gradient norms "
        f"{split['max_relative_difference']:.2e} {'OK' if split['ok'] else 'FAIL'} "
        f"(< {SPLIT_TOLERANCE:.0e})"
    ]


def table(report: dict) -> str:
    """The one table printed at the end: every part, one line per row."""
    env = report.get("environment", {})
    lines = [f"gpu check on {env.get('device_name', '?')}: {env.get('software', {})}"]
    training = report.get("training", {})
    if "models" in training:
        lines += _training_lines(training)
    lines += _memory_lines(_rows(report, "memory"))
    lines += _overhead_lines(report.get("overhead", {}))
    lines += _offload_lines(report.get("offload", {}))
    lines += _split_lines(report.get("split_backward", {}))
    lines += _pending_weight_lines(report.get("pending_weight", {}))
    lines += _profile_lines(_rows(report, "profile"))
    for name in report["failed"]:
        part = report.get(name, {})
        why = part.get("error", "a check did not hold") if isinstance(part, dict) else "failed"
        lines.append(f"[FAILED] {name}: {why}")
    return "\n".join(lines)


def _single_rank_world(cuda: bool) -> None:
    """The one-rank process group the runs share (NCCL on a GPU, gloo else)."""
    if dist.is_initialized():
        return
    store = Path(tempfile.mkdtemp(prefix="megatron-dip-gpu-check-")) / "store"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )


def run_checks(
    *,
    out: Path,
    iterations: int,
    models,
    profiles: Path | None,
    flags=(),
    microbatches: int = 2,
    dtype: str = "bfloat16",
) -> dict:
    """Every part (module docstring); the report also written to `out/gpu_check.json`.
    `flags`: more training flags; `microbatches`: of the memory part; `dtype`: of training and
    memory (float32 makes the CPU test fast: bf16 matrix products are slow on most CPUs)."""
    cuda = torch.cuda.is_available()
    if not cuda:  # tiny tensors gain nothing from threads; spinning ones on shared cores cost
        torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    _single_rank_world(cuda)
    report: dict = {"failed": [], "cuda": cuda, "dtype": dtype}
    flags = [*flags, *(["--bf16"] if dtype == "bfloat16" else [])]
    _part(report, "environment", lambda: environment(cuda))
    _part(
        report,
        "training",
        lambda: training_check(models, iterations=iterations, cuda=cuda, work=work, flags=flags),
    )
    _part(
        report,
        "memory",
        lambda: memory_check(models, cuda=cuda, microbatches=microbatches, dtype=dtype),
    )
    _part(report, "overhead", lambda: overhead_check(work))
    _part(report, "offload", lambda: offload_check(cuda))
    _part(
        report,
        "split_backward",
        lambda: split_backward_check(
            models[0], iterations=iterations, cuda=cuda, work=work, flags=flags
        ),
    )
    _part(
        report,
        "pending_weight",
        lambda: pending_weight_check(models[0], cuda=cuda, microbatches=microbatches, dtype=dtype),
    )
    if profiles is not None:
        _part(report, "profile", lambda: profile_check(profiles))
    training = report.get("training", {})
    if isinstance(training, dict) and not all(m["ok"] for m in training.get("models", {}).values()):
        report["failed"].append("training")
    for name in ("split_backward", "pending_weight"):
        part = report.get(name, {})
        if isinstance(part, dict) and part.get("ok") is False:
            report["failed"].append(name)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def main(argv=None) -> int:
    """Command line (module docstring): 0 when every part ran and every check held."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="where gpu_check.json goes")
    p.add_argument("--iterations", type=int, default=5, help="training iterations per run (>= 2)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated run presets")
    p.add_argument("--profiles", type=Path, default=None, help="profile_gpu.sh's output folder")
    p.add_argument(
        "--train-args", default="", help="more training flags for every run, e.g. a smaller batch"
    )
    p.add_argument("--memory-microbatches", type=int, default=2, help="of the memory part")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(_BYTES), help="of every part")
    args = p.parse_args(argv)
    if args.iterations < 2:
        p.error("--iterations: at least 2 (the first iteration warms up)")
    models = tuple(m for m in args.models.split(",") if m)
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"--models: {unknown} are not among {list(MODELS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("megatron", "megatron_dip.training"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    report = run_checks(
        out=args.out,
        iterations=args.iterations,
        models=models,
        profiles=args.profiles,
        flags=shlex.split(args.train_args),
        microbatches=args.memory_microbatches,
        dtype=args.dtype,
    )
    print(table(report), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
