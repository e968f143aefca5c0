"""The one place that knows the differences between megatron-core releases (0.16.1 and 0.19.x).

Import this module before anything imports `megatron.core`: on 0.19 without triton,
`import megatron.core` fails on an unguarded `import triton` in
`megatron/core/transformer/moe/ops/paged_stash.py` (pulled in by the pipeline schedules), and
this module puts a stand-in for that one kernel module into `sys.modules` first.

Differences handled here (feature-detected, not version-compared, where the API allows it):

* `get_forward_backward_func` gained a third argument `schedule_pg_collection` in 0.19;
* `backward_step` takes `model_type` in 0.16 only;
* 0.19 rejects `variable_seq_lengths=True` with the default MoE token dispatcher, even in dense
  models: `variable_seq_lengths_config()` adds `moe_token_dispatcher_type="alltoall"`;
* `TransformerConfig` defaults its CUDA graph coverage to "full" and then warns that "full" is
  deprecated, once per config built, in runs that use no CUDA graph (0.16: `cuda_graph_scope`;
  0.19: `cuda_graph_modules`, the scope's new name): `quiet_config_defaults()` passes the value
  the warning recommends instead (an empty list: the same meaning);
* layer specs: the Transformer Engine spec only when `transformer_engine` imports, else the
  local spec (`get_gpt_layer_local_spec`, `WrappedTorchNorm`); TE's delayed weight gradients
  (`delay_wgrad_compute`, TE >= 2.3) set past the config's MoE-only check
  (`delay_weight_gradients`);
* Megatron's scratch buffer for attention scores (`parallel_state`'s global memory buffer)
  exists only after `initialize_model_parallel`; `ensure_global_memory_buffer()` creates it;
* dist_checkpointing's torch_dist writer takes its results queue from a module global that it
  fills, at the first save, with a multiprocessing Manager queue (a server process that
  outlives a killed rank): `install_write_results_queue()` puts another queue there;
* 0.19 keeps the common state inside the torch_dist shards instead of `common.pt`:
  `common_state_file()` says which;
* 0.19's asynchronous save defaults to nvidia-resiliency-ext's writer: `async_save_kwargs()`
  selects Megatron-Core's own (the only one 0.16 has);
* dist_checkpointing reads and writes through multi-storage-client whenever that package
  imports (megatron-energon brings it), which also records metrics on every read; checkpoints
  here are POSIX paths: `use_posix_checkpoint_files()` turns it off (Megatron-LM's
  --disable-msc).
* Without CUDA, Megatron-Core's fused elementwise kernels (`megatron.core.jit.jit_fuser`, which is
  `torch.compile` on torch >= 2.2) would import torch's compiler stack (dynamo and inductor) at
  `import megatron.core`, about 5 s of CPU per process, for kernels that are fused only on GPUs:
  `EagerFusionsWithoutCuda` runs Megatron's own `disable_jit_fuser()` as that module loads, so the
  same functions run eagerly (the same arithmetic, unfused). With CUDA nothing changes.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
_STATE: dict[str, Any] = {}  # one-time warnings


def _megatron_dir() -> Path | None:
    """Directory of the `megatron` package that `import megatron.core` will use, found without
    importing it. `megatron` is a namespace package (megatron-energon adds `megatron/energon`):
    the first of its directories holding `core/` is the one Python imports `megatron.core` from."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / "core" / "__init__.py").exists():
            return Path(location)
    return None


def _unavailable_kernel(name: str) -> Any:
    class _Kernel:
        """A triton kernel that cannot run: triton is not installed."""

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"{name} needs triton, which is not installed")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name} needs triton, which is not installed")

    return _Kernel()


def install_triton_stand_in() -> bool:
    """Put a stand-in for megatron-core 0.19's paged-stash triton kernels into `sys.modules`.

    Only when triton is missing and the installed megatron-core has that module; the stand-in
    exports the same names, and its kernels raise if anything ever launches them (only MoE
    paged stashing does). Returns True when the stand-in is (now) installed.
    """
    if _PAGED_STASH in sys.modules:
        return getattr(sys.modules[_PAGED_STASH], "__megatron_dip_stand_in__", False)
    if importlib.util.find_spec("triton") is not None:
        return False
    root = _megatron_dir()
    if root is None or not (root / "core/transformer/moe/ops/paged_stash.py").exists():
        return False
    module = types.ModuleType(_PAGED_STASH, "Stand-in installed by megatron_dip: no triton.")
    module.GLOBAL_BLOCK_SIZE = 1024
    module.paged_stash_copy_kernel = _unavailable_kernel("paged_stash_copy_kernel")
    module.paged_stash_pop_kernel = _unavailable_kernel("paged_stash_pop_kernel")
    module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    module.__megatron_dip_stand_in__ = True
    sys.modules[_PAGED_STASH] = module
    logger.info("triton missing: installed a stand-in for %s", _PAGED_STASH)
    return True


