#!/usr/bin/env python
"""Train a text-to-video/image diffusion model (text encoder + DiT) with DIP, or with
Megatron-Core's stock schedules.

    torchrun --nproc-per-node 4 pretrain_diffusion_dip.py --model tiny-t2v \
        --pipeline-model-parallel-size 4 --train-iters 40 --lr 1e-3 --log-interval 5

Megatron-LM's flag names plus --dip-* (python pretrain_diffusion_dip.py --help; docs/training.md).
"""

import sys

from megatron_dip.training.entry import main

if __name__ == "__main__":
    sys.exit(main(default_model="tiny-t2v"))
