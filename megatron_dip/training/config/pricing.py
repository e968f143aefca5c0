"""What a run is priced on: the device, the kernels the chunks run, the cost model and the
runtime's host overheads, from the flags (torch-free but for the CUDA device query); part of
`validate.resolve`."""

from __future__ import annotations

import dataclasses
import logging

from megatron_dip import megatron_compat
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.cost_model import GPU_KERNELS, CostModel, Kernels
from megatron_dip.planner.devices import (
    DEVICE_NAMES,
    DeviceSpec,
    get_device,
    load_profile,
    match_device,
)
from megatron_dip.planner.overheads import NO_OVERHEADS, HostOverheads, load_overheads

from .arguments import TrainConfig
from .arguments import fail as _fail

logger = logging.getLogger(__name__)


def run_device(config: TrainConfig, *, cuda: bool) -> DeviceSpec:
    """The `DeviceSpec` the cost model prices on: --dip-device, else the CUDA device's preset
    (with its real memory); a GPU that is no preset only with a measured --dip-cost-profile."""
    name = config.dip.dip_device
    if name != "auto":
        return get_device(name)
    if not cuda:
        return get_device("H100")  # a CPU run plans (and emulates) for the paper's GPU
    import torch

    found = torch.cuda.get_device_name()
    memory = int(torch.cuda.get_device_properties(0).total_memory)
    preset = match_device(found)
    if preset is not None:
        return dataclasses.replace(get_device(preset), memory_bytes=memory)
    if config.dip.dip_cost_profile is None:
        raise _fail(
            "--dip-device",
            f"the CUDA device {found!r} is none of the presets {', '.join(DEVICE_NAMES)}: "
            "pricing it as one of them would plan with wrong times. Give a profile measured on "
            "it (--dip-cost-profile, written by scripts/profile_gpu.sh or tools/profile_costs.py) "
            "or name the closest preset with --dip-device NAME",
        )
    logger.warning(
        "CUDA device %r is no preset: layer times come from --dip-cost-profile, communication "
        "and memory-bound extras are priced at H100 rates",
        found,
    )
    return dataclasses.replace(get_device("H100"), name=found, memory_bytes=memory)


def run_kernels(
    config: TrainConfig, *, cuda: bool, dtype: str, emulate: bool, delay_wgrad: bool
) -> Kernels:
    """The kernels the chunks will run (their saved tensors differ), `delay_wgrad`: the chunks
    are built to queue weight GEMMs for W (`RunSpec.delays_weight_gradients`), which
    Transformer Engine's layers then do; an emulated run prices the GPU run it stands for."""
    from megatron_dip.models.kernels import resolve_kernels

    if emulate:
        return GPU_KERNELS
    attention = config.dip.dip_attention
    if attention == "varlen" and not (cuda and dtype == "bfloat16"):
        raise _fail("--dip-attention", "varlen (FlashAttention) needs CUDA and --bf16")
    kernel, fused = resolve_kernels(cuda=cuda, dtype=dtype, attention=attention)
    queued = cuda and megatron_compat.te_queues_weight_gradients(delay_wgrad, None)
    return Kernels(attention=kernel, fused_rms_norm=fused, te_delayed_wgrad=queued)


def run_cost_model(
    config: TrainConfig, model, device, *, shape: ParallelShape, kernels: Kernels
) -> CostModel:
    """The cost model of a TP rank of the run of `shape` (the real run's under
    --dip-emulate-compute: its TP, sequence parallelism and activation dtype)."""
    profile = None
    if config.dip.dip_cost_profile is not None:
        try:
            profile = load_profile(config.dip.dip_cost_profile)
            profile.check_compatible(shape)
        except ValueError as e:
            raise _fail("--dip-cost-profile", str(e)) from None
        unknown = (
            set(profile.modules) - {m.name for m in model.modules} - {m.kind for m in model.modules}
        )
        if unknown:
            raise _fail(
                "--dip-cost-profile",
                f"profile covers modules {sorted(unknown)} the model does not have",
            )
    return CostModel(
        model,
        device,
        shape=shape,
        dtype_bytes=2 if shape.dtype == "bfloat16" else 4,
        profile=profile,
        overheads=run_host_overheads(config),
        kernels=kernels,
    )


def run_host_overheads(config: TrainConfig) -> HostOverheads:
    """--dip-host-overheads: the measured host seconds of the run's runtime (DIP's executor, or
    Megatron's stock schedules where the file has their fit), in the run's time units (an
    emulated run plans in the preset's time: host seconds / --dip-emulate-scale; the zero-sleep
    floor, scale 0, keeps them as they are)."""
    path = config.dip.dip_host_overheads
    if path is None:
        return NO_OVERHEADS
    try:
        found = load_overheads(path)
    except ValueError as e:
        raise _fail("--dip-host-overheads", str(e)) from None
    stock = config.dip.dip_schedule != "dip" and found.stock is not None
    measured = found.stock if stock else found.dip
    scale = config.dip.dip_emulate_scale
    if config.dip.dip_emulate_compute and scale > 0:
        return measured.scaled(1.0 / scale)
    return measured
