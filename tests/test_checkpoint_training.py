"""What a training run keeps, in one process (a one-rank gloo world): `loop.py`'s checkpoint
publishing, `resume_checks.py`, `save_lock.py` and the save faults of `checkpoint/storage.py` (the
4-process versions: test_training_dist.py).

* A non-finite streak: the tracker only ever names a checkpoint whose weights have since trained
  with a finite loss; the ones that never did stay unpublished (`iter_N.unverified`, ignored by
  loading) and the stop line names them and the last verified checkpoint, from which a resume
  with a lower --lr trains with finite losses. The save after the last iteration is verified by
  a forward pass over the next batch.
* Resuming with another LR schedule (--lr, --train-iters that sets the decay, ...) is refused
  before any work unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler
  says which wins; another --seed or data flag is refused naming it; a --load that does not
  exist is refused unless it is --save (Megatron's auto-resume idiom, "starting from scratch").
* An unreadable manifest names the --ckpt-step to use instead.
* A --save another job holds is refused naming the holder; a dead holder's lock is taken over.
* A failed save is one line naming the cause and the file; the partial `.tmp` is removed; a
  save that cannot fit in the free space is refused naming both sizes.
"""

from __future__ import annotations

import errno
import logging
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_dip.training.checkpoint.dirs import TRACKER, CheckpointError
from megatron_dip.training.config.arguments import parse_config
from megatron_dip.training.config.validate import ConfigError, resolve

ROOT = Path(__file__).resolve().parent.parent
BASE = [
    "--model", "tiny-vlm", "--lr", "1e-3", "--seed", "7", "--global-batch-size", "2",
    "--dip-lookahead", "0", "--log-interval", "1",
]  # fmt: skip


def _spec(*flags: str):
    return resolve(parse_config([*BASE, *flags]), world_size=1, cuda=False)


def _train(*flags: str):
    from megatron_dip.training.iteration.loop import pretrain

    return pretrain(_spec(*flags))


@pytest.fixture(scope="module")
def trained(single_rank_world, tmp_path_factory) -> tuple[Path, str]:
    """Two iterations saved into `DIR` with --load DIR --save DIR (the auto-resume idiom's first
    run); the checkpoint of iteration 2, verified by a forward pass over the next batch; and
    what the run logged."""
    import torch

    # torch may be imported first right here, after conftest's per-test thread setting: intra-op
    # threads on the shared cores made this run 30x slower.
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("megatron_dip.training")
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    try:
        _train("--train-iters", "2", "--save", str(root), "--load", str(root))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return root, "\n".join(records)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def test_the_first_run_of_the_auto_resume_idiom_starts_from_scratch(trained):
    root, log = trained
    assert f"--load {root}: no checkpoint there yet: starting from scratch" in log


def test_the_last_save_is_verified_by_a_forward_pass(trained):
    root, log = trained
    assert _names(root) == ["iter_0000002", TRACKER]
    assert (root / TRACKER).read_text() == "2"
    assert re.search(
        r"checkpoint of iteration 2: the next batch's loss with its weights is "
        r"\d+\.\d+ \(forward only, to verify it\)",
        log,
    ), log


def test_a_non_finite_streak_publishes_only_verified_checkpoints(trained, tmp_path):
    """--lr 1e30 from iteration 2's checkpoint: iteration 3 (computed with its weights) is
    finite, its update poisons the weights; the checkpoints of 3, 4 and 5 never train with a
    finite loss and stay unpublished; resuming from 2 as the line says trains finitely."""
    import shutil

    from megatron_dip.training.iteration.nonfinite import NonFiniteError

    root = tmp_path / "ckpt"
    shutil.copytree(trained[0], root)
    flags = ["--load", str(root), "--save", str(root), "--override-opt_param-scheduler"]
    with pytest.raises(NonFiniteError) as info:
        _train(*flags, "--lr", "1e30", "--train-iters", "8", "--save-interval", "1")
    line = str(info.value)
    assert line.startswith("iterations 4-6: loss ") and "\n" not in line, line
    assert (
        f"The last verified checkpoint is {root / 'iter_0000002'} (iteration 2, its weights "
        f"trained with a finite loss): resume with --load {root} --ckpt-step 2" in line
    ), line
    unpublished = [f"iter_{i:07d}.unverified" for i in (3, 4, 5)]
    assert line.endswith(": " + ", ".join(unpublished)), line
    assert (root / TRACKER).read_text() == "2"
    assert _names(root) == ["iter_0000002", *unpublished, TRACKER]
    resumed = _train(*flags, "--ckpt-step", "2", "--train-iters", "4")
    assert sorted(resumed.losses) == [3, 4]
    assert all(math.isfinite(v) for v in resumed.losses.values()), resumed.losses
    assert (root / TRACKER).read_text() == "4"  # the rerun's own save of 4 replaced the NaN one
    assert _names(root) == [
        "iter_0000002",
        "iter_0000003.unverified",
        "iter_0000004",
        "iter_0000005.unverified",
        TRACKER,
    ]


