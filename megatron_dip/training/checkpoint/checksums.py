"""The checksum manifest of a checkpoint directory: written by the save, checked before a load.

`checksums.json` holds `{"sha256": {file: [bytes, hex sha256]}}` for every file of the
checkpoint (dist_checkpointing's `metadata.json`, `.metadata`, `common.pt` and the ranks'
`__R_T.distcp` files), one file per line. `verify` checks them all before anything is read: in a
distributed run each rank hashes a share of the files (largest first, to the least loaded rank)
and the ranks agree on the outcome, so a flipped byte, a truncated or a missing file is the same
one-line `CheckpointError` naming the file on every rank.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from .dirs import MANIFEST, CheckpointError

_CHUNK = 16 << 20
_THREADS = 2


def sha256_of(path: Path) -> tuple[int, str]:
    """(size in bytes, hex sha256) of a file, read in 16 MiB pieces."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            h.update(piece)
            size += len(piece)
    return size, h.hexdigest()


def digests(paths: Iterable[Path]) -> dict[str, list]:
    """{file name: [bytes, sha256]} of `paths`, hashed in parallel threads."""
    paths = list(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(paths)))) as pool:
        return {p.name: list(d) for p, d in zip(paths, pool.map(sha256_of, paths))}


def manifest_text(manifest: dict[str, list]) -> str:
    """The manifest as JSON, one file per line."""
    lines = [f"  {json.dumps(name)}: {json.dumps(manifest[name])}" for name in sorted(manifest)]
    return '{"sha256": {\n' + ",\n".join(lines) + "\n}}\n"


def read_manifest(path: Path) -> dict[str, list]:
    """{file: [bytes, sha256]} of a checkpoint directory; `CheckpointError` naming the file
    when it is missing or unreadable."""
    manifest = path / MANIFEST
    try:
        files = json.loads(manifest.read_text())["sha256"]
        if not isinstance(files, dict):
            raise TypeError
        return {str(k): [int(v[0]), str(v[1])] for k, v in files.items()}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST}: not a complete checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"{manifest}: unreadable checksum manifest ({e!r})") from None


def check_files(path: Path, manifest: dict[str, list], names: Iterable[str]) -> list[str]:
    """Problems (one line each, naming the file) of the manifest's files `names` in `path`."""
    problems = []
    for name in names:
        size, digest = manifest[name]
        file = path / name
        try:
            found = file.stat().st_size
        except FileNotFoundError:
            problems.append(f"{file}: missing")
            continue
        if found != size:
            problems.append(f"{file}: {found} bytes, the manifest says {size} (truncated?)")
        elif sha256_of(file)[1] != digest:
            problems.append(f"{file}: sha256 differs from the manifest (corrupted)")
    return problems


def _share(manifest: dict[str, list], rank: int, world: int) -> list[str]:
    """This rank's files to check: the largest first, each to the least loaded rank."""
    loads, mine = [0] * world, []
    for name in sorted(manifest, key=lambda n: (-manifest[n][0], n)):
        least = loads.index(min(loads))
        loads[least] += manifest[name][0]
        if least == rank:
            mine.append(name)
    return mine


def verify(path: Path, *, hint: str = "") -> None:
    """Check every file of a checkpoint against its manifest; collective when torch.distributed
    is initialised (each rank checks a share), single-process otherwise. Raises the same
    `CheckpointError` on every rank, naming the first bad file (`hint`: what to do instead)."""
    try:
        manifest = read_manifest(path)  # every rank reads the same file: the same outcome
    except CheckpointError as e:
        raise CheckpointError(f"{e}{hint}") from None
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problems = check_files(path, manifest, _share(manifest, rank, world))
    if distributed:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = [p for found in everyone for p in found]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}{hint}")
