"""Which sub-packages of megatron_dip may import which, read from the source (no import runs).

Data flows data -> planner -> schedule -> runtime; the runtime never plans, and knows nothing of
the training or of how compute is emulated; emulation plugs into the runtime and knows nothing of
the training; the benchmark sits above both, and nothing of ours imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_dip"


def _imported(package: str) -> dict[str, set[str]]:
    """Sub-packages of megatron_dip imported by each file of `package` (lazy imports too)."""
    out: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom) and node.level > 1:  # from ..x import
                names = [f"megatron_dip.{node.module or ''}"]
            else:
                continue
            found |= {n.split(".")[1] for n in names if n.startswith("megatron_dip.")}
        out[str(path.relative_to(PACKAGE))] = found - {package}
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("runtime", {"planner", "training", "emulation", "benchmark"}),
        ("emulation", {"training", "benchmark"}),
        ("schedule", {"data", "planner", "runtime", "models", "training", "emulation"}),
    ],
)
def test_package_does_not_import(package: str, forbidden: set[str]) -> None:
    bad = {f: sorted(found & forbidden) for f, found in _imported(package).items()}
    assert not {f: b for f, b in bad.items() if b}


def test_nothing_of_ours_imports_the_benchmark() -> None:
    users = [
        f
        for p in PACKAGE.iterdir()
        if p.is_dir() and p.name not in ("benchmark", "__pycache__")
        for f, found in _imported(p.name).items()
        if "benchmark" in found
    ]
    assert users == []
    assert (PACKAGE / "benchmark" / "bench.py").exists()
