#!/usr/bin/env python
"""Train a small byte-level BPE Hugging Face tokenizer on a LLaVA JSON file's text (offline).

Usage: python scripts/make_tiny_tokenizer.py OUT_DIR --llava data.json [--vocab-size 400]

Writes tokenizer.json / tokenizer_config.json (with ChatML, Llama 3 and Qwen2-VL special tokens
and a ChatML chat template) into OUT_DIR, for `--tokenizer-type HuggingFaceTokenizer
--tokenizer-model OUT_DIR`. Needs transformers and tokenizers (pip install "megatron-dip[hf]").
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dip.data.json_index import JsonRecords
from megatron_dip.data.tiny_tokenizer import make_tiny_tokenizer


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and train the tokenizer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the tokenizer into")
    parser.add_argument("--llava", required=True, help="LLaVA JSON whose text it is trained on")
    parser.add_argument("--vocab-size", type=int, default=400)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    texts = [
        turn.get("value", "")
        for record in JsonRecords(args.llava)
        for turn in record.get("conversations", [])
    ]
    make_tiny_tokenizer(args.out_dir, texts, vocab_size=args.vocab_size)
    logging.getLogger(__name__).info(
        "wrote a tokenizer trained on %d texts to %s", len(texts), args.out_dir
    )


if __name__ == "__main__":
    main()
