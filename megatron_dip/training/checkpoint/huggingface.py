"""Hugging Face checkpoints into ours and back (the command line: tools/hf_checkpoint.py).

Import (`import_hf`, collective over a world of TP x PP processes, or one process): every rank
builds its chunks of every module (layers cut into PP contiguous ranges, chunk p on pipeline rank
p, TP shards as in training), fills each parameter that a Hugging Face folder covers with only
its own slices of the safetensors tensors (`hf.weights.fill_chunk`: peak host memory per rank ~
its shard), keeps the initialisation of the others (a projector the checkpoint lacks; logged
by name) and writes the weights through the chunks' `sharded_state_dict()` with
`checkpoint.save_weights`. The result is placement-free: `--load DIR --finetune` (or
`--pretrained-checkpoint DIR`) reads it under any TP / PP / DIP placement.

Export (`export_hf`, one process): the full global tensors of one text module are read from our
checkpoint (any training or weights checkpoint) and written back under the names
`save_pretrained` uses, with a `config.json` (`hf.config.hf_text_config`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dip.hf.config import hf_text_config, hf_vlm_config, merged_config
from megatron_dip.hf.names import decoder_maps, module_maps, vlm_export_maps
from megatron_dip.hf.weights import SafetensorsFolder, fill_chunk, hf_tensors
from megatron_dip.models.init import global_param_name
from megatron_dip.modelspec import MultimodalSpec, module_from_record
from megatron_dip.schedule.ir import ChunkSpec

from .dirs import TRACKER, CheckpointError, complete_iterations, find_resume
from .state import save_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImportResult:
    """What one rank did: where the checkpoint went, the bytes it read from the Hugging Face
    files, and the global names of the parameters that kept their initialisation."""

    path: Path
    bytes_read: int
    initialised: tuple[str, ...]


def import_chunks(model: MultimodalSpec, *, pp: int, pp_rank: int) -> list[tuple[ChunkSpec, int]]:
    """(chunk, chunk count) of every module on pipeline rank `pp_rank`: each module's layers cut
    into `pp` contiguous ranges, range p on rank p."""
    out = []
    for m in model.modules:
        bounds = [m.num_layers * p // pp for p in range(pp + 1)]
        out.append((ChunkSpec(m.name, pp_rank, pp_rank, bounds[pp_rank], bounds[pp_rank + 1]), pp))
    return out


def _groups(*, tp: int, pp: int):
    """This rank's ModelGroups (every rank creates every group, as torch.distributed needs)."""
    from megatron_dip.models.chunk import ModelGroups
    from megatron_dip.parallel.groups import importer_groups

    tp_group, single = importer_groups(tp=tp, pp=pp)
    # The embedding group sums tied-embedding gradients; an import computes none.
    return ModelGroups(tp=tp_group, cp=single, embedding=single)


def check_import(model: MultimodalSpec, *, save, tp: int, pp: int, world_size: int) -> None:
    """What an import refuses before it builds anything, each in one line: a TP that does not
    divide a sharded size, a world that is not TP x PP processes, a PP beyond a module's layers,
    and a --save directory that holds checkpoints already (they would be overwritten)."""
    from ..config.validate import check_tensor_parallel

    check_tensor_parallel(model, tp)
    if world_size != tp * pp:
        raise ValueError(
            f"world size {world_size} != TP x PP = {tp} x {pp}: start the import on "
            f"{tp * pp} processes (torchrun --nproc-per-node {tp * pp}) or change the sizes"
        )
    for m in model.modules:
        if m.num_layers < pp:
            raise ValueError(f"module {m.name!r}: {m.num_layers} layers cannot fill PP={pp} stages")
    root = Path(save)
    held = complete_iterations(root) if root.is_dir() else []
    if held or (root / TRACKER).exists() or any(root.glob("iter_*")):
        raise CheckpointError(
            f"--save {root}: holds checkpoints already ({_listing(held)}); import into an "
            "empty or new directory"
        )


def _agreed_check(model: MultimodalSpec, *, save, tp: int, pp: int) -> None:
    """`check_import` on every rank, its verdicts gathered before any rank writes: a rank that
    checks after another has started `save/iter_0.tmp` must not see that as a foreign
    checkpoint, and every rank raises the same line when any rank refuses."""
    from ..config.arguments import ConfigError

    kinds = {k.__name__: k for k in (ConfigError, CheckpointError, ValueError)}
    try:
        check_import(model, save=save, tp=tp, pp=pp, world_size=dist.get_world_size())
        verdict = None
    except tuple(kinds.values()) as e:
        verdict = (next(n for n, k in kinds.items() if isinstance(e, k)), str(e))
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, verdict)
    refused = next((v for v in verdicts if v is not None), None)
    if refused is not None:
        kind, message = refused
        raise kinds[kind](message)


