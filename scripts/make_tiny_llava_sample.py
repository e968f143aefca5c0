#!/usr/bin/env python
"""Write a tiny LLaVA-Pretrain-style dataset (PNG images + JSON) into a directory.

Usage: python scripts/make_tiny_llava_sample.py OUT_DIR [--num-samples 16] [--seed 0]

Everything is generated with numpy and Pillow; nothing is downloaded. Read it back with
`megatron_dip.data.llava.LlavaDataset(OUT_DIR / "data.json", model=...)`.
"""

from __future__ import annotations

import argparse
import logging

from megatron_dip.data.tiny_llava import make_tiny_llava_sample


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and write the dataset."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write data.json and images/ into")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_tiny_llava_sample(args.out_dir, num_samples=args.num_samples, seed=args.seed)


if __name__ == "__main__":
    main()
