"""Command-line flags, defined once: config dataclasses whose fields carry flag, type, default, help.

Each section (`ParallelArgs`, `ModelArgs`, ...) is a frozen dataclass; a field's metadata holds its
flag name, help text, choices and whether Megatron-LM defines the flag too (`megatron=True`).
The argparse parser is generated from these fields (`build_parser`), and the same fields turn an
argparse namespace into a `TrainConfig` (`TrainConfig.from_namespace`), so a flag can never be
parsed one way and read another. Argument destinations are Megatron-LM's (`--lr` -> `args.lr`), so
`extra_args_provider` can add only our own flags (the `--dip-*` ones and `--model`) to Megatron-LM's
parser and `TrainConfig.from_namespace(megatron_args)` reads the whole run from Megatron's namespace.

Fields whose default is None and whose help says "preset" are filled from the `--model` run preset
(`presets.py`) when not given; `validate.py` checks the combination before any process group exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_dip.planner.devices import DEVICE_NAMES
from megatron_dip.schedule.passes import RECEIVE_LEAD

from .megatron_args import (
    PRESET,
    ArchitectureArgs,
    CheckpointArgs,
    DataArgs,
    LoggingArgs,
    ModelArgs,
    ParallelArgs,
    TrainArgs,
    arg,
)

__all__ = [
    "PRESET",
    "ArchitectureArgs",
    "CheckpointArgs",
    "ConfigError",
    "DataArgs",
    "DipArgs",
    "LoggingArgs",
    "ModelArgs",
    "ParallelArgs",
    "TrainArgs",
    "TrainConfig",
    "arg",
    "build_parser",
    "fail",
    "extra_args_provider",
    "parse_config",
]


class ConfigError(ValueError):
    """A flag or combination of flags that cannot run; the message names the flag."""


def fail(flag: str, message: str) -> ConfigError:
    """The error for `flag`, its message starting with the flag."""
    return ConfigError(f"{flag}: {message}")


@dataclass(frozen=True)
class DipArgs:
    """DIP's own flags."""

    dip_schedule: str = arg(
        "--dip-schedule",
        "dip",
        "dip: planned per batch; 1f1b / interleaved: Megatron-Core's own schedules, encoder on "
        "the first stage (the baseline, same model and data)",
        choices=("dip", "1f1b", "interleaved"),
        megatron=False,
    )
    dip_segments: str | None = arg(
        "--dip-segments",
        None,
        "pipeline segments per module, e.g. vit=1,llm=2, or auto: chosen at start-up among "
        "segment counts and the static Megatron placements by simulated plans of the first "
        "batches (the default where the --model preset gives none; the log names the choice "
        "as a value of this flag, e.g. static:cost-split-v1 for a static placement)",
        megatron=False,
    )
    dip_sub_microbatch_size: str | None = arg(
        "--dip-sub-microbatch-size",
        None,
        "instances per sub-microbatch: N for every encoder module or vit=12,text=4 "
        "(default: smallest size at 95%% of peak efficiency)" + PRESET,
        megatron=False,
    )
    dip_search_time_ms: float = arg(
        "--dip-search-time-ms",
        2000.0,
        "schedule-search budget per batch (0: greedy plans only)",
        megatron=False,
    )
    dip_planner_workers: int = arg(
        "--dip-planner-workers", 1, "search processes (at most half the CPU cores)", megatron=False
    )
    dip_startup_workers: int = arg(
        "--dip-startup-workers",
        0,
        "processes scoring the start-up placement candidates on rank 0 while the other ranks "
        "wait (0: one per usable CPU core; the choice is the same for any count)",
        megatron=False,
    )
    dip_lookahead: int = arg(
        "--dip-lookahead",
        2,
        "batches planned ahead by the planner process (0: no planner process, plan inline)",
        megatron=False,
    )
    dip_receive_lead: int = arg(
        "--dip-receive-lead",
        RECEIVE_LEAD,
        "1: post each pipeline receive one compute earlier than one shared stream would allow, "
        "so that a message on the critical path travels while the rank still computes (the "
        "run's per-pair communicators make it safe; each receive buffer exists one compute "
        "earlier); 0: post as for one stream",
        megatron=False,
    )
    dip_split_backward: bool = arg(
        "--dip-split-backward",
        False,
        "split each backward into input and weight gradients and move the weight halves into "
        "the pipeline's bubbles where the cost model finds that faster within memory (exact; "
        "planning takes about twice as long)",
        megatron=False,
    )
    dip_split_search: bool = arg(
        "--dip-split-search",
        False,
        "with --dip-split-backward: search the segment order a second time, scored by split "
        "schedules (about 0.5 s more CPU per VLM-S plan; no faster order found on the paper's "
        "rows)",
        megatron=False,
    )
    dip_split_backward_always: bool = arg(
        "--dip-split-backward-always",
        False,
        "with --dip-split-backward: run the fastest split plan that fits even where the fused "
        "plan simulates faster (to measure the split backward's runtime against its simulation; "
        "never faster)",
        megatron=False,
    )
    dip_coarser_sub_microbatches: bool = arg(
        "--dip-coarser-sub-microbatches",
        False,
        "also plan each batch with 1.5 and 2 times the sub-microbatch sizes (rounded up, each "
        "a coarser cut than the one before: a size of 1 gives 2 and 3; larger encoder "
        "GEMMs, coarser units, more activations per stage) and keep the plan that simulates "
        "fastest within memory (planning takes up to about twice as long)",
        megatron=False,
    )
    dip_planner_timeout_s: float = arg(
        "--dip-planner-timeout-s",
        20.0,
        "a planner process silent for this many seconds (stopped, hung), or whose planning "
        "loop makes no progress for 3 times as long (deadlocked), or whose start-up takes 10 "
        "times as long, is killed and restarted (counted like a crash); iterations meanwhile "
        "are planned inline",
        megatron=False,
    )
    dip_memory_limit_gb: float | None = arg(
        "--dip-memory-limit-gb",
        None,
        "activation memory per pipeline rank the plans must respect, GiB: stored activations "
        "and pipeline message buffers (default: GPU memory minus weights and optimizer state; "
        "none on CPU)",
        megatron=False,
    )
    dip_offload_activations: bool = arg(
        "--dip-offload-activations",
        False,
        "let the memory pass also offload saved activations of some layers to pinned host "
        "memory (copied on a side stream during the forward, prefetched before the backward), "
        "priced on the GPU's share of its host link, where that is cheaper than recomputing",
        megatron=False,
    )
    dip_recompute_modules: bool = arg(
        "--dip-recompute-modules",
        False,
        "let the memory pass also recompute the cheap modules of a layer in backward (its norms, "
        "Megatron's recompute module 'layernorm', and its MLP activation): their outputs are not "
        "kept, a third to a half of a layer's activations for a few per cent of its forward",
        megatron=False,
    )
    dip_cost_profile: str | None = arg(
        "--dip-cost-profile",
        None,
        "measured per-layer profile JSON (megatron-dip-profile/1) for the cost model",
        megatron=False,
    )
    dip_host_overheads: str | None = arg(
        "--dip-host-overheads",
        None,
        "host seconds per compute instruction, posted p2p batch and message "
        "(megatron-dip-host-overheads/1 JSON, written by tools/measure_overhead.py): the "
        "planner trades segments and sub-microbatch sizes against them and the simulator "
        "charges them (default: none; with --dip-emulate-compute they are host seconds of the "
        "emulated run, divided by --dip-emulate-scale into the preset's time)",
        megatron=False,
    )
    dip_device: str = arg(
        "--dip-device",
        "auto",
        "accelerator the cost model prices on (auto: the CUDA device's name, refused when it is "
        "not a preset unless --dip-cost-profile is given; H100 on a CPU)",
        choices=("auto", *DEVICE_NAMES),
        megatron=False,
    )
    dip_attention: str = arg(
        "--dip-attention",
        "auto",
        "packed-sequence attention kernel: auto (Transformer Engine's THD attention with TE, "
        "else torch's FlashAttention varlen kernel on a GPU in 16-bit, else SDPA per segment), "
        "varlen (needs CUDA and --bf16), segments (SDPA per segment, the CPU's)",
        choices=("auto", "varlen", "segments"),
        megatron=False,
    )
    dip_trace_dir: str | None = arg(
        "--dip-trace-dir",
        None,
        "write Chrome/Perfetto traces of planned vs measured iterations here",
        megatron=False,
    )
    dip_trace_interval: int = arg(
        "--dip-trace-interval", 1, "iterations between traces", megatron=False
    )
    dip_data: str | None = arg(
        "--dip-data",
        None,
        "synthetic-MIXTURE (mixed, laion, obelics, text-only, t2v, t2i), llava:JSON, "
        "energon:PATH (a prepared dataset or a metadataset yaml) or latents:DIR" + PRESET,
        megatron=False,
    )
    dip_special_tokens: str | None = arg(
        "--dip-special-tokens",
        None,
        "with --tokenizer-type HuggingFaceTokenizer: ROLE=TOKEN,... for the roles pad, eos, bos, "
        "image, audio (default: the tokenizer's own; placeholders such as <|image_pad|> found "
        "by name)",
        megatron=False,
    )
    dip_image_processor: str | None = arg(
        "--dip-image-processor",
        None,
        "the vision model's preprocessor_config.json (or its directory): resize policy, "
        "min/max pixels, mean/std (default: mean/std 0.5, max pixels --dip-image-size squared)",
        megatron=False,
    )
    dip_max_pixels: int | None = arg(
        "--dip-max-pixels",
        None,
        "the one pixel limit of real images: larger ones are resized down to it (default: the "
        "processor config's, else --dip-image-size squared)",
        megatron=False,
    )
    dip_max_sample_tokens: int | None = arg(
        "--dip-max-sample-tokens",
        None,
        "tokens of one sample at most (default: --seq-length): longer ones are truncated with "
        "--dip-bad-samples truncate, else refused or skipped",
        megatron=False,
    )
    dip_energon_cooker: str | None = arg(
        "--dip-energon-cooker",
        None,
        "MODULE:NAME of cookers for crude Energon datasets (a function, an energon Cooker, a "
        "list of them or a TaskEncoder with cookers); the LLaVA cooker is built in",
        megatron=False,
    )
    dip_data_scale: float | None = arg(
        "--dip-data-scale",
        None,
        "shrink synthetic text and image sizes by this factor" + PRESET,
        megatron=False,
    )
    dip_image_size: int | None = arg(
        "--dip-image-size",
        None,
        "image side in pixels (synthetic); real images: --dip-max-pixels defaults to its square"
        + PRESET,
        megatron=False,
    )

    dip_stock_placement: str = arg(
        "--dip-stock-placement",
        "llava",
        "placement of the stock baselines: llava (encoder on the first stage, LLM split for the "
        "average batch), params (one layer list cut by parameters), cost (cut by cost)",
        choices=("llava", "params", "cost"),
        megatron=False,
    )
    dip_emulate_compute: bool = arg(
        "--dip-emulate-compute",
        False,
        "emulated cluster: chunks sleep the cost model's time for their real input at the "
        "preset's (paper) scale instead of computing; messages are tiny but take the cost "
        "model's transfer time (benchmarking on CPU, see tools/bench_schedules.py)",
        megatron=False,
    )
    dip_emulate_scale: float = arg(
        "--dip-emulate-scale",
        1.0,
        "with --dip-emulate-compute: multiply every emulated duration by this factor",
        megatron=False,
    )
    dip_comm_timeout_s: float = arg(
        "--dip-comm-timeout-s",
        600.0,
        "seconds any blocking pipeline wait may take before every rank stops with an error "
        "naming the rank, instruction, peer and tensor",
        megatron=False,
    )
    dip_calibration_window: int = arg(
        "--dip-calibration-window",
        8,
        "iterations of measured instruction times aggregated per cost-model calibration update",
        megatron=False,
    )
    dip_calibration_frozen: bool = arg(
        "--dip-calibration-frozen",
        False,
        "never recalibrate the cost model from measurements (plans depend only on seed, batch "
        "and the loaded cost model)",
        megatron=False,
    )
    dip_bad_samples: str = arg(
        "--dip-bad-samples",
        "error",
        "a sample that cannot be used (too many images, missing or corrupt image, caption "
        "longer than the sequence): error stops the run naming it; skip drops, counts and logs "
        "it; truncate cuts a too-long text to --dip-max-sample-tokens (images kept, else the "
        "sample is skipped) and skips the other bad samples",
        choices=("error", "skip", "truncate"),
        megatron=False,
    )
    dip_allow_outside_paths: bool = arg(
        "--dip-allow-outside-paths",
        False,
        "let image (and latent) paths of a llava:/latents: dataset lead outside its directory "
        "('../', absolute paths); without it such a record is bad (--dip-bad-samples)",
        megatron=False,
    )
    dip_max_nonfinite_iters: int = arg(
        "--dip-max-nonfinite-iters",
        3,
        "stop (non-zero exit, naming the iterations) after this many consecutive iterations "
        "whose loss or gradient norm is NaN or infinite (0: never stop)",
        megatron=False,
    )
    dip_log_blend: bool = arg(
        "--dip-log-blend",
        False,
        "add each Energon dataset's realised share of the samples drawn so far to the log line "
        "(the start-up log names each dataset of a metadataset with its weight and share)",
        megatron=False,
    )
    dip_metrics_json: str | None = arg(
        "--dip-metrics-json",
        None,
        "write per-iteration metrics (times, planned vs measured, plan variants) as JSON lines",
        megatron=False,
    )


