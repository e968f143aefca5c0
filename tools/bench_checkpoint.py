"""Measure checkpoint save and load: time and peak host memory per rank, on N gloo processes.

    python tools/bench_checkpoint.py --nproc 4 --hidden 768 --tp 2 --pp 1 --distributed-optimizer
    python tools/bench_checkpoint.py ... --old-tree /tmp/old   # also the previous format

Launches torchrun (gloo, CPU) once per code tree: this repository, and with --old-tree a copy
of an older megatron-dip tree (e.g. `git archive 7119e34 | tar -x -C /tmp/old`, the last commit
before checkpoints moved to dist_checkpointing) whose `training.checkpoint.state.save/load` take the
same arguments. Each run builds the `tiny-vlm` preset widened to --hidden (ViT and LLM, --layers
each), takes one optimizer step on random gradients (so Adam's moments exist), then saves and
loads one checkpoint. Per rank it reports the wall time of save and load (between barriers) and
the peak host memory while they run: the rank's resident set plus the unique memory of its
child processes (the forked checkpoint writers), sampled every 5 ms, and that peak above the
rank's memory before the save. Prints a table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks)")
    p.add_argument("--hidden", type=int, default=768, help="hidden size of the ViT and the LLM")
    p.add_argument("--layers", type=int, default=8, help="layers of the ViT and of the LLM")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--old-tree", default=None, help="an older megatron-dip tree to compare with")
    p.add_argument(
        "--dir", default=None, help="keep the checkpoints here (default: a temporary directory)"
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # torchrun's ranks
    return p.parse_args(argv)


class PeakMemory:
    """The peak of (this process's RSS + its children's unique memory) while in the block."""

    def __init__(self) -> None:
        import psutil

        self.me = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> int:
        import psutil

        total = self.me.memory_info().rss
        for child in self.me.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # a writer that just exited
                total += child.memory_full_info().uss
        return total

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)

    def __enter__(self) -> PeakMemory:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _spec(args: argparse.Namespace, world: int):
    from megatron_dip.modelspec import tiny_vlm
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.validate import resolve

    dp = world // (args.tp * args.pp)
    flags = [
        "--model", "tiny-vlm", "--train-iters", "10", "--lr", "1e-4", "--dip-schedule", "1f1b",
        "--global-batch-size", str(dp * args.pp), "--tensor-model-parallel-size", str(args.tp),
        "--pipeline-model-parallel-size", str(args.pp), "--num-layers", str(args.layers),
        "--encoder-num-layers", str(args.layers), "--clip-grad", "0",
    ]  # fmt: skip
    if args.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    spec = resolve(parse_config(flags), world_size=world, cuda=False)
    wide = tiny_vlm(vit_layers=args.layers, llm_layers=args.layers, hidden=args.hidden)
    return dataclasses.replace(spec, model=wide)


def _step_once(model, optimizer) -> None:
    """One update on random gradients, so the optimizer holds Adam's moments."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for _, p in model.named_parameters():
        grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-3
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.copy_(grad)
        else:
            p.grad = grad
    optimizer.step()


def _timed(fn) -> tuple[float, PeakMemory]:
    import torch.distributed as dist

    dist.barrier()
    with PeakMemory() as memory:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    return seconds, memory


def worker(args: argparse.Namespace) -> None:
    """One rank (under torchrun): build, step, save, load, report."""
    import torch.distributed as dist

    from megatron_dip.training.assembly.backend import select_backend
    from megatron_dip.training.assembly.build import build_model
    from megatron_dip.training.assembly.optim import build_optimizer, build_scheduler
    from megatron_dip.training.assembly.setup import initialize
    from megatron_dip.training.checkpoint import state as checkpoint

    logging.basicConfig(level=logging.WARNING)
    spec = _spec(args, int(os.environ["WORLD_SIZE"]))
    ctx = initialize(spec)
    model = build_model(spec, ctx, backend=select_backend(spec))
    optimizer = build_optimizer(model, spec=spec, ctx=ctx)
    scheduler = build_scheduler(optimizer, spec=spec)
    _step_once(model, optimizer)
    weights = sum(p.numel() * p.element_size() for _, p in model.named_parameters())
    before = PeakMemory().now()
    root = Path(args.dir)
    state = {"stream_state": {}, "calibration": {}, "consumed_samples": 0}
    parts = {"spec": spec, "ctx": ctx, "model": model, "optimizer": optimizer}
    save_s, save_mem = _timed(
        lambda: checkpoint.save(root, iteration=1, scheduler=scheduler, **state, **parts)
    )
    path = root / "iter_0000001"
    load_s, load_mem = _timed(lambda: checkpoint.load(path, scheduler=scheduler, **parts))
    mine = {
        "rank": ctx.rank, "weights_mib": weights / MIB, "before_mib": before / MIB,
        "save_s": save_s, "save_peak_mib": save_mem.peak / MIB,
        "load_s": load_s, "load_peak_mib": load_mem.peak / MIB,
        "bytes_on_disk": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
    }  # fmt: skip
    found = [None] * ctx.world_size
    dist.all_gather_object(found, mine)
    if ctx.rank == 0:
        Path(args.worker).write_text(json.dumps(found))
    ctx.destroy()


def launch(args: argparse.Namespace, tree: Path, label: str) -> list[dict]:
    """Run the workers with torchrun against the megatron-dip code in `tree`."""
    out = Path(tempfile.mkdtemp(prefix=f"bench-ckpt-{label}-"))
    directory = Path(args.dir or out) / label
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(args.nproc), str(Path(__file__).resolve()),
        "--worker", str(out / "result.json"), "--dir", str(directory),
        "--hidden", str(args.hidden), "--layers", str(args.layers),
        "--tp", str(args.tp), "--pp", str(args.pp),
    ] + (["--distributed-optimizer"] if args.distributed_optimizer else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    try:
        subprocess.run(command, check=True, env=env)
        return json.loads((out / "result.json").read_text())
    finally:  # the checkpoints stay only under an explicit --dir
        shutil.rmtree(out, ignore_errors=True)


def table(results: dict[str, list[dict]]) -> str:
    head = (
        f"{'format':<8}{'rank':>5}{'weights':>10}{'save s':>9}{'peak MiB':>10}{'+MiB':>8}"
        f"{'load s':>9}{'peak MiB':>10}{'+MiB':>8}{'on disk MiB':>13}"
    )
    lines = [head]
    for label, ranks in results.items():
        for r in ranks:
            lines.append(
                f"{label:<8}{r['rank']:>5}{r['weights_mib']:>10.1f}{r['save_s']:>9.2f}"
                f"{r['save_peak_mib']:>10.0f}{r['save_peak_mib'] - r['before_mib']:>8.0f}"
                f"{r['load_s']:>9.2f}{r['load_peak_mib']:>10.0f}"
                f"{r['load_peak_mib'] - r['before_mib']:>8.0f}"
                f"{r['bytes_on_disk'] / MIB:>13.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    trees = {"new": ROOT}
    if args.old_tree:
        trees["old"] = Path(args.old_tree).resolve()
    results = {label: launch(args, tree, label) for label, tree in trees.items()}
    sys.stdout.write(table(results) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
