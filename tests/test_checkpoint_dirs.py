"""What a run checks of --load, --save and --train-iters before any process group exists
(`training/checkpoint/dirs.py`, through `validate.resolve`), in-process on directories laid out
as saves leave them. Every refusal is one line starting with the flag, naming the file and the
flag that picks something else, and touches nothing on disk."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_dip.training.checkpoint.dirs import (
    MANIFEST,
    TRACKER,
    CheckpointError,
    find_resume,
    iteration_dir,
)
from megatron_dip.training.config.arguments import parse_config
from megatron_dip.training.config.validate import ConfigError, resolve

BASE = ["--model", "tiny-vlm", "--lr", "1e-3"]


def _resolve(*flags: str):
    return resolve(parse_config([*BASE, *flags]), world_size=1, cuda=False)


def _saved(root: Path, *iterations: int, tracker: int | None = None) -> Path:
    """Complete checkpoint directories (a manifest each) as a save leaves them."""
    for it in iterations:
        path = iteration_dir(root, it)
        path.mkdir(parents=True)
        (path / MANIFEST).write_text('{"sha256": {}}')
    if tracker is not None:
        (root / TRACKER).write_text(str(tracker))
    return root


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_tracker_picks_the_checkpoint_and_interrupted_saves_are_ignored(tmp_path):
    assert find_resume(tmp_path / "nothing", None) is None
    _saved(tmp_path, 3, tracker=3)
    iteration_dir(tmp_path, 6).with_name("iter_0000006.tmp").mkdir()  # a crash while saving 6
    resume = find_resume(tmp_path, None)
    assert resume.path == iteration_dir(tmp_path, 3) and resume.iteration == 3
    with pytest.raises(CheckpointError, match=r"--ckpt-step 6, but .*iter_0000006 does not exist"):
        find_resume(tmp_path, 6)


def test_complete_checkpoints_without_a_tracker_refuse_to_start(tmp_path):
    """Training from scratch would overwrite iter_0000005 and iter_0000010 and mix two runs."""
    root = _saved(tmp_path / "ckpt", 5, 10)
    before = _listing(root)
    with pytest.raises(ConfigError) as info:
        _resolve("--train-iters", "20", "--load", str(root), "--save", str(root))
    text = str(info.value)
    assert text.startswith(f"--load {root}: no {TRACKER} but complete checkpoints")
    assert "iter_0000010: pass --ckpt-step 10" in text and "\n" not in text
    assert _listing(root) == before
    assert _resolve("--train-iters", "20", "--load", str(root), "--ckpt-step", "10").resume


@pytest.mark.parametrize("content", ["garbage", "", "12"])
def test_an_unreadable_or_wrong_tracker_names_the_file(tmp_path, content):
    root = _saved(tmp_path, 5, 10)
    (root / TRACKER).write_text(content)
    with pytest.raises(ConfigError, match=rf"^--load {root}: .*pass --ckpt-step 10") as info:
        _resolve("--train-iters", "20", "--load", str(root))
    if content != "12":
        assert f"{root / TRACKER} holds {content!r}, not an iteration number" in str(info.value)
    else:
        assert "names iteration 12, but" in str(info.value)


def test_load_of_one_checkpoint_directory_names_the_flags_to_use(tmp_path):
    _saved(tmp_path, 7, tracker=7)
    with pytest.raises(ConfigError, match=rf"pass --load {tmp_path} --ckpt-step 7$"):
        _resolve("--train-iters", "9", "--load", str(iteration_dir(tmp_path, 7)))


def test_an_old_format_checkpoint_says_what_it_is(tmp_path):
    old = iteration_dir(tmp_path, 4)
    old.mkdir()
    meta = {"format": "megatron-dip-checkpoint/2", "iteration": 4, "index": {}}
    (old / "metadata.json").write_text(json.dumps(meta))
    (old / "model_rank_00000.pt").write_bytes(b"")
    (tmp_path / TRACKER).write_text("4")
    for flags in (["--load", str(tmp_path)], ["--save", str(tmp_path)]):
        with pytest.raises(
            ConfigError,
            match=r"'megatron-dip-checkpoint/2' checkpoint .*"
            r"before it used Megatron-Core's dist_checkpointing",
        ):
            _resolve("--train-iters", "8", *flags)


def test_save_below_a_regular_file_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match=r"^--save .*/file/ckpt: .*/file is a file, not a dir"):
        _resolve("--train-iters", "2", "--save", str(tmp_path / "file" / "ckpt"))
    assert not dist.is_initialized()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc (Linux)")
def test_an_unwritable_save_is_refused_before_training():
    with pytest.raises(ConfigError, match=r"^--save /proc/megatron-dip/ckpt: not writable"):
        _resolve("--train-iters", "2", "--save", "/proc/megatron-dip/ckpt")


def test_save_into_another_runs_checkpoints_is_refused_unless_loaded(tmp_path):
    root = _saved(tmp_path / "ckpt", 5, tracker=5)
    with pytest.raises(
        ConfigError,
        match=r"^--save .*already holds checkpoints \(iterations 5\)"
        r" that this run does not --load",
    ):
        _resolve("--train-iters", "8", "--save", str(root))
    spec = _resolve("--train-iters", "8", "--save", str(root), "--load", str(root))
    assert spec.resume.iteration == 5


def test_train_iters_below_the_loaded_iteration(tmp_path, caplog):
    """Past it: refused; equal: one line, nothing trained, no process group, nothing saved."""
    from megatron_dip.training.iteration.loop import pretrain

    root = _saved(tmp_path, 3, tracker=3)
    with pytest.raises(
        ConfigError,
        match=r"^--train-iters 2: the checkpoint to load .* is at "
        r"iteration 3, past it",
    ):
        _resolve("--train-iters", "2", "--load", str(root))
    spec = _resolve("--train-iters", "3", "--load", str(root), "--save", str(root))
    before = _listing(root)
    with caplog.at_level(logging.INFO, logger="megatron_dip.training"):
        result = pretrain(spec)
    assert result.first_iteration == result.last_iteration == 3 and not result.losses
    assert "--train-iters 3: the checkpoint" in caplog.text and "nothing to train" in caplog.text
    assert not dist.is_initialized() and _listing(root) == before


def test_checkpoint_flags_are_checked_before_the_start_up_sizing(tmp_path, monkeypatch):
    """A bad --load costs no placement search, and --save is made only once every check,
    the sizing's included, has passed."""
    from megatron_dip.training.config import layout

    root = _saved(tmp_path / "ckpt", 5)
    sized = []
    real = layout.build_layout
    monkeypatch.setattr(layout, "build_layout", lambda *a, **k: sized.append(1) or real(*a, **k))
    with pytest.raises(ConfigError, match=r"^--load .*no latest_checkpointed_iteration.txt"):
        _resolve("--train-iters", "20", "--load", str(root))
    assert not sized
    save = tmp_path / "new" / "run"
    with pytest.raises(ConfigError, match=r"^--seq-length"):  # refused by the sizing
        _resolve("--train-iters", "20", "--save", str(save), "--seq-length", "2")
    assert sized and not save.parent.exists()
    _resolve("--train-iters", "20", "--save", str(save))
    assert save.is_dir()
