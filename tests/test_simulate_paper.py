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


def test_what_ifs_change_the_modelled_machine_and_mark_the_table(capsys):
    """`--memory-scale` multiplies every activation limit (DIP's and the stock grid's: one
    `Comparison.memory`), `--gemm-half-rows 0` runs every GEMM at the device's cap, whatever
    its rows; the table's title says it is a what-if. Bad values are refused by name."""
    from megatron_dip.planner.paper import paper_comparison
    from megatron_dip.planner.search import SearchConfig

    tool = _tool()
    args = tool.parse_args(["--setups", "vlm-s", "--memory-scale", "2", "--gemm-half-rows", "0"])
    assert tool.what_if_label(args) == "  WHAT-IF: activation limits x 2, GEMM knee 0 rows"
    assert tool.what_if_label(tool.parse_args(["--setups", "vlm-s"])) == ""
    for flag, value, message in [
        ("--memory-scale", "0", "--memory-scale must be > 0"),
        ("--gemm-half-rows", "-1", "--gemm-half-rows must be >= 0"),
    ]:
        with pytest.raises(SystemExit):
            tool.parse_args(["--setups", "vlm-s", flag, value])
        assert message in capsys.readouterr().err

    common = dict(
        device="H800",
        seed=0,
        calibration_batches=1,
        search=SearchConfig(max_rollouts=1),
        placement="static cost-split v1",
    )
    real, _ = paper_comparison("vlm-s", "mixed", **common)
    what_if, _ = paper_comparison("vlm-s", "mixed", memory_scale=2.0, gemm_half_rows=0, **common)
    placement = real.dip_placement
    assert what_if.memory(placement) == pytest.approx([2 * m for m in real.memory(placement)])

    def efficiency(cmp, images: int) -> float:
        return cmp.cost_model.efficiency("vit", instances=images, tokens_per_instance=1024)

    def one_image_share(cmp) -> float:  # a one-image sub-microbatch's efficiency, of 16's
        return efficiency(cmp, 1) / efficiency(cmp, 16)

    # What is left is memory-bound work (weights read once per sub-microbatch).
    assert one_image_share(real) < 0.7 and one_image_share(what_if) > 0.78