_JIT = "megatron.core.jit"


class _DisableFuserAfterLoad(importlib.abc.Loader):
    """Loads `megatron.core.jit` with its own loader, then calls its `disable_jit_fuser()`
    before any module can decorate a function with the fuser."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        module.disable_jit_fuser()


class EagerFusionsWithoutCuda(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` on machines without CUDA and loads it with its fuser
    disabled (module docstring); defers to the normal import everywhere else."""

    def find_spec(
        self, fullname: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _JIT:
            return None
        import torch  # megatron.core.jit imports it first thing anyway

        if torch.cuda.is_available():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        if not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _DisableFuserAfterLoad(spec.loader)
        return spec


def install_eager_fusions_without_cuda() -> bool:
    """Put `EagerFusionsWithoutCuda` first on `sys.meta_path` (once); False when
    `megatron.core.jit` was imported already (its fused functions are compiled by then)."""
    if _JIT in sys.modules:
        return False
    if not any(isinstance(f, EagerFusionsWithoutCuda) for f in sys.meta_path):
        sys.meta_path.insert(0, EagerFusionsWithoutCuda())
    return True


# Must run before the first `import megatron.core` anywhere in the process.
install_triton_stand_in()
install_eager_fusions_without_cuda()


SUPPORTED_RANGE = ((0, 16, 1), (0, 20))  # megatron-core >= 0.16.1, < 0.20 (as setup.py)


def _version_tuple(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string: "0.19.2" -> (0, 19, 2), "0.16.0rc0" -> (0, 16, 0)."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts)


def _package_info_version(root: Path) -> tuple[int, ...] | None:
    """MAJOR.MINOR.PATCH read from `megatron/core/package_info.py` without importing it."""
    import ast

    try:
        tree = ast.parse((root / "core" / "package_info.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                values[target.id] = node.value.value
    if not all(isinstance(values.get(k), int) for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return (values["MAJOR"], values["MINOR"], values["PATCH"])


@functools.cache
def megatron_core_version() -> tuple[int, ...] | None:
    """The megatron-core version `import megatron.core` will load, e.g. (0, 16, 1); None when
    megatron-core is not installed.

    Read from that package's `package_info.py` (a Megatron-LM checkout on PYTHONPATH has no
    distribution metadata, and may shadow an installed wheel), else from the metadata.
    """
    import importlib.metadata  # local: ~15 ms, and importing this module must stay cheap

    root = _megatron_dir()
    if root is not None:
        version = _package_info_version(root)
        if version is not None:
            return version
    try:
        return _version_tuple(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


def check_megatron_core_version(version: tuple[int, ...] | None) -> None:
    """Raise ImportError for a megatron-core outside the supported range (None: not installed,
    which only the parts that use Megatron-Core notice)."""
    low, high = SUPPORTED_RANGE
    if version is None or low <= version < high:
        return
    found = ".".join(map(str, version))
    where = _megatron_dir()
    raise ImportError(
        f"megatron-dip supports megatron-core >= {'.'.join(map(str, low))}, < "
        f"{'.'.join(map(str, high))}; found {found}"
        + (f" at {where}" if where is not None else "")
        + ". Install a supported release (pip install 'megatron-core>=0.16.1,<0.20': 0.16.1 on "
        "Python 3.11, 0.19.x on Python 3.12)."
    )


# At `import megatron_dip`: a clear error instead of TypeErrors deep inside Megatron calls.
check_megatron_core_version(megatron_core_version())


@functools.cache
def transformer_engine_available() -> bool:
    """True when Transformer Engine's torch extension imports (never on a CPU-only machine)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from a broken CUDA build
        return False
    return True


#: The first Transformer Engine release whose layers take `delay_wgrad_compute`.
TE_DELAYED_WGRAD = "2.3.0"


def te_delays_weight_gradients() -> bool:
    """Whether the installed Transformer Engine can queue its layers' weight GEMMs for
    `backward_dw` (`delay_wgrad_compute`, TE >= 2.3; Megatron-Core's TE layers refuse the flag
    below that). False without Transformer Engine."""
    if not transformer_engine_available():
        return False
    from megatron.core.utils import is_te_min_version

    return is_te_min_version(TE_DELAYED_WGRAD)


def te_queues_weight_gradients(delay_wgrad: bool, use_te: bool | None) -> bool:
    """Whether chunks built with `ModelConfig(delay_wgrad, use_te)` have layers that queue
    their weight GEMMs for W: Transformer Engine layers (`resolve_use_te`) of a release that
    can (`te_delays_weight_gradients`). The one place the model builder and the cost model's
    kernels decide it."""
    return delay_wgrad and resolve_use_te(use_te) and te_delays_weight_gradients()


def delay_weight_gradients(tconfig) -> None:
    """Build Transformer Engine layers from `tconfig` with their weight GEMMs queued for
    `backward_dw` (a split backward's W, `runtime/delayed_wgrad.py`). Set after the config's
    own checks: its `__post_init__` allows `delay_wgrad_compute` only beside its MoE
    expert-parallel overlap (the one schedule that calls `backward_dw` in Megatron-Core); the
    TE layer wrappers read the field when they are built, and our executor makes the calls."""
    tconfig.delay_wgrad_compute = True


def resolve_use_te(use_te: bool | None) -> bool:
    """`use_te=None` means: Transformer Engine when it imports. Refuses True without it."""
    available = transformer_engine_available()
    if use_te is None:
        return available
    if use_te and not available:
        raise RuntimeError("use_te=True but transformer_engine does not import")
    return use_te


def tensor_parallel_random() -> types.ModuleType:
    """`megatron.core.tensor_parallel.random` (RNG tracker and seeding)."""
    from megatron.core.tensor_parallel import random

    return random


def get_forward_backward_func(
    *, pp_size: int | None = None, vp_size: int | None = None, schedule_pg_collection: Any = None
) -> Any:
    """Megatron's schedule selector; `schedule_pg_collection` is passed only where supported."""
    import inspect

    from megatron.core.pipeline_parallel import schedules

    params = inspect.signature(schedules.get_forward_backward_func).parameters
    if "schedule_pg_collection" in params:
        return schedules.get_forward_backward_func(
            pp_size=pp_size, vp_size=vp_size, schedule_pg_collection=schedule_pg_collection
        )
    if schedule_pg_collection is not None:
        raise TypeError(
            f"megatron-core {megatron_core_version()} has no schedule_pg_collection argument"
        )
    return schedules.get_forward_backward_func(pp_size=pp_size, vp_size=vp_size)


def process_group_collection(**groups: Any) -> Any:
    """Megatron's `ProcessGroupCollection` holding exactly `groups` (e.g. `tp=..., pp=...`).

    The explicit-groups mechanism of 0.16.1 and 0.19.x alike (schedules, DDP, optimizer and
    layers read their groups from it instead of `parallel_state`). A name this megatron-core
    does not know raises ValueError. A group not given is unset: 0.16 raises AttributeError
    when Megatron reads it, 0.19 returns None.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(**groups)


def pipeline_communicator(pp_group: Any, config: Any) -> Any:
    """Megatron's `P2PCommunicator` over `pp_group` (the stock schedules' `p2p_communicator`)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return P2PCommunicator(pp_group=pp_group, config=config)


def backward_step(
    input_tensor: Any,
    output_tensor: Any,
    output_tensor_grad: Any,
    *,
    config: Any,
    model_type: Any = None,
) -> Any:
    """Megatron's `backward_step`; `model_type` (0.16 only) defaults to encoder_or_decoder."""
    import inspect

    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules

    if "model_type" in inspect.signature(schedules.backward_step).parameters:
        model_type = ModelType.encoder_or_decoder if model_type is None else model_type
        return schedules.backward_step(
            input_tensor, output_tensor, output_tensor_grad, model_type, config
        )
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def variable_seq_lengths_config() -> dict[str, Any]:
    """TransformerConfig keyword arguments for variable sequence lengths between microbatches.

    0.19 validates the MoE dispatcher even for dense models and accepts only "alltoall" (or
    "flex") with variable sequence lengths; 0.16 does not check.
    """
    kwargs: dict[str, Any] = {"variable_seq_lengths": True}
    if megatron_core_version() >= (0, 19):
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    return kwargs


def quiet_config_defaults() -> dict[str, Any]:
    """TransformerConfig keyword arguments that replace a release's default that warns about
    itself (module docstring): a CUDA graph coverage field defaulting to "full" becomes the empty
    list its deprecation warning asks for (0.16's `cuda_graph_scope`, 0.19's
    `cuda_graph_modules`)."""
    from megatron.core.transformer import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    return {
        name: []
        for name in ("cuda_graph_scope", "cuda_graph_modules")
        if name in fields and fields[name].default == "full"
    }


def ensure_global_memory_buffer() -> None:
    """Create Megatron's global scratch buffer (used by the local DotProductAttention) if absent.

    `initialize_model_parallel` creates it; chunks built without it (single-process reference
    runs, tests) need it too. It allocates on `torch.cuda.current_device()`.
    """
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


@dataclass(frozen=True)
class LayerBackend:
    """Megatron-Core building blocks of one backend (local or Transformer Engine).

    `gpt_layer_spec(normalization)` is Megatron's own GPT layer spec; the rest are the unfused
    parts the DiT layer composes (its adaptive norm sits between norm and linear, so the
    fused norm+linear of the TE GPT spec cannot be used there).
    """

    use_te: bool
    column_linear: Any
    row_linear: Any
    core_attention: Any
    norm: Any

    def gpt_layer_spec(self, *, normalization: str) -> Any:
        """Megatron's GPT layer spec (dense, no MoE) for this backend."""
        from megatron.core.models.gpt import gpt_layer_specs

        if self.use_te:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        return gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)


@functools.cache
def layer_backend(use_te: bool) -> LayerBackend:
    """The building blocks of the Transformer Engine backend (use_te) or the local one."""
    if use_te:
        from megatron.core.extensions import transformer_engine as te

        return LayerBackend(
            use_te=True,
            column_linear=te.TEColumnParallelLinear,
            row_linear=te.TERowParallelLinear,
            core_attention=te.TEDotProductAttention,
            norm=te.TENorm,
        )
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return LayerBackend(
        use_te=False,
        column_linear=ColumnParallelLinear,
        row_linear=RowParallelLinear,
        core_attention=DotProductAttention,
        norm=WrappedTorchNorm,
    )


def install_write_results_queue(results_queue: Any) -> bool:
    """Make dist_checkpointing's torch_dist writer (`FileSystemWriterAsync`, 0.16-0.19) put its
    write results into `results_queue` (`put` / `get_nowait`) instead of the queue of the
    Manager server process it spawns otherwise. Returns False (and logs once) where the
    installed megatron-core keeps the queue elsewhere: saving then works as Megatron's does."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # The getter that fills the global: `_get_write_results_queue` (0.16),
    # `get_write_results_queue` (0.19).
    getter = any(
        hasattr(filesystem_async, name)
        for name in ("_get_write_results_queue", "get_write_results_queue")
    )
    if not getter or not hasattr(filesystem_async, "_results_queue"):
        if not _STATE.get("results_queue_warned"):
            logger.warning(
                "this megatron-core keeps dist_checkpointing's write results elsewhere: its "
                "Manager process stays (it may outlive a killed rank)"
            )
            _STATE["results_queue_warned"] = True
        return False
    filesystem_async._results_queue = results_queue
    return True


def record_write_errors() -> list[BaseException]:
    """Keep the exception of each failed write bucket of dist_checkpointing's torch_dist writer
    in the returned list (this process's; emptied by the caller), whatever the writer makes of
    it. 0.19's multithreaded writer replaces it by a RuntimeError that names only its type,
    losing the errno (no space left, permission) that the failed-save line must name; 0.16's
    carries it. Wraps `FileSystemWriterAsync.write_preloaded_data` (both releases) once."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    errors = _STATE.setdefault("write_errors", [])
    write = FileSystemWriterAsync.write_preloaded_data
    if getattr(write, "records_errors", False):
        return errors

    def write_recording_errors(*args, **kwargs):
        output = write(*args, **kwargs)  # (bucket index, results or the exception) or None
        if isinstance(output, tuple) and isinstance(output[-1], BaseException):
            errors.append(output[-1])
        return output

    write_recording_errors.records_errors = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_recording_errors)
    return errors


def async_save_kwargs() -> dict[str, Any]:
    """Keyword arguments for `dist_checkpointing.save(..., async_sharded_save=True)` that select
    Megatron-Core's own asynchronous writer (`FileSystemWriterAsync` in a forked process).

    0.19 added `async_strategy`, defaulting to "nvrx" (nvidia-resiliency-ext, which raises
    ModuleNotFoundError where that package is missing); "mcore" is the writer 0.16 always uses
    and the one `install_write_results_queue` redirects.
    """
    import inspect

    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


def common_state_file() -> str | None:
    """The file in which `dist_checkpointing.save` writes the common (non-sharded) state:
    "common.pt" (rank 0, through 0.16), or None where it is one more object in the torch_dist
    shards (0.19; `dist_checkpointing.load_common_state_dict` reads either)."""
    from megatron.core.dist_checkpointing import serialization

    if hasattr(serialization, "_legacy_common_state_exists"):  # the reader of both layouts
        return None
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    return COMMON_STATE_FNAME


def use_posix_checkpoint_files() -> None:
    """Make dist_checkpointing read and write checkpoint files with plain file I/O rather
    than through multi-storage-client (module docstring)."""
    try:
        from megatron.core.msc_utils import MultiStorageClientFeature
    except ImportError:  # a release without the feature: plain files already
        return
    MultiStorageClientFeature.disable()
