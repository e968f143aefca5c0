"""tools/draw_timeline.py draws readable PNGs of simulated baselines."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parent.parent / "tools" / "draw_timeline.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("draw_timeline", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["draw_timeline"] = module
    spec.loader.exec_module(module)
    return module


def test_cli_writes_png_of_both_schedules(tool, tmp_path, capsys) -> None:
    out = tmp_path / "timeline.png"
    args = ["--schedule", "both", "--ranks", "4", "--microbatches", "8", "--chunks", "2"]
    assert tool.main([*args, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "1F1B P=4 M=8: iteration 66.000 ms, bubbles 27.3%" in printed  # (P-1)/(M+P-1)
    assert "interleaved 1F1B P=4 V=2 M=8" in printed


def test_library_function_and_bad_arguments(tool, tmp_path) -> None:
    results = tool.baseline_results(
        schedule="1f1b", ranks=2, microbatches=3, chunks=1, forward_ms=2.0
    )
    assert [title for title, _, _ in results] == ["1F1B P=2 M=3"]
    path = tool.draw_timeline(results, tmp_path / "one.png")
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="nothing to draw"):
        tool.draw_timeline([], tmp_path / "none.png")
    with pytest.raises(SystemExit):  # megatron-core rejects M=5 interleaved over 4 ranks
        tool.main(
            [
                "--schedule",
                "interleaved",
                "--ranks",
                "4",
                "--microbatches",
                "5",
                "--out",
                str(tmp_path / "x.png"),
            ]
        )
