"""Measure per-layer times of a model's modules into the cost model's profile format.

For each module, a stack of its Megatron-Core transformer layers (the layers its modality builds
for the chunks, `Modality.layer_stack`: Megatron's GPT layer for ViT, LLM, text encoder and audio
encoder, our `DitLayer` for the DiT) is built at the shapes one tensor-parallel rank holds, with a
single-rank process group: heads, key/value groups and FFN divided by TP, hidden size unchanged.
The layers are then timed forward and backward on a grid of (instances per sub-microbatch,
tokens per instance) through the modality's own `run_stack`, with the inputs the chunks give
them (`Modality.profile_batch`: instances packed along the sequence, packed-sequence
parameters, rotary tables, and for the DiT its timestep embedding and caption encoding). Because
the shard runs alone, the tensor-parallel collectives are NOT in the times: the profile says so
(`tp_comm_included: false`) and the cost model adds its own TP communication term.

On a GPU the times come from CUDA events after warm-up iterations; on the CPU from
`time.perf_counter` (slow, but the same code path, which is what the tests run). The result
is a `megatron-dip-profile/1` document (`planner.devices.load_profile`), written with the
device, software versions, dtype and attention implementation it was measured with.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dip import megatron_compat
from megatron_dip.cpu_support import apply_cpu_fixes, seed_model_parallel_rng
from megatron_dip.modalities import modality_of
from megatron_dip.modelspec import ModuleSpec, MultimodalSpec
from megatron_dip.parallel import ONE_PROCESS
from megatron_dip.planner.devices import PROFILE_FORMAT, load_profile, match_device

from .models import attention
from .models.common import ModelGroups, torch_dtype, transformer_config
from .models.config import ModelConfig

logger = logging.getLogger(__name__)

ATTENTION_CHOICES = ("auto", "te", "varlen", "segments")


@dataclass(frozen=True)
class ProfileGrid:
    """Token counts per instance x instance counts per sub-microbatch to time a module on."""

    tokens: tuple[int, ...]
    instances: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, values in (("tokens", self.tokens), ("instances", self.instances)):
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"grid {name} must be positive integers, got {values!r}")

    def points(self, max_tokens: int | None = None) -> list[tuple[int, int]]:
        """(tokens, instances) pairs, smallest sub-microbatch first, within `max_tokens`."""
        pairs = sorted(
            {(t, n) for t in self.tokens for n in self.instances}, key=lambda p: (p[0] * p[1], p)
        )
        return [p for p in pairs if max_tokens is None or p[0] * p[1] <= max_tokens]


def parse_grid(text: str) -> ProfileGrid:
    """`"256,1024@1,2,4"` -> tokens (256, 1024) x instances (1, 2, 4); ValueError otherwise."""
    tokens, sep, instances = text.partition("@")
    if not sep:
        raise ValueError(f"grid {text!r}: expected TOKENS@INSTANCES, e.g. 256,1024@1,2,4")
    try:
        return ProfileGrid(
            tuple(int(v) for v in tokens.split(",")), tuple(int(v) for v in instances.split(","))
        )
    except ValueError as exc:
        raise ValueError(f"grid {text!r}: {exc}") from None


def default_grid(module: ModuleSpec) -> ProfileGrid:
    """A grid covering what the planner asks about the module (its modality's choice)."""
    return ProfileGrid(*modality_of(module).profile_grid(module))


@dataclass(frozen=True)
class ProfileConfig:
    """How to profile. `tensor_parallel`: TP size whose per-rank shard is timed. `layers`:
    layers in the timed stack (times are divided by it). `dtype`: "auto" is bfloat16 on a GPU,
    float32 on the CPU. `attention`: "auto" (Transformer Engine's THD attention when it imports,
    else our packed attention's automatic kernel), "te", "varlen" (torch's FlashAttention varlen
    kernel, CUDA) or "segments" (torch SDPA per segment): `resolve_attention`. `max_tokens`: skip
    grid points whose sub-microbatch holds more tokens. `time_budget_s`: skip the remaining points
    once profiling has run this long. `caption_tokens`: text tokens each DiT clip cross-attends to.
    """

    tensor_parallel: int = 1
    layers: int = 1
    dtype: str = "auto"
    attention: str = "auto"
    warmup: int = 2
    iters: int = 5
    max_tokens: int | None = None
    time_budget_s: float | None = None
    caption_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.layers < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("tensor_parallel, layers and iters must be >= 1, warmup >= 0")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
            )
        if self.dtype not in ("auto", "float32", "float64", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, float64, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.caption_tokens < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError("caption_tokens and max_tokens must be >= 1")

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if torch.cuda.is_available() else "float32"


# ---------------------------------------------------------------------------------------------
# Attention implementations


def resolve_attention(name: str) -> tuple[bool, str]:
    """(use Transformer Engine, packed attention kernel of `models.attention`) of an
    `attention` choice: "te" is Transformer Engine's THD attention, "varlen" / "segments" our
    `PackedAttention` with that kernel, "auto" TE when it imports, else our automatic kernel."""
    if name == "auto":
        return megatron_compat.transformer_engine_available(), "auto"
    if name == "te":
        megatron_compat.resolve_use_te(True)  # RuntimeError when TE does not import
        return True, "auto"
    return False, name


def attention_description(use_te: bool, kernel: str, *, device: torch.device) -> str:
    """What the profiled layers run as attention (the profile's "attention" field)."""
    if use_te and kernel == "auto":
        import transformer_engine

        return f"Transformer Engine {transformer_engine.__version__} (TEDotProductAttention, THD)"
    if kernel == "auto":
        kernel = "varlen" if device.type == "cuda" and attention.varlen_available() else "segments"
    what = {
        "varlen": "torch FlashAttention varlen_attn over the pack",
        "segments": "torch SDPA per segment",
    }[kernel]
    return f"megatron-dip PackedAttention: {what} (torch {torch.__version__})"


# ---------------------------------------------------------------------------------------------
# Building one TP rank's layers


def sharded_transformer_config(module: ModuleSpec, cfg: ProfileConfig, *, dtype: str):
    """`TransformerConfig` of one TP rank's shard of `module`'s layers, built at TP size 1."""
    lay, tp = module.layer, cfg.tensor_parallel
    for what, value in (("heads", lay.heads), ("kv_groups", lay.kv_groups), ("ffn", lay.ffn)):
        if value % tp:
            raise ValueError(
                f"module {module.name!r}: {what} {value} does not divide by tensor_parallel {tp}"
            )
    style = modality_of(module).layer_style(module)
    base = transformer_config(module, ModelConfig(dtype=dtype), shape=ONE_PROCESS, style=style)
    return dataclasses.replace(
        base,
        num_layers=cfg.layers,
        num_attention_heads=lay.heads // tp,
        num_query_groups=lay.kv_groups // tp,
        ffn_hidden_size=lay.ffn // tp,
        kv_channels=lay.head_dim,  # per-head size is unchanged by sharding over heads
    )


def build_layer_stack(
    module: ModuleSpec, tconfig, *, use_te: bool, kernel: str, groups: ModelGroups
) -> torch.nn.ModuleList:
    """`tconfig.num_layers` layers of `module`'s kind, as the model chunks build them (packed
    attention with `kernel`, `models.attention.packed_backend`)."""
    backend = attention.packed_backend(megatron_compat.layer_backend(use_te), kernel=kernel)
    modality = modality_of(module)
    return modality.layer_stack(
        module,
        tconfig=tconfig,
        backend=backend,
        groups=groups,
        start=0,
        end=tconfig.num_layers,
        causal=modality.causal,
    )


def _init_parameters(stack: torch.nn.Module, *, seed: int, std: float = 0.02) -> None:
    """Finite, realistic weights (the layers are built uninitialised): matrices N(0, std),
    norm weights 1, biases 0. Garbage memory could hold NaNs or denormals that skew timing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)


# ---------------------------------------------------------------------------------------------
# Inputs and timing


def _layer_runner(
    module: ModuleSpec, stack: torch.nn.ModuleList, *, tokens: int, instances: int, cfg, device
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """(run: hidden -> hidden through the stack, input hidden [S, 1, H]) for one grid point,
    with the packed-sequence parameters and side inputs the chunks give these layers (built
    once, outside timing)."""
    modality = modality_of(module)
    dtype = next(stack.parameters()).dtype
    batch, extra = modality.profile_batch(
        module, tokens=tokens, instances=instances, caption=cfg.caption_tokens
    )
    batch = batch.to(device)
    state = {name: _side_input(value, device, dtype) for name, value in extra.items()}
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    hidden = torch.randn(tokens * instances, 1, module.layer.hidden, generator=gen)
    hidden = hidden.to(device=device, dtype=dtype)

    def run(x: torch.Tensor) -> torch.Tensor:
        return modality.run_stack(
            module, stack, {**state, "hidden": x}, batch, rotary_base=module.arch.rotary_base
        )

    return run, hidden


def _side_input(value: torch.Tensor, device, dtype) -> torch.Tensor:
    """A side input on `device`; floating-point ones (conditioning from chunk 0's embedders)
    get a gradient, as in a chunk."""
    moved = value.detach().to(device)
    return moved.to(dtype).requires_grad_(True) if moved.is_floating_point() else moved


def time_forward_backward(
    run: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    *,
    warmup: int,
    iters: int,
) -> tuple[float, float]:
    """Median (forward, backward) milliseconds of `run(hidden)` and its backward: CUDA events
    on a GPU (after `warmup` untimed iterations), `time.perf_counter` on the CPU."""
    cuda = hidden.is_cuda
    grad = torch.randn_like(hidden)
    fwd, bwd = [], []
    for i in range(warmup + iters):
        x = hidden.detach().requires_grad_(True)  # a non-first chunk: input gradient computed
        for p in params:
            p.grad = None
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
            out = run(x)
            events[1].record()
            out.backward(grad)
            events[2].record()
            torch.cuda.synchronize()
            f, b = events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])
        else:
            t0 = time.perf_counter()
            out = run(x)
            t1 = time.perf_counter()
            out.backward(grad)
            t2 = time.perf_counter()
            f, b = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    return statistics.median(fwd), statistics.median(bwd)


# ---------------------------------------------------------------------------------------------
# Profiling modules and writing the profile


@dataclass
class _Run:
    """State shared by the modules of one profiling run."""

    cfg: ProfileConfig
    groups: ModelGroups
    device: torch.device
    use_te: bool
    kernel: str
    skipped: list
    deadline: float = math.inf  # time.monotonic() after which points are skipped

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


def _profile_module(module: ModuleSpec, grid: ProfileGrid, run: _Run) -> list[dict]:
    """Per-layer times of `module` at every grid point that fits the run's limits."""
    cfg = run.cfg
    tconfig = sharded_transformer_config(module, cfg, dtype=cfg.resolved_dtype)
    stack = build_layer_stack(
        module, tconfig, use_te=run.use_te, kernel=run.kernel, groups=run.groups
    )
    stack.to(device=run.device, dtype=torch_dtype(cfg.resolved_dtype))
    _init_parameters(stack, seed=cfg.seed)
    stack.train()
    params = [p for p in stack.parameters() if p.requires_grad]
    fitting = grid.points(cfg.max_tokens)
    for tokens, instances in grid.points():
        if (tokens, instances) not in fitting:
            run.skipped.append(_skip(module, tokens, instances, f"> max_tokens {cfg.max_tokens}"))
    points = []
    for tokens, instances in fitting:
        if run.out_of_time():
            run.skipped.append(_skip(module, tokens, instances, "time budget spent"))
            continue
        times = _time_point(module, stack, params, tokens=tokens, instances=instances, run=run)
        if times is None:
            continue
        fwd, bwd = (t / cfg.layers for t in times)
        point = {"tokens": tokens, "instances": instances, "forward_ms": fwd, "backward_ms": bwd}
        logger.info("%s: %s (per layer)", module.name, point)
        points.append(point)
    del stack
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    return points


def _time_point(module, stack, params, *, tokens: int, instances: int, run: _Run):
    """(forward, backward) ms of the whole stack at one grid point; None (and the point listed
    as skipped) when it does not fit in GPU memory."""
    try:
        fn, hidden = _layer_runner(
            module, stack, tokens=tokens, instances=instances, cfg=run.cfg, device=run.device
        )
        return time_forward_backward(fn, hidden, params, warmup=run.cfg.warmup, iters=run.cfg.iters)
    except torch.cuda.OutOfMemoryError:
        pass
    # Outside the handler, so that the traceback no longer holds the point's tensors. Larger
    # points will not fit either, but smaller instance counts of larger tokens may: go on.
    torch.cuda.empty_cache()
    run.skipped.append(_skip(module, tokens, instances, "out of GPU memory"))
    logger.warning("%s: %d x %d tokens: out of memory, skipped", module.name, instances, tokens)
    return None


def _skip(module: ModuleSpec, tokens: int, instances: int, why: str) -> dict:
    return {"module": module.name, "tokens": tokens, "instances": instances, "reason": why}


def software_versions() -> dict[str, str]:
    """Versions of what the times depend on (absent parts are left out)."""
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": ".".join(map(str, megatron_compat.megatron_core_version())),
    }
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    if torch.cuda.is_available() and torch.backends.cudnn.is_available():
        versions["cudnn"] = str(torch.backends.cudnn.version())
    if megatron_compat.transformer_engine_available():
        import transformer_engine

        versions["transformer_engine"] = transformer_engine.__version__
    return versions


def device_names() -> tuple[str, str]:
    """(short name: a `DeviceSpec` preset when one matches, full device name)."""
    if not torch.cuda.is_available():
        return "cpu", platform.processor() or platform.machine() or "cpu"
    full = torch.cuda.get_device_name()
    return match_device(full) or full, full


def _single_rank_group() -> tuple[dist.ProcessGroup, bool]:
    """A one-rank group for the layers (no collective runs at TP size 1); True if created here."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("profile in a single process: the layers run at TP size 1")
        return dist.group.WORLD, False
    import tempfile

    store = dist.FileStore(str(Path(tempfile.mkdtemp(prefix="megatron-dip-profile-")) / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD, True


def profile_model(
    model: MultimodalSpec,
    grids: Mapping[str, ProfileGrid],
    cfg: ProfileConfig,
    *,
    details: Mapping[str, object] | None = None,
) -> dict:
    """Profile the modules named in `grids`; the `megatron-dip-profile/1` document (a dict).

    Modules none of whose points could be timed are left out (and listed under
    details.skipped); RuntimeError when that leaves no module at all.
    """
    modules = [model.module(name) for name in grids]  # KeyError names an unknown module
    use_te, kernel = resolve_attention(cfg.attention)
    on_cpu = apply_cpu_fixes()
    megatron_compat.ensure_global_memory_buffer()
    seed_model_parallel_rng(cfg.seed)
    world, created = _single_rank_group()
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    run = _Run(cfg, ModelGroups(tp=world, cp=world), device, use_te, kernel, [])
    label = attention_description(use_te, kernel, device=device)
    # Each module's share of the time budget is proportional to its grid points; time a
    # module leaves unused passes to the next ones.
    sizes = [len(grids[m.name].points(cfg.max_tokens)) or 1 for m in modules]
    start, measured = time.monotonic(), {}
    try:
        for i, m in enumerate(modules):
            if cfg.time_budget_s is not None:
                run.deadline = start + cfg.time_budget_s * sum(sizes[: i + 1]) / sum(sizes)
            measured[m.name] = _profile_module(m, grids[m.name], run)
    finally:
        if created:
            dist.destroy_process_group()
    measured = {name: pts for name, pts in measured.items() if pts}
    if not measured:
        raise RuntimeError(f"no grid point could be timed: {run.skipped}")
    return _document(model, modules, run, label, measured, details or {})


def _document(model, modules, run: _Run, attention: str, measured: dict, details) -> dict:
    cfg, (short, full), tp = run.cfg, device_names(), run.cfg.tensor_parallel
    return {
        "format": PROFILE_FORMAT,
        "device": short,
        "software": software_versions(),
        "attention": attention,
        "tensor_parallel": tp,
        "dtype": cfg.resolved_dtype,
        "tp_comm_included": tp == 1,  # a shard timed alone has no collectives
        "details": {
            "device_name": full,
            "model": model.name,
            "timing": "cuda events" if run.device.type == "cuda" else "time.perf_counter",
            "warmup": cfg.warmup,
            "iters": cfg.iters,
            "statistic": "median",
            "layers_timed": cfg.layers,
            "per_rank_shapes": {m.name: _shard_shape(m, tp) for m in modules},
            "caption_tokens": cfg.caption_tokens,
            "sequence_parallel": False,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "skipped": run.skipped,
            **dict(details),
        },
        "modules": measured,
    }


def _shard_shape(module: ModuleSpec, tp: int) -> dict[str, int]:
    lay = module.layer
    return {
        "hidden": lay.hidden,
        "heads": lay.heads // tp,
        "kv_groups": lay.kv_groups // tp,
        "head_dim": lay.head_dim,
        "ffn": lay.ffn // tp,
    }


def write_profile(document: Mapping, path: str | Path) -> Path:
    """Write `document` as JSON to `path` and read it back with `load_profile` (raises if the
    result is not a valid profile)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    load_profile(path)
    return path
