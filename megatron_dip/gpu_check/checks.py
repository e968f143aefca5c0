"""The parts of the GPU check (the package docstring numbers them): each runs on one rank and
returns a JSON-able record of what it measured and whether it held."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dip import megatron_compat
from megatron_dip.models import attention as packed_attention
from megatron_dip.models.kernels import resolve_kernels

MODELS = ("tiny-vlm", "tiny-t2v")
LOSS_TOLERANCE = 0.02
SPLIT_TOLERANCE = 1e-4
# What a pending W holds on the device against `CostModel.weight_bytes` (middle chunks): the
# CPU test holds our own split's within 7%; on a GPU Transformer Engine's queue is priced too.
PENDING_W_TOLERANCE = 0.15
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


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
        cost = CostModel(model, H100, dtype_bytes=DTYPE_BYTES[dtype], kernels=kernels)
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
        cost_model=CostModel(model, H100, dtype_bytes=DTYPE_BYTES[dtype], kernels=kernels),
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