def test_a_run_without_any_verified_checkpoint_says_so(single_rank_world, tmp_path):
    from megatron_dip.training.iteration.nonfinite import NonFiniteError

    with pytest.raises(
        NonFiniteError,
        match=r"No checkpoint of this run trained with a finite "
        r"loss: start again, e\.g\. with a lower --lr.*: iter_0000001\.unverified$",
    ):
        _train("--lr", "1e30", "--train-iters", "3", "--save", str(tmp_path), "--save-interval",
               "1", "--dip-max-nonfinite-iters", "1")  # fmt: skip
    assert not (tmp_path / TRACKER).exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--train-iters", "8"], r"^--train-iters: 8 here, 2 in the LR schedule of the checkpoint"),
        (
            ["--train-iters", "4", "--lr", "1e-4"],
            r"^--lr: 0\.0001 here, 0\.001 in the LR schedule"
            r".*\(also --train-iters\)",
        ),
        (["--train-iters", "2", "--lr-decay-style", "cosine"], r"^--lr-decay-style: cosine here,"),
        (["--train-iters", "2", "--lr-warmup-iters", "1"], r"^--lr-warmup-iters: 1 here, 0 in"),
    ],
)
def test_another_lr_schedule_on_resume_names_the_flag_and_both_options(trained, flags, words):
    trained = trained[0]
    with pytest.raises(ConfigError, match=words) as info:
        _spec("--load", str(trained), *flags)
    assert "--override-opt_param-scheduler" in str(info.value)
    assert "--use-checkpoint-opt_param-scheduler" in str(info.value)
    for which in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        assert _spec("--load", str(trained), *flags, which).resume.iteration == 2
    _spec("--load", str(trained), *flags, "--no-load-optim")  # a fresh schedule: no question


def test_extending_a_run_follows_the_option_that_wins(trained, tmp_path):
    """Decay over 2 iterations: the checkpoint's schedule has LR 0 from iteration 3 on (the
    weights stop moving); --override-opt_param-scheduler decays over the 3 of --train-iters.
    The evaluation after iteration 3 shows whether its update moved the weights."""
    import shutil

    out = {}
    for which in ("--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"):
        root = tmp_path / which
        shutil.copytree(trained[0], root)
        flags = ["--train-iters", "3", "--eval-interval", "1", "--eval-iters", "1"]
        out[which] = _train("--load", str(root), *flags, which)
    kept, extended = out.values()
    assert kept.losses[3] == pytest.approx(extended.losses[3], rel=1e-6)  # the same weights
    assert kept.eval_losses[3] != pytest.approx(extended.eval_losses[3], rel=1e-5)


def test_another_seed_or_data_on_resume_is_named_before_loading(trained, tmp_path):
    trained = trained[0]
    with pytest.raises(
        ConfigError,
        match=r"^--seed: 8 here, 7 in the checkpoint .*iter_0000002"
        r": the data order it saved would not continue; pass --seed 7",
    ):
        _spec("--load", str(trained), "--train-iters", "2", "--seed", "8")
    with pytest.raises(ConfigError, match=r"^--global-batch-size: 4 here, 2 in the checkpoint"):
        _spec("--load", str(trained), "--train-iters", "2", "--global-batch-size", "4")


