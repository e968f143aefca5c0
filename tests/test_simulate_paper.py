"""tools/simulate_paper.py: the study's command line."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from megatron_dip.planner.search import mcts_order, unit_constraints

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location(
        "simulate_paper", ROOT / "tools/simulate_paper.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_study_searches_its_rollouts_whatever_the_wall_time():
    """A row depends on its seed, not on the machine's load: by default every search runs its
    `--search-rollouts` to the end; `--search-time-ms` caps it only where asked."""
    tool = _tool()
    search = tool.search_config(tool.parse_args(["--setups", "vlm-s", "--search-rollouts", "9"]))
    assert math.isinf(search.time_budget_s) and search.max_rollouts == 9
    constraints = unit_constraints({"vit": [0, 1, 2], "llm": [0, 1, 2]}, {"vit": "llm"})
    found = mcts_order(
        constraints, lambda order: 1.0 + sum(i * mb for i, (_, mb) in enumerate(order)), search
    )
    assert found.rollouts == 9
    capped = tool.parse_args(["--setups", "vlm-s", "--search-time-ms", "250"])
    assert tool.search_config(capped).time_budget_s == 0.25


def test_startup_workers_default_to_every_usable_core_and_refuse_a_negative_count(capsys):
    """`--startup-workers` reads as training's `--dip-startup-workers`: 0 (the default) is one
    process per usable core; a negative count is refused by name."""
    tool = _tool()
    assert tool.parse_args(["--setups", "vlm-s"]).startup_workers == 0
    with pytest.raises(SystemExit):
        tool.parse_args(["--setups", "vlm-s", "--startup-workers", "-1"])
    assert "--startup-workers must be >= 0" in capsys.readouterr().err