SECTIONS: tuple[tuple[str, type], ...] = (
    ("parallel", ParallelArgs),
    ("model", ModelArgs),
    ("architecture", ArchitectureArgs),
    ("train", TrainArgs),
    ("data", DataArgs),
    ("checkpoint", CheckpointArgs),
    ("logging", LoggingArgs),
    ("dip", DipArgs),
)


@dataclass(frozen=True)
class TrainConfig:
    """Every flag of a run, by section."""

    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    architecture: ArchitectureArgs = field(default_factory=ArchitectureArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    data: DataArgs = field(default_factory=DataArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    dip: DipArgs = field(default_factory=DipArgs)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> TrainConfig:
        """Read every field from `ns` (ours or Megatron-LM's parsed arguments)."""
        sections = {}
        for name, section in SECTIONS:
            values = {f.name: getattr(ns, f.name, f.default) for f in dataclasses.fields(section)}
            sections[name] = section(**values)
        if getattr(ns, "group_query_attention", True) is False:
            # Megatron-LM's --num-query-groups (default 1) applies only with --group-query-attention
            sections["architecture"] = dataclasses.replace(
                sections["architecture"], num_query_groups=None
            )
        return cls(**sections)

    def replace(self, **flat: Any) -> TrainConfig:
        """A copy with fields changed by their flat (argparse destination) names."""
        changed = {}
        for name, section in SECTIONS:
            current = getattr(self, name)
            mine = {k: v for k, v in flat.items() if k in _field_names(section)}
            if mine:
                changed[name] = dataclasses.replace(current, **mine)
        unknown = set(flat) - {f for _, s in SECTIONS for f in _field_names(s)}
        if unknown:
            raise KeyError(f"unknown config fields {sorted(unknown)}")
        return dataclasses.replace(self, **changed)

    def flat(self) -> dict[str, Any]:
        """All fields by their argparse destination names."""
        return {
            k: v for name, _ in SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()
        }


def _field_names(section: type) -> set[str]:
    return {f.name for f in dataclasses.fields(section)}


def _scalar_type(annotation: Any) -> type:
    """int / float / str / bool from an annotation such as `int | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0]
    return annotation


def add_arguments(
    parser: argparse.ArgumentParser, *, include_megatron: bool = True
) -> argparse.ArgumentParser:
    """Add the flags of every section to `parser` (only ours when `include_megatron` is False)."""
    for name, section in SECTIONS:
        hints = typing.get_type_hints(section)
        fields = [
            f for f in dataclasses.fields(section) if include_megatron or not f.metadata["megatron"]
        ]
        if not fields:
            continue
        group = parser.add_argument_group(name, section.__doc__)
        for f in fields:
            meta = f.metadata
            kind = _scalar_type(hints[f.name])
            if kind is bool:
                group.add_argument(meta["flag"], action="store_true", help=meta["help"])
                continue
            text = meta["help"]
            if "(default" not in text:
                text += f" (default: {f.default})"
            group.add_argument(
                meta["flag"],
                type=kind,
                default=f.default,
                choices=meta["choices"],
                help=text,
                metavar=None if meta["choices"] else kind.__name__.upper(),
            )
    return parser


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider`: adds the flags Megatron-LM does not define."""
    return add_arguments(parser, include_megatron=False)


def build_parser(
    *, description: str = "", default_model: str | None = None
) -> argparse.ArgumentParser:
    """The full parser of our entry points (Megatron-LM's flag names plus ours)."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_arguments(parser)
    if default_model is not None:
        parser.set_defaults(model=default_model)
    return parser


def parse_config(
    argv: Sequence[str] | None = None, *, default_model: str | None = None
) -> TrainConfig:
    """Parse `argv` into a `TrainConfig` (presets are applied by `validate.resolve`)."""
    ns = build_parser(default_model=default_model).parse_args(argv)
    return TrainConfig.from_namespace(ns)
