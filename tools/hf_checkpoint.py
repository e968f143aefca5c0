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
training, and named in the log. Without --model the model is the Hugging Face folder alone (its
LLM, a VLM's ViT too; load it in training with --dip-pretrained llm=DIR). Megatron-LM flags that
contradict config.json are refused; an import never writes into a directory holding
checkpoints. The export writes config.json from the checkpoint's own module records (checked
against the flags when given), in the source's dtype, with the source folder's generation,
preprocessor and tokenizer files (and --tokenizer-model's tokenizer).
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


class _Parser(argparse.ArgumentParser):
    """A mistyped flag is one line (the full usage is --help's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def _families() -> str:
    from megatron_dip.hf.config import FAMILIES

    rows = "\n".join(f"  {name:10s} {text}" for name, text in FAMILIES.items())
    return f"Hugging Face families (config.json model_type):\n{rows}"


def build_parser() -> argparse.ArgumentParser:
    """This tool's flags, then the training flags (the same as training takes: those that
    define the model, its layout, tokenizer and checkpoints matter here, the others are
    accepted so that a training launch's flags can be reused)."""
    from megatron_dip.training.config.arguments import add_arguments

    p = _Parser(
        description=__doc__,
        epilog=_families(),
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("command", choices=("import", "export"))
    p.add_argument(
        "--module",
        default=None,
        help="export: the modules to write (an LLM or text encoder, or vit,llm for a VLM; "
        "default: those --dip-hf-config names)",
    )
    p.add_argument("--hf-out", default=None, help="export: the Hugging Face folder to write")
    p.add_argument(
        "--hf-dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="export: the dtype of the written weights (default: the source folder's, else the "
        "checkpoint's)",
    )
    return add_arguments(p)


def parse_args(argv: list[str] | None):
    """(this tool's arguments, the training config of the model flags)."""
    from megatron_dip.training.config.arguments import TrainConfig

    args = build_parser().parse_args(argv)
    return args, TrainConfig.from_namespace(args)


def _model_and_config(config):
    """The model the flags describe: the --model preset's, or without one the model of the
    --dip-hf-config folder alone (its LLM; a VLM's ViT too), nothing else built."""
    from megatron_dip.hf.config import model_of_config, parse_hf_config_flag, read_config
    from megatron_dip.training.config.arguments import fail
    from megatron_dip.training.config.data_config import model_spec
    from megatron_dip.training.config.validate import apply_preset

    if config.model.model is not None:
        config, preset = apply_preset(config)
        return model_spec(config, preset)[0], config
    folders = parse_hf_config_flag(config.architecture.dip_hf_config, modules=["llm", "vit"])
    if len(set(folders.values())) != 1:
        raise fail(
            "--model", "choose a preset, or name one Hugging Face folder: --dip-hf-config DIR"
        )
    folder = next(iter(folders.values()))
    try:
        base = model_of_config(read_config(folder), where=f"{folder}/config.json")
    except ValueError as e:
        raise fail("--dip-hf-config", str(e)) from None
    p = config.parallel
    config = config.replace(
        tensor_model_parallel_size=p.tensor_model_parallel_size or 1,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size or 1,
        dip_hf_config=folder,
    )
    return model_spec(config, None, base=base)[0], config


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
    from megatron_dip.training.checkpoint.huggingface import import_hf
    from megatron_dip.training.config.architecture import hf_folders

    if config.checkpoint.save is None:
        raise SystemExit("import: --save DIR is required")
    folders = hf_folders(config, model)
    if not folders:
        raise SystemExit("import: name the Hugging Face folders with --dip-hf-config")
    p = config.parallel
    result = import_hf(
        model=model,
        folders=folders,
        save=config.checkpoint.save,
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        seed=config.train.seed,
    )
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    logger.info(
        "wrote %s; this rank read %.1f MiB of safetensors; peak host memory %.0f MiB",
        result.path,
        result.bytes_read / 2**20,
        peak,
    )
    return 0


def run_export(args, config, model) -> int:
    from megatron_dip.hf.config import read_config
    from megatron_dip.training.checkpoint.huggingface import export_hf
    from megatron_dip.training.config.architecture import hf_folders

    if config.checkpoint.load is None or args.hf_out is None:
        raise SystemExit("export: --load DIR and --hf-out DIR are required")
    folders = hf_folders(config, model) if model is not None else {}
    modules = args.module.split(",") if args.module else list(folders)
    if not modules:
        raise SystemExit("export: name the modules with --module (or --dip-hf-config)")
    sources = {folders[m] for m in modules if m in folders}
    source = sources.pop() if len(sources) == 1 else None
    export_hf(
        model=model,
        load=config.checkpoint.load,
        modules=modules,
        out=args.hf_out,
        step=config.checkpoint.ckpt_step,
        template=None if source is None else read_config(source),
        source=source,
        tokenizer=config.data.tokenizer_model,
        dtype=args.hf_dtype,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    import torch.distributed as dist

    from megatron_dip.training.checkpoint.dirs import CheckpointError
    from megatron_dip.training.config.arguments import ConfigError

    args, config = parse_args(argv)
    created = False
    try:
        model = None
        if args.command == "import" or config.model.model or config.architecture.dip_hf_config:
            model, config = _model_and_config(config)
        created = _init_world()
        if args.command == "import":
            return run_import(config, model)
        return run_export(args, config, model)
    except (ConfigError, CheckpointError, ValueError) as e:
        logger.error("%s", e)  # one line, naming the flag, file or size at fault
        return 2
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
