"""What rank 0 does to the files of a written checkpoint (`storage.CheckpointWriter`'s
finalize step): the manifest, the renames that publish it, and the words for a failed write.

Torch-free; each step is atomic (a rename, or `write_atomically`) and fsynced, so a crash leaves
the previous checkpoint and the tracker as they were.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from .checksums import digests, manifest_text
from .dirs import MANIFEST, TRACKER, CheckpointError, fsync_dir, write_atomically


def reason(error: BaseException) -> str:
    """The last line of an error's text (dist_checkpointing's hold whole tracebacks)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def complete_on_rank0(tmp: Path, final: Path, gathered: list) -> None:
    """The manifest of a written checkpoint: every rank's digests and those of the common
    files, checked against the files in `tmp`."""
    manifest: dict[str, list] = {}
    for found in gathered:
        manifest.update(found)
    written = {p.name for p in tmp.iterdir() if p.name.endswith(".distcp")}
    if written != set(manifest):
        raise CheckpointError(
            f"saving {final}: the ranks hashed {sorted(manifest)} but {tmp} holds {sorted(written)}"
        )
    common = [p for p in tmp.iterdir() if p.is_file() and not p.name.endswith((".distcp", ".part"))]
    manifest.update(digests(common))
    write_atomically(tmp / MANIFEST, manifest_text(manifest))


def replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, replacing an older `dst` (a rerun reached that iteration again)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(src, dst)
    fsync_dir(dst.parent)


def rename_and_track(src: Path, final: Path, iteration: int) -> None:
    """Publish: rename `src` to `final` (an older `final` is replaced only once the new one is
    in place), then rewrite the tracker."""
    old = final.with_name(final.name + ".old")
    if final.exists():  # a rerun from an older checkpoint reached this iteration again
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(src, final)
    fsync_dir(final.parent)
    write_atomically(final.parent / TRACKER, str(iteration))
    shutil.rmtree(old, ignore_errors=True)


def iteration_of(final: Path) -> int:
    return int(final.name.split("_", 1)[1])


_CAUSES = {
    errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied", errno.EPERM: "permission denied",
    errno.EIO: "I/O error", errno.EROFS: "read-only file system",
}  # fmt: skip


def describe_error(error: BaseException, where: Path, also: Iterable[BaseException] = ()) -> str:
    """The cause of a failed write in words, with its errno name and the file (or `where`):
    the OSError behind `error`, else the first of `also` (what the writer's buckets raised,
    where the writer does not chain them)."""
    seen, e = set(), error
    while e is not None and not isinstance(e, OSError) and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if not isinstance(e, OSError):
        e = next((x for x in also if isinstance(x, OSError)), e)
    if isinstance(e, OSError) and e.errno is not None:
        cause = _CAUSES.get(e.errno, e.strerror or str(e))
        return f"{cause} ({errno.errorcode.get(e.errno, e.errno)}) writing {e.filename or where}"
    return f"{reason(error)} (writing {where})"
