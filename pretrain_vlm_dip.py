#!/usr/bin/env python
"""Train a vision-language model (ViT + LLM) with DIP, or with Megatron-Core's stock schedules.

    torchrun --nproc-per-node 4 pretrain_vlm_dip.py --model tiny-vlm \
        --pipeline-model-parallel-size 2 --train-iters 40 --lr 1e-3 --log-interval 5

Megatron-LM's flag names plus --dip-* (python pretrain_vlm_dip.py --help; docs/training.md).
"""

import sys

from megatron_dip.training.entry import main

if __name__ == "__main__":
    sys.exit(main(default_model="tiny-vlm"))
