"""Convert LLaVA-style data (a JSON list or JSON Lines file + an image folder) to a Megatron-Energon
dataset that trains with `--dip-data energon:OUT_DIR`.

    python tools/llava_to_energon.py --json llava/data.json --out energon/ [--image-root DIR]
        [--samples-per-shard 1000] [--skip-bad] [--allow-outside-paths] [--split-ratio 95,5,0]

Writes crude WebDataset shards (a `json` part with the record's conversations, the image files'
bytes unchanged), runs `energon prepare` on them (with the images' media metadata, so the
planner reads image sizes from the index without decoding) and marks the dataset with the
subflavor that selects megatron-dip's built-in LLaVA cooker. The JSON file is streamed (indexed
by byte offsets), so memory stays small for LLaVA-Instruct-sized files.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dip.data.energon_write import write_llava_energon


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and convert."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="LLaVA JSON list or JSON Lines file")
    parser.add_argument("--out", required=True, help="directory of the Energon dataset")
    parser.add_argument("--image-root", help="image folder (default: the JSON file's folder)")
    parser.add_argument("--samples-per-shard", type=int, default=1000)
    parser.add_argument(
        "--skip-bad", action="store_true", help="skip records whose images cannot be read"
    )
    parser.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="let image paths lead outside the image folder ('../', absolute paths)",
    )
    parser.add_argument(
        "--split-ratio",
        default="1,0,0",
        help="Energon's train,val,test parts (e.g. 95,5,0: a validation split for evaluation)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_llava_energon(
        args.json,
        args.out,
        image_root=args.image_root,
        samples_per_shard=args.samples_per_shard,
        skip_bad=args.skip_bad,
        allow_outside_paths=args.allow_outside_paths,
        split_ratio=args.split_ratio,
    )


if __name__ == "__main__":
    main()