def _listing(found: list[int]) -> str:
    return f"iterations {found}" if found else "an iteration directory or tracker"


def import_hf(
    *,
    model: MultimodalSpec,
    folders: dict[str, str],
    save: str | Path,
    tp: int,
    pp: int,
    seed: int = 1234,
) -> ImportResult:
    """Write the weights of the Hugging Face `folders` ({module: folder}) as our checkpoint
    `save/iter_0` (module docstring). Collective over the world group of tp * pp ranks."""
    from megatron_dip.cpu_support import seed_model_parallel_rng
    from megatron_dip.modalities import build_chunk
    from megatron_dip.models.config import ModelConfig

    _agreed_check(model, save=save, tp=tp, pp=pp)
    rank = dist.get_rank()
    groups = _groups(tp=tp, pp=pp)
    seed_model_parallel_rng(seed, tp_rank=rank % tp)
    config = ModelConfig(seed=seed)
    chunks, read, kept = [], 0, []
    for spec, count in import_chunks(model, pp=pp, pp_rank=rank // tp):
        folder = folders.get(spec.module)
        source = maps = None
        if folder is not None:
            source = SafetensorsFolder(folder)
            maps = module_maps(model.module(spec.module), source.where)
        # What the checkpoint gives is not drawn first (a full tensor per parameter).
        chunk = build_chunk(
            model,
            spec,
            num_chunks=count,
            config=config,
            groups=groups,
            skip_init=None if maps is None else maps.__contains__,
        )
        if source is not None:
            kept += fill_chunk(chunk, source, maps)
            read += source.bytes_read
        else:
            kept += [global_param_name(chunk, name) for name, _ in chunk.named_parameters()]
        chunks.append(chunk)
    if kept:
        logger.info("rank %d: not in the Hugging Face checkpoint, initialised: %s", rank, kept)
    path = save_weights(save, model=model, chunks=chunks)
    return ImportResult(path, read, tuple(kept))


def _full_tensors(path: Path, maps) -> dict[str, torch.Tensor]:
    """The full global tensors of our (verified) checkpoint `path` that `maps` names (one
    process; the local or the Transformer Engine spec's names, whichever the checkpoint
    holds)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from . import storage

    saved = storage.tensor_metadata(path)
    keys = [k for k in maps if k in saved]
    if not keys:
        raise CheckpointError(f"{path}: none of the module's tensors (another model's checkpoint?)")
    request = {
        k: ShardedTensor.from_rank_offsets(
            k, torch.empty(tuple(saved[k].global_shape), dtype=saved[k].dtype), replica_id=0
        )
        for k in keys
    }
    storage.load_sharded(request, path, saved=saved)
    return {k: t.data for k, t in request.items()}


def _hf_shapes(maps, ours: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for key, tensor in ours.items():
        tail = maps[key].hf_tail or tuple(tensor.shape[1:])
        for piece in maps[key].pieces:
            rows = tensor.shape[0] if piece.rows is None else piece.start + piece.rows
            old = shapes.get(piece.name, (0,))
            shapes[piece.name] = (max(old[0], rows), *tail)
    return shapes


def _export_layout(model: MultimodalSpec, modules: list[str], *, dtype: str) -> tuple[dict, dict]:
    """(tensor maps, config.json) of the exported `modules`: one text module as a Llama /
    Mistral / Qwen2 / Qwen3 model, or a ViT + LLM as a Qwen2-VL, Qwen2.5-VL or LLaVA model."""
    specs = [model.module(m) for m in modules]
    vits = [s for s in specs if s.kind == "vit"]
    texts = [s for s in specs if s.kind in ("llm", "text_encoder")]
    if len(texts) != 1 or len(vits) > 1 or len(specs) != len(texts) + len(vits):
        raise ValueError(
            f"export {modules}: one LLM or text encoder, and with a ViT the VLM's pair, "
            "is what a Hugging Face folder holds"
        )
    text = texts[0]
    if not vits:
        prefix = "model." if text.kind == "llm" else ""
        return decoder_maps(text, hf_prefix=prefix), hf_text_config(text, dtype=dtype)
    if text.kind != "llm":
        raise ValueError(f"export {modules}: a ViT is written with the LLM it feeds")
    return vlm_export_maps(vits[0], text), hf_vlm_config(vits[0], text, dtype=dtype)


def saved_model(path: Path, flags: MultimodalSpec | None, modules: list[str]) -> MultimodalSpec:
    """The model checkpoint `path` was saved from (its modules' records), checked against the
    model the flags build (`flags`, None: no --model given) for the exported `modules`: a
    mismatch is refused in one line naming both. A checkpoint without records (saved before
    they were kept) is exported as the flags' model after the same check of its signature."""
    from . import storage
    from .state import check_header, module_signature

    header = check_header(storage.load_common(path), path, None)
    records = header.get("modules")
    saved = None
    if records:
        specs = tuple(module_from_record(r) for r in records)
        saved = MultimodalSpec("checkpoint", specs)
    if saved is None and flags is None:
        raise CheckpointError(
            f"{path}: keeps no module records (an older checkpoint): name its model with --model "
            "and the flags it was trained with"
        )
    signatures = {entry[0]: entry for entry in header["model"]}
    for name in modules:
        if name not in signatures:
            raise CheckpointError(f"{path}: has no module {name!r} (modules: {list(signatures)})")
        if flags is None:
            continue
        try:
            ours = module_signature(flags.module(name))
        except KeyError:
            raise CheckpointError(f"--module {name}: the flags' model has no such module") from None
        if ours != signatures[name]:
            raise CheckpointError(
                f"{path}: module {name!r} was saved as {signatures[name]} (name, kind, layers, "
                f"hidden, ffn, heads, vocab), the flags build {ours}"
            )
    return saved if saved is not None else flags


# What an exported folder takes over from the Hugging Face folder it was imported from.
CARRIED_FILES = (
    "generation_config.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", "chat_template.json", "chat_template.jinja",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip


def source_dtype(template: dict | None) -> str | None:
    """The dtype a Hugging Face config says its weights are in ("dtype" in transformers 5,
    "torch_dtype" before; a VLM's text config's where the top level has none)."""
    for config in (template or {}, (template or {}).get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(config.get(key), str):
                return config[key]
    return None


def _carry_files(out: Path, *, source: str | Path | None, tokenizer: str | None) -> list[str]:
    """Copy the source folder's `CARRIED_FILES` into `out`, then the tokenizer of
    --tokenizer-model (saved by transformers, over the source's); returns what was written."""
    import shutil

    written = []
    if source is not None:
        for name in CARRIED_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)
                written.append(name)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            loaded = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--tokenizer-model {tokenizer}: not a Hugging Face tokenizer ({e})"
            ) from None
        written += [Path(f).name for f in loaded.save_pretrained(str(out))]
    return sorted(set(written))


def export_hf(
    *,
    load: str | Path,
    modules: list[str],
    out: str | Path,
    model: MultimodalSpec | None = None,
    step: int | None = None,
    template: dict | None = None,
    source: str | Path | None = None,
    tokenizer: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Write `modules` of our checkpoint under `load` (the tracker's, or iteration `step`) as a
    Hugging Face folder `out`: model.safetensors in `dtype` (default: the source's, else the
    checkpoint's), config.json from the checkpoint's own module records over `template` (the
    config it was imported from), the source folder's generation / preprocessor / tokenizer
    files, the tokenizer of `tokenizer` (--tokenizer-model). `model`: the flags' model, checked
    against the checkpoint (`saved_model`). One process with a process group (a world of 1)."""
    from safetensors.torch import save_file

    from megatron_dip.models.common import torch_dtype

    from . import checksums

    resume = find_resume(load, step)
    if resume is None:
        raise CheckpointError(f"{load}: no checkpoint there")
    checksums.verify(resume.path)
    model = saved_model(resume.path, model, modules)
    maps, _ = _export_layout(model, modules, dtype="float32")
    ours = _full_tensors(resume.path, maps)
    dtype = dtype or source_dtype(template) or str(next(iter(ours.values())).dtype).split(".")[-1]
    try:
        cast = torch_dtype(dtype)
    except KeyError:
        raise ValueError(f"dtype {dtype!r}: one of float32, bfloat16, float16, float64") from None
    _, config = _export_layout(model, modules, dtype=dtype)
    tensors = hf_tensors(maps, ours, shapes=_hf_shapes(maps, ours))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(cast).contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    text = json.dumps(merged_config(config, template), indent=2) + "\n"
    (out / "config.json").write_text(text, encoding="utf-8")
    carried = _carry_files(out, source=source, tokenizer=tokenizer)
    logger.info(
        "exported %s of %s as %s (%d tensors, %s; with %s)",
        modules,
        resume.path,
        out,
        len(tensors),
        dtype,
        ", ".join(carried) or "no other files",
    )
    return out
