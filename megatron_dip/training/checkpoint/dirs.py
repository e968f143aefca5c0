"""Checkpoint directories, the tracker file, and the checks a run makes of them before it starts.

Torch-free and collective-free: `validate.py` calls `find_resume` and `check_save` before any
process group exists and before the start-up placement search, so a bad --load / --save ends
every rank at once with one line naming the flag and the file, and `create_save` once every
check has passed. Layout (Megatron-LM's names; the inside of an iteration directory is
`storage`'s):

    DIR/latest_checkpointed_iteration.txt    the newest complete checkpoint, written last, atomically
    DIR/iter_0000100/                         one complete checkpoint (`MANIFEST` inside it)
    DIR/iter_0000100.tmp/                     a save in progress (or one a crash interrupted)
    DIR/iter_0000100.unverified/              complete, not yet trained on (or never trained on
                                              with a finite loss): loading ignores it

An `iter_*` directory exists only once complete and verified: a training save writes into
`.tmp`, writes the manifest, renames it to `.unverified`, and once the next iteration, computed
with the saved weights, has a finite loss and gradient norm renames it to `iter_N` and only then
rewrites the tracker (`storage`). The tracker therefore never names weights that have not
trained with a finite loss.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "checksums.json"
FORMAT = "megatron-dip-checkpoint/3"
_ITER = re.compile(r"^iter_(\d{7,})$")
UNVERIFIED = ".unverified"
_UNVERIFIED = re.compile(r"^iter_(\d{7,})\.unverified$")
_OLD_FORMATS = ("megatron-dip-checkpoint/1", "megatron-dip-checkpoint/2")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked (the message names the file and the flag)."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint --load will read."""

    path: Path
    iteration: int


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def complete_iterations(root: str | Path) -> list[int]:
    """Iterations of the complete checkpoints under `root` (with a manifest), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _ITER.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append(int(m.group(1)))
    return sorted(found)


def unverified_iterations(root: str | Path) -> list[int]:
    """Iterations of the complete but unverified checkpoints under `root` (`.unverified`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [_UNVERIFIED.match(p.name) for p in root.iterdir()]
    return sorted(int(m.group(1)) for m in found if m and (root / m.group(0) / MANIFEST).is_file())


def unverified_dir(root: str | Path, iteration: int) -> Path:
    return iteration_dir(root, iteration).with_suffix(UNVERIFIED)


def _old_format(path: Path) -> str | None:
    """The format name of a pre-dist_checkpointing megatron-dip checkpoint at `path`, else None."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError):
        return None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    return fmt if fmt in _OLD_FORMATS else None


def _old_format_error(flag: str, path: Path, fmt: str) -> CheckpointError:
    return CheckpointError(
        f"{flag} {path.parent}: {path.name} is a {fmt!r} checkpoint (full tensors per rank, "
        f"written by megatron-dip before it used Megatron-Core's dist_checkpointing); this "
        f"version reads only {FORMAT!r} (torch_dist) checkpoints: resume it with the version "
        "that wrote it, or start from scratch"
    )


def _newest_hint(root: Path) -> str:
    found = complete_iterations(root)
    if not found:
        return "no complete iter_* checkpoint is there"
    return f"the newest complete one is {iteration_dir(root, found[-1]).name}: pass --ckpt-step {found[-1]}"


def read_tracker(root: str | Path) -> int | None:
    """The tracker's iteration; None when there is no tracker. Raises `CheckpointError` naming
    the file when it cannot be read or holds something else than an iteration number."""
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"--load {root}: cannot read {tracker} ({e}); {_newest_hint(Path(root))}"
        ) from None
    if not text.isdigit():
        raise CheckpointError(
            f"--load {root}: {tracker} holds {text[:40]!r}, not an iteration number; "
            f"{_newest_hint(Path(root))}"
        )
    return int(text)


def find_resume(root: str | Path, step: int | None) -> ResumePoint | None:
    """What `--load root [--ckpt-step step]` loads; None: nothing saved there yet (train from
    scratch). Refuses (`CheckpointError`) a directory with complete checkpoints but no
    readable tracker, a tracker naming a missing checkpoint, an unknown --ckpt-step and an
    old-format checkpoint, each in one line naming the file and the flag that picks another."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"--load {root}: is a file, not a checkpoint directory")
    m = _ITER.match(root.name)
    if m and ((root / MANIFEST).exists() or (root / "metadata.json").exists()):
        raise CheckpointError(
            f"--load {root}: is one checkpoint, not the directory of a run's checkpoints: pass "
            f"--load {root.parent} --ckpt-step {int(m.group(1))}"
        )
    if step is None:
        step = read_tracker(root)
        if step is None:
            found = complete_iterations(root)
            if found:
                raise CheckpointError(
                    f"--load {root}: no {TRACKER} but complete checkpoints are there (iterations "
                    f"{_listing(found)}); training from scratch would overwrite them: "
                    f"{_newest_hint(root)} (or restore the tracker file)"
                )
            _refuse_old_format("--load", root)
            return None
        source = f"{TRACKER} names iteration {step}"
    else:
        source = f"--ckpt-step {step}"
    path = iteration_dir(root, step)
    fmt = _old_format(path)
    if fmt is not None:
        raise _old_format_error("--load", path, fmt)
    if not (path / MANIFEST).is_file():
        what = "is incomplete (no manifest)" if path.is_dir() else "does not exist"
        raise CheckpointError(f"--load {root}: {source}, but {path} {what}; {_newest_hint(root)}")
    return ResumePoint(path, step)


def _listing(found: list[int]) -> str:
    shown = ", ".join(map(str, found[-5:]))
    return shown if len(found) <= 5 else f"..., {shown}"


def _refuse_old_format(flag: str, root: Path) -> None:
    """A directory of old-format checkpoints (no tracker of the new kind) is named as such."""
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        fmt = _old_format(p) if p.is_dir() else None
        if fmt is not None:
            raise _old_format_error(flag, p, fmt)


def check_save(save: str | Path, *, load: str | Path | None) -> None:
    """Before training, touching nothing: checkpoints can be written below `--save` (no file in
    its way), and saving there cannot overwrite checkpoints of another run (a directory that
    holds checkpoints must also be --load). `create_save` then makes it."""
    save = Path(save)
    for parent in (save, *save.parents):
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(
                    f"--save {save}: {parent} is a file, not a directory; checkpoints cannot be "
                    "written below it"
                )
            break
    _refuse_old_format("--save", save)
    found = sorted({*complete_iterations(save), *unverified_iterations(save)})
    same = load is not None and Path(load).resolve() == save.resolve()
    if (found or (save / TRACKER).exists()) and not same:
        held = f"iterations {_listing(found)}" if found else TRACKER
        raise CheckpointError(
            f"--save {save}: already holds checkpoints ({held}) that this run does not --load; "
            f"saving would mix two runs in one directory: pass --load {save} to resume, or "
            "choose another --save"
        )


def create_save(save: str | Path) -> None:
    """Make `--save` (after `check_save` and every other check of the run passed) and prove it
    writable, so that the first save cannot fail on permissions hours into training."""
    save = Path(save)
    try:
        save.mkdir(parents=True, exist_ok=True)
        probe = save / f".write_test_{socket.gethostname()}_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"--save {save}: not writable ({e.strerror or e})") from None


def check_load_exists(load: str | Path, *, save: str | Path | None) -> None:
    """A --load that does not exist is a typo unless it is --save (Megatron-LM's auto-resume
    idiom `--save DIR --load DIR`: the first run of a job starts from scratch there)."""
    load = Path(load)
    if load.exists():
        return
    if save is not None and Path(save).resolve() == load.resolve():
        return
    also = f" and is not --save ({save})" if save is not None else " (and there is no --save)"
    raise CheckpointError(
        f"--load {load}: does not exist{also}: check the path; to start from scratch drop "
        "--load, or pass the same directory as --save and --load to resume it when it exists"
    )


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the files of one checkpoint directory."""
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def newest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, verified or not (None: none yet)."""
    found = [(i, iteration_dir(root, i)) for i in complete_iterations(root)]
    found += [(i, unverified_dir(root, i)) for i in unverified_iterations(root)]
    return max(found)[1] if found else None


def check_free_space(root: str | Path, iteration: int, last: Path | None) -> str | None:
    """Before the save of `iteration` under `root`: refuses (`CheckpointError` naming both
    sizes) when the free space there is below the size of `last` (the newest checkpoint: this
    one will be as large); returns a warning when it is below twice that (the next save will
    not fit), else None."""
    if last is None or not last.is_dir():
        return None
    needed, free = checkpoint_bytes(last), shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointError(
            f"--save {root}: {_size(free)} free, but the last checkpoint ({last.name}) took "
            f"{_size(needed)}: the save of iteration {iteration} would not fit; nothing was "
            "written (the previous checkpoint and the tracker are unchanged): free space there "
            "and resume"
        )
    if free < 2 * needed:
        return (
            f"--save {root}: {_size(free)} free, the last checkpoint ({last.name}) took "
            f"{_size(needed)}: the save after the one of iteration {iteration} will not fit"
        )
    return None


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def load_hint(path: Path) -> str:
    """What to load instead of a damaged checkpoint `path`."""
    root = path.parent
    others = [i for i in complete_iterations(root) if iteration_dir(root, i) != path]
    if not others:
        return f" (--load {root}: no other complete checkpoint there to pick with --ckpt-step)"
    return f" (--load {root}: pick another checkpoint, e.g. --ckpt-step {others[-1]})"


def check_train_iters(resume: ResumePoint | None, train_iters: int) -> None:
    """A loaded iteration past --train-iters is a mistake (nothing would train, and a save would
    rewrite the checkpoint under the same name)."""
    if resume is not None and resume.iteration > train_iters:
        raise CheckpointError(
            f"--train-iters {train_iters}: the checkpoint to load ({resume.path}) is at "
            f"iteration {resume.iteration}, past it; raise --train-iters or pick an earlier "
            "checkpoint with --ckpt-step"
        )


def newer_than(root: str | Path, iteration: int) -> list[int]:
    """Complete checkpoints under `root` (verified or not) newer than `iteration` (a run
    resumed from an older one replaces them when it gets there)."""
    found = {*complete_iterations(root), *unverified_iterations(root)}
    return sorted(i for i in found if i > iteration)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old or the new content, never a part
    (write a temporary file, fsync it, rename it over `path`, fsync the directory)."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