def test_a_resumed_run_keeps_the_layout_its_checkpoint_recorded(trained, caplog):
    """The checkpoint records the run's layout as flags; resuming takes them without sizing
    again (`resumed_layout`), unless the user gives the layout."""
    from megatron_dip.training.checkpoint import storage
    from megatron_dip.training.config.resumed_layout import HEADER_KEY

    root = trained[0]
    header = storage.load_common(root / "iter_0000002")["megatron_dip"]
    assert header[HEADER_KEY] == {"segments": "vit=1,llm=2", "sub_sizes": "vit=2"}
    with caplog.at_level(logging.INFO, logger="megatron_dip.training.config"):
        spec = _spec("--load", str(root), "--train-iters", "2")
    assert f"kept from {root / 'iter_0000002'} without searching: --dip-segments vit=1,llm=2" in (
        caplog.text
    )
    assert spec.segments == {"vit": 1, "llm": 2} and spec.sub_sizes == {"vit": 2}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_dip.training.config"):
        given = _spec("--load", str(root), "--train-iters", "2", "--dip-segments", "vit=1,llm=1")
    assert "kept from" not in caplog.text and given.segments == {"vit": 1, "llm": 1}


def test_a_load_that_does_not_exist_is_refused_unless_it_is_save(tmp_path):
    missing = tmp_path / "typo"
    with pytest.raises(
        ConfigError,
        match=rf"^--load {missing}: does not exist \(and there is no "
        r"--save\): check the path",
    ):
        _spec("--load", str(missing), "--train-iters", "1")
    with pytest.raises(ConfigError, match=rf"^--load {missing}: does not exist and is not --save"):
        _spec("--load", str(missing), "--save", str(tmp_path / "other"), "--train-iters", "1")
    assert (
        _spec("--load", str(missing), "--save", str(missing), "--train-iters", "1").resume is None
    )


def test_an_unreadable_manifest_names_the_ckpt_step_to_use(trained, tmp_path):
    """What `checkpoint.load` checks first, on every rank."""
    trained = trained[0]
    import shutil

    from megatron_dip.training.checkpoint.checksums import verify
    from megatron_dip.training.checkpoint.dirs import load_hint

    root = tmp_path / "two"
    shutil.copytree(trained / "iter_0000002", root / "iter_0000001")
    shutil.copytree(trained / "iter_0000002", root / "iter_0000002")
    (root / TRACKER).write_text("2")
    bad = root / "iter_0000002"
    (bad / "checksums.json").write_text("{not json")
    assert _spec("--load", str(root), "--train-iters", "3").resume.iteration == 2  # the load's
    with pytest.raises(
        CheckpointError,
        match=r"checksums.json: unreadable checksum manifest .*"
        rf"\(--load {root}: pick another checkpoint, e\.g\. --ckpt-step 1\)$",
    ):
        verify(bad, hint=load_hint(bad))


# -- the lock on --save ----------------------------------------------------------------------

_HOLDER = """
import sys, time
from megatron_dip.training.checkpoint.save_lock import SaveLock, this_process
SaveLock(sys.argv[1]).acquire(this_process("job-42"))
print("held", flush=True)
time.sleep(600)
"""


def _holder(root: Path) -> subprocess.Popen:
    """Another job's rank 0 holding the lock of `root`."""
    root.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLDER), str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_on_one_save_is_refused_naming_the_holder(single_rank_world, tmp_path):
    from megatron_dip.training.checkpoint.save_lock import SaveLockedError

    holder = _holder(tmp_path)
    try:
        with pytest.raises(
            SaveLockedError,
            match=rf"^--save {tmp_path}: another job \(host .*, "
            rf"pid {holder.pid}, job job-42, started .*\) holds its lock",
        ):
            _train("--train-iters", "1", "--save", str(tmp_path))
        assert not (tmp_path / TRACKER).exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("locks", [True, False], ids=["fcntl", "no fcntl"])
def test_a_dead_holders_lock_is_taken_over_and_a_live_one_refused(tmp_path, monkeypatch, locks):
    """Without fcntl locks (the file system refuses them) the lock file's content decides."""
    from megatron_dip.training.checkpoint import save_lock
    from megatron_dip.training.checkpoint.save_lock import SaveLock, SaveLockedError, this_process

    if not locks:

        def no_locks(fd, op):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(save_lock.fcntl, "lockf", no_locks)
    holder = _holder(tmp_path)
    me = this_process("job-43")
    try:
        with pytest.raises(SaveLockedError, match=rf"pid {holder.pid}, job job-42"):
            SaveLock(tmp_path).acquire(me)
    finally:
        holder.kill()
        holder.wait()
    lock = SaveLock(tmp_path)
    warning = lock.acquire(me)
    assert warning and "took over the lock of host" in warning and "no longer running" in warning
    lock.release()
    assert SaveLock(tmp_path).acquire(me) is None  # released: nobody to take over from


