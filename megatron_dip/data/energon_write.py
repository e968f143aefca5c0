"""Writing Megatron-Energon datasets: LLaVA JSON + images -> a prepared crude WebDataset.

`write_llava_energon` is `tools/llava_to_energon.py`: each LLaVA record becomes one sample of
tar shards (`llava-NNNNNN.tar`, `samples_per_shard` samples each) with a `json` part (the
record's id, conversations and the names of its image parts) and one part per image
(`img0.jpg`, `img1.png`, ...: the file's bytes, never re-encoded). The shards are then prepared
by Energon itself (`prepare`: `energon prepare --non-interactive --split-ratio ...
--sample-type CrudeWebdataset --media-metadata-by-extension`, so the index holds every image's
size) and the dataset.yaml gets the subflavor `megatron_dip: llava`, which selects the built-in
cooker (`energon.LLAVA_COOKER`). The result trains with `--dip-data energon:OUT`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

from .json_index import JsonRecords, NotUtf8Error
from .llava import image_names
from .records import BadSampleError, inside_root

logger = logging.getLogger(__name__)

LLAVA_SUBFLAVORS = {"megatron_dip": "llava"}


def prepare(
    path: str | Path,
    *,
    sample_type: str,
    field_map: dict | None = None,
    split_ratio: str = "1,0,0",
    media_metadata: bool = True,
) -> None:
    """`energon prepare` on the shards under `path` (non-interactive; its output is logged)."""
    from megatron.energon.tools.prepare import command

    args = [str(path), "--non-interactive", "--no-progress", "--num-workers", "1"]
    args += ["--split-ratio", split_ratio, "--sample-type", sample_type, "--force-overwrite"]
    if field_map is not None:
        args += ["--field-map", json.dumps(field_map)]
    if media_metadata:
        args.append("--media-metadata-by-extension")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        command.main(args, standalone_mode=False)
    logger.debug("energon prepare %s:\n%s", path, out.getvalue())


def _sample(record: dict, index: int, image_root: Path, *, allow_outside: bool = False) -> dict:
    """One shard sample of a LLaVA record (module docstring)."""
    parts = {}
    for j, name in enumerate(image_names(record)):
        ext = Path(name).suffix.lower().lstrip(".") or "jpg"
        try:
            path = inside_root(image_root, name, allow_outside=allow_outside)
            parts[f"img{j}.{ext}"] = path.read_bytes()
        except (OSError, BadSampleError) as err:
            raise BadSampleError(f"record {index} (id {record.get('id')!r}): {err}") from err
    meta = {
        "id": record.get("id", index),
        "conversations": record.get("conversations"),
        "images": list(parts),
    }
    return {"__key__": f"{index:09d}", "json": json.dumps(meta).encode("utf-8"), **parts}


def write_llava_energon(
    json_path: str | Path,
    out_dir: str | Path,
    *,
    image_root: str | Path | None = None,
    samples_per_shard: int = 1000,
    skip_bad: bool = False,
    allow_outside_paths: bool = False,
    split_ratio: str = "1,0,0",
) -> tuple[int, int]:
    """Convert a LLaVA JSON (or JSON Lines) file and its images into a prepared Energon dataset
    at `out_dir`; returns (samples written, records skipped). A record whose image cannot be
    read, whose image path leaves the image root (unless `allow_outside_paths`) or that is not
    UTF-8 stops the conversion naming it, or is skipped with `skip_bad`. `split_ratio`: Energon's
    train,val,test parts (e.g. "95,5,0" keeps a validation split for evaluation)."""
    import webdataset

    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    records = JsonRecords(json_path)
    root = Path(image_root) if image_root is not None else Path(json_path).parent
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = skipped = 0
    pattern = str(out / "llava-%06d.tar")
    with webdataset.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as writer:
        for index in range(len(records)):
            try:
                record = records[index]
                writer.write(_sample(record, index, root, allow_outside=allow_outside_paths))
                written += 1
            except (BadSampleError, NotUtf8Error) as err:
                if not skip_bad:
                    raise
                logger.warning("skipping %s", err)
                skipped += 1
    if not written:
        raise ValueError(f"{json_path}: no record could be converted")
    prepare(out, sample_type="CrudeWebdataset", split_ratio=split_ratio)
    _add_subflavors(out / ".nv-meta" / "dataset.yaml", LLAVA_SUBFLAVORS)
    logger.info("wrote %d samples (%d skipped) to %s", written, skipped, out)
    return written, skipped


def _add_subflavors(path: Path, subflavors: dict) -> None:
    import yaml

    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config["subflavors"] = {**config.get("subflavors", {}), **subflavors}
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
