"""Time real Megatron-Core layers into the cost model's profile (`--dip-cost-profile`).

    python tools/profile_costs.py --preset vlm-s --out tools/profiles/vlm-s-tp4-h200.json \\
        --grid vit=256,1024,2704,4096@1,2,4,8,12,16 --grid llm=1024,2048,4096,8192@1

For every module (`--modules`, default all of the preset's), builds its transformer layers at
the shapes one tensor-parallel rank holds (`--tensor-parallel`, default the paper setup's TP;
heads, key/value groups and FFN divided by it) and times one layer forward and backward on each
grid point: INSTANCES instances of TOKENS tokens packed into one sub-microbatch. The TP
collectives are not timed (one device): the profile says `tp_comm_included: false` and the cost
model adds its TP communication term. Transformer Engine layers (THD attention) when TE imports,
else the local spec with our packed attention (`--attention`: te, varlen = torch's FlashAttention
varlen kernel, segments = SDPA per segment). Works on the CPU too (slowly; dtype float32 there).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dip.models.presets import model_preset, preset_names
from megatron_dip.modelspec import PAPER_SETUPS

logger = logging.getLogger("profile_costs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; exits with status 2 naming the bad flag."""
    from megatron_dip.profiling import ATTENTION_CHOICES

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", required=True, help="model preset: " + ", ".join(preset_names()))
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--modules", help="comma list of modules to profile (default: all)")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="MODULE=TOKENS@INSTANCES",
        help="e.g. vit=256,1024@1,2,4 (repeatable; default grid per module kind)",
    )
    p.add_argument("--tensor-parallel", type=int, help="TP size (default: the setup's, else 1)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), ...")
    p.add_argument("--attention", default="auto", choices=ATTENTION_CHOICES)
    p.add_argument("--layers", type=int, default=1, help="layers in the timed stack")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-tokens", type=int, help="skip sub-microbatches of more tokens")
    p.add_argument("--time-budget-s", type=float, help="skip the remaining points after this")
    p.add_argument("--caption-tokens", type=int, default=256, help="DiT cross-attention length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from megatron_dip.profiling import ProfileConfig, default_grid, parse_grid

    if args.preset not in preset_names():
        p.error(f"--preset: unknown preset {args.preset!r}; known: {', '.join(preset_names())}")
    model = model_preset(args.preset)
    known = [m.name for m in model.modules]
    names = args.modules.split(",") if args.modules else known
    for name in names:
        if name not in known:
            p.error(f"--modules: {args.preset} has no module {name!r}; its modules: {known}")
    grids = {name: default_grid(model.module(name)) for name in names}
    for text in args.grid:
        name, sep, spec = text.partition("=")
        if not sep:
            p.error(f"--grid {text!r}: expected MODULE=TOKENS@INSTANCES, e.g. vit=256,1024@1,2")
        if name not in names:
            p.error(f"--grid {text!r}: module {name!r} is not profiled (modules: {names})")
        try:
            grids[name] = parse_grid(spec)
        except ValueError as exc:
            p.error(f"--grid {text!r}: {exc}")
    setup = PAPER_SETUPS.get(args.preset)
    tp = args.tensor_parallel
    if tp is None:
        tp = setup.tensor_parallel if setup else 1
    try:
        config = ProfileConfig(
            tensor_parallel=tp,
            layers=args.layers,
            dtype=args.dtype,
            attention=args.attention,
            warmup=args.warmup,
            iters=args.iters,
            max_tokens=args.max_tokens,
            time_budget_s=args.time_budget_s,
            caption_tokens=args.caption_tokens,
            seed=args.seed,
        )
    except ValueError as exc:
        p.error(f"bad profiling option: {exc}")
    for name in names:
        lay = model.module(name).layer
        if lay.heads % tp or lay.kv_groups % tp or lay.ffn % tp:
            p.error(
                f"--tensor-parallel {tp}: module {name!r} (heads {lay.heads}, kv groups "
                f"{lay.kv_groups}, ffn {lay.ffn}) does not divide by it"
            )
    args.model, args.grids, args.config = model, grids, config


def main(argv: list[str] | None = None) -> int:
    """Profile, write the JSON, log a summary; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    from megatron_dip.profiling import profile_model, write_profile

    command = ["tools/profile_costs.py", *(sys.argv[1:] if argv is None else argv)]
    document = profile_model(
        args.model, args.grids, args.config, details={"command": " ".join(command)}
    )
    path = write_profile(document, args.out)
    counts = {name: len(points) for name, points in document["modules"].items()}
    logger.info(
        "wrote %s: %s on %s (%s), points %s, skipped %d",
        path,
        document["attention"],
        document["details"]["device_name"],
        document["dtype"],
        counts,
        len(document["details"]["skipped"]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
