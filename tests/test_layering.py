"""Which sub-packages of megatron_dip may import which, read from the source (no import runs).

Data flows data -> planner -> schedule -> runtime; the runtime never plans, and knows nothing of
the training or of how compute is emulated; emulation plugs into the runtime and knows nothing of
the training; the benchmark sits above both, and nothing of ours imports it. The modalities sit
below the data side, the batching layer, the planner and the runtime, above only the plan format,
the model shapes and the torch building blocks (`models`), which know no modality. No two parts
of the package (sub-packages and top-level modules) import each other in a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_dip"
BELOW_EVERY_LAYER = {
    *("data", "batching", "planner", "schedule", "runtime", "models", "modalities"),
    *("training", "emulation", "benchmark", "hf", "modelspec"),
}


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
        ("planner", {"runtime", "models", "training", "emulation", "benchmark"}),
        ("models", {"modalities", "batching", "planner", "data", "runtime", "training"}),
        ("modalities", {"data", "batching", "planner", "runtime", "training", "emulation"}),
        ("batching", {"planner", "runtime", "models", "training", "emulation"}),
        ("data", {"batching", "planner", "runtime", "models", "training", "emulation"}),
        # The parallel shape and groups sit below every layer that takes them.
        ("parallel", BELOW_EVERY_LAYER),
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


def _part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _part_graph() -> dict[str, set[str]]:
    """Imports between the parts of megatron_dip: sub-packages and top-level modules."""
    parts = {_part_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {p: set() for p in parts}
    for path in PACKAGE.rglob("*.py"):
        me = _part_of(path)
        if me == "__init__":
            continue
        here = ["megatron_dip", *path.relative_to(PACKAGE).with_suffix("").parts]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = here[: len(here) - node.level]
                targets = [".".join([*base, node.module] if node.module else base)]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            for t in targets:
                bits = t.split(".")
                if bits[0] == "megatron_dip" and len(bits) > 1 and bits[1] in parts:
                    graph[me].add(bits[1])
        graph[me].discard(me)
    return graph


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    path, seen = [start], set()

    def walk(node: str) -> list[str] | None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                path.append(nxt)
                found = walk(nxt)
                if found:
                    return found
                path.pop()
        return None

    return walk(start)


def test_no_part_of_the_package_imports_another_in_a_cycle() -> None:
    graph = _part_graph()
    assert {"modalities", "batching", "models", "planner", "runtime"} <= set(graph)
    cycles = [c for p in sorted(graph) if (c := _cycle_through(graph, p))]
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_through(graph, "d") is None


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def _imported_modules(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """The modules of ours that the file `path` imports anywhere in it: at the top, inside
    functions and under TYPE_CHECKING (`from pkg import module` names the module)."""
    here = _module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            head = ".".join([*base, node.module] if node.module else base)
            for a in node.names:
                full = f"{head}.{a.name}"
                found.add(full if full in modules else head)
    return found & modules


def _file_graph(part: Path, root: Path = PACKAGE) -> dict[str, set[str]]:
    """Imports between the files of one part of the package (its sub-packages included); a
    package's __init__ is its table of contents and takes no part."""
    files = [p for p in part.rglob("*.py") if p.name != "__init__.py"]
    names = {p: _module_name(p, root) for p in files}
    modules = set(names.values())
    return {names[p]: _imported_modules(p, modules, root) - {names[p]} for p in files}


@pytest.mark.parametrize(
    "part", sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
)
def test_no_two_files_of_a_package_import_each_other_in_a_cycle(part: str) -> None:
    graph = _file_graph(PACKAGE / part)
    cycles = [c for m in sorted(graph) if (c := _cycle_through(graph, m))]
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_the_file_cycle_check_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "megatron_dip" / "part"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_dip.part import a\n"
    )
    root = tmp_path / "megatron_dip"
    modules = {"megatron_dip.part.a", "megatron_dip.part.b"}
    assert _imported_modules(pkg / "a.py", modules, root) == {"megatron_dip.part.b"}
    assert _imported_modules(pkg / "b.py", modules, root) == {"megatron_dip.part.a"}
    graph = _file_graph(pkg, root)
    assert _cycle_through(graph, "megatron_dip.part.a") == [
        "megatron_dip.part.a",
        "megatron_dip.part.b",
        "megatron_dip.part.a",
    ]
