"""The GPU check's one printed table: a few lines per part, from the JSON report."""

from __future__ import annotations

import math

from .checks import LOSS_TOLERANCE, SPLIT_TOLERANCE


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


def _mib_and_error(row: dict, keys: tuple[str, ...]) -> tuple[str, str]:
    """A memory row's byte counts in MiB ("a / b / ..."), and its relative error in %."""
    mib = " / ".join(_fmt(row[k] / 2**20, ".3f") for k in keys)
    return mib, "n/a" if row["error"] is None else f"{100 * row['error']:+.1f}%"


def _memory_lines(rows: list) -> list[str]:
    lines = ["[memory] model module chunk recompute: predicted / saved / allocated / peak MiB"]
    for r in rows:
        mib, err = _mib_and_error(r, ("predicted", "saved", "allocated", "peak"))
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
        mib, err = _mib_and_error(r, ("predicted", "saved", "allocated"))
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