def test_a_holder_on_another_host_without_locks_names_the_file_to_delete(tmp_path, monkeypatch):
    import json

    from megatron_dip.training.checkpoint import save_lock
    from megatron_dip.training.checkpoint.save_lock import (
        LOCK_FILE,
        SaveLock,
        SaveLockedError,
        this_process,
    )

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    other = {"host": "node-17", "pid": 4242, "job": "job-9", "started": 1.0e9}
    (tmp_path / LOCK_FILE).write_text(json.dumps(other))
    monkeypatch.setattr(save_lock.fcntl, "lockf", no_locks)
    with pytest.raises(
        SaveLockedError,
        match=rf"host node-17, pid 4242, job job-9.*once that "
        rf"job has ended, delete {tmp_path / LOCK_FILE}",
    ):
        SaveLock(tmp_path).acquire(this_process("job-43"))
    monkeypatch.undo()  # with fcntl locks, a free lock means its job ended
    warning = SaveLock(tmp_path).acquire(this_process("job-43"))
    assert "node-17" in warning and "its lock was free" in warning


# -- failed saves -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "no space left on device (ENOSPC)"),
        (errno.EACCES, "permission denied (EACCES)"),
        (errno.EIO, "I/O error (EIO)"),
    ],
)
def test_a_failed_write_names_the_cause_and_removes_the_partial_save(
    single_rank_world, tmp_path, monkeypatch, code, words
):
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dip.cpu_support import apply_cpu_fixes
    from megatron_dip.training.checkpoint.storage import CheckpointWriter

    apply_cpu_fixes()
    tmp = tmp_path / "iter_0000002.tmp"

    def fail(*args, **kwargs):
        raise OSError(code, "injected", str(tmp / "__0_0.distcp"))

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(100.0))}
    CheckpointWriter(group=None, async_save=False).save(state, tmp_path, 1)
    monkeypatch.setattr(filesystem_async, "_write_item", fail)
    with pytest.raises(CheckpointError) as info:
        CheckpointWriter(group=None, async_save=False).save(state, tmp_path, 2)
    assert str(info.value) == (
        f"saving {tmp} failed on rank 0: {words} writing {tmp / '__0_0.distcp'}; the partial "
        "iter_0000002.tmp was removed; the previous checkpoint and the tracker are unchanged"
    ), info.value
    assert _names(tmp_path) == ["iter_0000001", TRACKER]


def test_a_training_save_that_cannot_fit_stops_the_run_keeping_the_last(
    trained, tmp_path, monkeypatch, caplog
):
    """From iteration 2's checkpoint, saving every iteration: the save of 3 warns that the next
    one will not fit, that of 4 is refused naming both sizes, nothing of it is written (a disk
    that fills up during a training save: test_training_dist.py, on one rank of four)."""
    import shutil

    from megatron_dip.training.checkpoint import dirs

    root = tmp_path / "ckpt"
    shutil.copytree(trained[0], root)
    size = dirs.checkpoint_bytes(root / "iter_0000002")
    usage = shutil.disk_usage(root)
    free = iter([size + 1, size - 1])
    monkeypatch.setattr(dirs.shutil, "disk_usage", lambda _: usage._replace(free=next(free)))
    flags = ["--load", str(root), "--save", str(root), "--save-interval", "1"]
    flags += ["--lr-decay-iters", "2", "--train-iters", "4"]  # the checkpoint's decay
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError) as info:
        _train(*flags)
    assert "the save after the one of iteration 3 will not fit" in caplog.text
    assert re.fullmatch(
        rf"--save {root}: .* free, but the last checkpoint \(iter_0000003\) took "
        r"\d.*: the save of iteration 4 would not fit; nothing was written \(the previous "
        r"checkpoint and the tracker are unchanged\): free space there and resume",
        str(info.value),
    ), info.value
    assert (root / TRACKER).read_text() == "3" and not (root / "iter_0000004.tmp").exists()
