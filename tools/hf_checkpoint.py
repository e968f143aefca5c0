"""Hugging Face checkpoints into megatron-dip's and back.

    # one process (the whole model in memory once):
    python tools/hf_checkpoint.py import --model vlm-s --dip-hf-config llm=/ckpt/Meta-Llama-3-8B \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --save /ckpt/vlm-s-init
    # TP x PP processes, each reading only its own slices of the safetensors files:
    torchrun --nproc-per-node 8 tools/hf_checkpoint.py import --model vlm-s \\
        --dip-hf-config llm=/ckpt/Meta-Llama-3-8B --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 2 --save /ckpt/vlm-s-init
    # back to a Hugging Face folder (model.safetensors + config.json), one process:
    python tools/hf_checkpoint.py export --model vlm-s --dip-hf-config llm=/ckpt/Meta-Llama-3-8B \\
        --load /run/checkpoints --module llm --hf-out /ckpt/llama-finetuned

The model is what training builds from the same flags (--model, --dip-hf-config, --num-layers,
--dip-arch, ...; pass the same ones to training), so its checkpoint loads there with
`--load DIR --finetune` or `--pretrained-checkpoint DIR` at any TP / PP / DIP placement (the
import's own TP x PP only shapes how the import is spread over processes). Modules or tensors the
Hugging Face folders lack (the ViT and projector of a Llama-3 + ViT model) are initialised as in
training, and named in the log. Supported: Llama / Qwen2 decoders as the LLM or text encoder.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

logger = logging.getLogger("hf_checkpoint")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(this tool's arguments, the training flags that define the model)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=("import", "export"))
    p.add_argument(
        "--module", default=None, help="export: the module to write (an LLM or text encoder)"
    )
    p.add_argument("--hf-out", default=None, help="export: the Hugging Face folder to write")
    return p.parse_known_args(argv)


def _model_and_config(flags: list[str]):
    from megatron_dip.training.arguments import parse_config
    from megatron_dip.training.data_config import model_spec
    from megatron_dip.training.validate import apply_preset

    config, preset = apply_preset(parse_config(flags))
    model, _, _ = model_spec(config, preset)
    return model, config


def _init_world() -> bool:
    """Start the gloo world (torchrun's, or one process); False when one exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        return True
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="hf_checkpoint_"), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


def run_import(config, model) -> int:
    from megatron_dip.training.architecture import hf_folders
    from megatron_dip.training.hf_checkpoint import import_hf

    if config.checkpoint.save is None:
        raise SystemExit("import: --save DIR is required")
    folders = hf_folders(config, model)
    if not folders:
        raise SystemExit("import: name the Hugging Face folders with --dip-hf-config")
    p = config.parallel
    result = import_hf(
        model=model, folders=folders, save=config.checkpoint.save,
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        seed=config.train.seed,
    )  # fmt: skip
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    logger.info(
        "wrote %s; this rank read %.1f MiB of safetensors; peak host memory %.0f MiB",
        result.path, result.bytes_read / 2**20, peak,
    )  # fmt: skip
    return 0


def run_export(args, config, model) -> int:
    from megatron_dip.hf.config import read_config
    from megatron_dip.training.architecture import hf_folders
    from megatron_dip.training.hf_checkpoint import export_hf

    if config.checkpoint.load is None or args.hf_out is None:
        raise SystemExit("export: --load DIR and --hf-out DIR are required")
    folders = hf_folders(config, model)
    modules = args.module.split(",") if args.module else list(folders)
    if not modules:
        raise SystemExit("export: name the modules with --module (or --dip-hf-config)")
    sources = {folders[m] for m in modules if m in folders}
    template = read_config(sources.pop()) if len(sources) == 1 else None
    export_hf(
        model=model, load=config.checkpoint.load, modules=modules, out=args.hf_out,
        step=config.checkpoint.ckpt_step, template=template,
    )  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    import torch.distributed as dist

    from megatron_dip.training.config_error import ConfigError

    args, flags = parse_args(argv)
    try:
        model, config = _model_and_config(flags)
    except ConfigError as e:
        logger.error("%s", e)
        return 2
    created = _init_world()
    try:
        if args.command == "import":
            return run_import(config, model)
        return run_export(args, config, model)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
