"""A resumed DIP run keeps its checkpoint's layout (`training/config/resumed_layout.py`): which
checkpoints' layouts are kept, what is searched again and why, and which flags win. In-process
on checkpoint headers as `checkpoint.state.save` writes them (the run that saves and resumes one:
test_checkpoint_training.py)."""

from __future__ import annotations

import logging

import pytest

from megatron_dip.training.config.arguments import ConfigError, parse_config
from megatron_dip.training.config.resumed_layout import (
    HEADER_KEY,
    KeptLayout,
    kept_layout,
    recorded_layout,
    size_run,
)
from megatron_dip.training.config.validate import apply_preset

FLAGS = ["--model", "vlm-s", "--lr", "1e-4", "--train-iters", "10"]
SOURCE = "ckpt/iter_0000010"


def _config(*extra: str):
    config, _ = apply_preset(parse_config([*FLAGS, *extra]))
    return config


def _header(*extra: str, data_parallel: int = 1, layout=None) -> dict:
    """A DIP run's checkpoint header, its flags those of `FLAGS + extra` (resolved)."""
    recorded = recorded_layout("static:cost-split-v1-cut-20/20/20/35", {"vit": 4})
    return {
        "flags": _config(*extra).flat(),
        "layout": {"data_parallel": data_parallel},
        HEADER_KEY: recorded if layout is None else layout,
    }


def _kept(config, header, caplog, dp: int = 1):
    with caplog.at_level(logging.INFO, logger="megatron_dip.training.config.resumed_layout"):
        return kept_layout(config, header, source=SOURCE, data_parallel=dp)


def test_the_recorded_layout_is_the_flags_that_rebuild_it():
    assert recorded_layout("vit=2,llm=2", {"vit": 4, "audio": 2}) == {
        "segments": "vit=2,llm=2",
        "sub_sizes": "vit=4,audio=2",
    }
    assert recorded_layout("text=1,dit=4", {}) == {"segments": "text=1,dit=4", "sub_sizes": None}


def test_a_resumed_run_keeps_the_layout_whatever_its_schedule_or_paths(caplog):
    """Training length, LR, checkpoint paths and the planner process's settings may change."""
    changed = ["--lr", "3e-5", "--train-iters", "99", "--save", "b", "--dip-lookahead", "4"]
    changed += ["--dip-search-time-ms", "0", "--dip-comm-timeout-s", "60"]
    kept = _kept(_config(*changed), _header(), caplog)
    assert kept == KeptLayout("static:cost-split-v1-cut-20/20/20/35", "vit=4", SOURCE)
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--seq-length", "2048"], "--seq-length"),
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
        (["--dip-data", "synthetic-text-only"], "--dip-data"),
        (["--dip-memory-limit-gb", "40"], "--dip-memory-limit-gb"),
        (["--num-layers", "30"], "--num-layers"),
    ],
)
def test_a_flag_the_sizing_reads_searches_again_and_is_named(caplog, extra, named):
    assert _kept(_config(*extra), _header(), caplog) is None
    assert f"not kept from {SOURCE}, whose run differs in {named}" in caplog.text


def test_another_data_parallel_size_searches_again(caplog):
    assert _kept(_config(), _header(data_parallel=2), caplog) is None
    assert "differs in data-parallel size" in caplog.text


def test_nothing_is_kept_from_stock_runs_old_checkpoints_or_for_stock_schedules(caplog):
    assert _kept(_config(), _header(layout={}), caplog) is None  # stock: nothing recorded
    old = _header()
    del old[HEADER_KEY]
    assert _kept(_config(), old, caplog) is None
    assert _kept(_config(), None, caplog) is None  # no readable header
    stock = _config("--dip-schedule", "1f1b")
    assert _kept(stock, _header("--dip-schedule", "1f1b"), caplog) is None


class _Build:
    """`build` that records the layout flags it was called with; refuses `refused` segments."""

    def __init__(self, refused: str | None = None):
        self.calls: list[tuple] = []
        self.refused = refused

    def __call__(self, config):
        d = config.dip
        self.calls.append((d.dip_segments, d.dip_sub_microbatch_size))
        if self.refused is not None and d.dip_segments == self.refused:
            raise ConfigError(f"--dip-segments: {d.dip_segments} does not fit")
        return self.calls[-1]


KEPT = KeptLayout("vit=2,llm=2", "vit=6", SOURCE)


def test_the_kept_layout_replaces_only_what_the_user_did_not_give(caplog):
    config = _config()
    build = _Build()
    with caplog.at_level(logging.INFO, logger="megatron_dip.training.config.resumed_layout"):
        got = size_run(config, build, KEPT, segments_given=False, sizes_given=False)
    assert got == ("vit=2,llm=2", "vit=6") and len(build.calls) == 1
    assert "kept from ckpt/iter_0000010 without searching: --dip-segments vit=2,llm=2 " in (
        caplog.text
    )
    assert "--dip-sub-microbatch-size vit=6" in caplog.text
    given = config.replace(dip_sub_microbatch_size="vit=3")
    assert size_run(given, _Build(), KEPT, segments_given=False, sizes_given=True) == (
        "vit=2,llm=2",
        "vit=3",
    )
    auto = config.replace(dip_segments="auto")  # --dip-segments auto: search again
    assert size_run(auto, _Build(), KEPT, segments_given=True, sizes_given=False) == ("auto", None)
    assert size_run(config, _Build(), None, segments_given=False, sizes_given=False) == (None, None)


def test_a_kept_layout_that_no_longer_builds_is_searched_with_a_warning(caplog):
    build = _Build(refused="vit=2,llm=2")
    with caplog.at_level(logging.WARNING, logger="megatron_dip.training.config.resumed_layout"):
        got = size_run(_config(), build, KEPT, segments_given=False, sizes_given=False)
    assert got == (None, None) and len(build.calls) == 2
    assert "the placement recorded in ckpt/iter_0000010 no longer builds" in caplog.text
    assert "vit=2,llm=2 does not fit" in caplog.text
