"""Helpers, no tests: the training runs of `test_training_dist.py`, executed one after the other
inside the same 4 gloo worker processes (targets of `distributed_harness.run_world`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path

SLOW_PLANNER_S = 5.0  # per plan: later than the iterations that need them
COMMON = [
    "--model", "tiny-vlm", "--global-batch-size", "4", "--dip-image-size", "32",
    "--lr", "3e-3", "--lr-decay-iters", "20", "--log-interval", "5", "--seed", "7",
]  # fmt: skip


def run(argv: list[str], *, world_size: int, planner_faults=None) -> dict:
    """Parse, validate and train one run on this rank; the numbers the tests compare.
    `planner_faults`: a `PlannerFaults` for the planner process (tests only, no flag)."""
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.validate import resolve
    from megatron_dip.training.iteration.loop import pretrain

    spec = resolve(parse_config(argv), world_size=world_size, cuda=False)
    if planner_faults is not None:
        spec = dataclasses.replace(spec, planner_faults=planner_faults)
    result = pretrain(spec)
    return {
        "losses": dict(result.losses),
        "grad_norms": dict(result.grad_norms),
        "eval": dict(result.eval_losses),
        "seconds": dict(result.seconds),
        "consumed": dict(result.consumed),
        "planned": dict(result.planned),
        "bound": dict(result.bound_efficiency),
        "variants": dict(result.variants),
        "first": result.first_iteration,
        "last": result.last_iteration,
        "checkpoints": list(result.checkpoints),
        "cost_error": dict(result.cost_error),
        "cost_ratio": dict(result.cost_ratio),
        "plan_calibration": dict(result.plan_calibration),
        "calibration": dict(result.calibration),
    }


def world4(
    *,
    rank: int,
    world_size: int,
    data: str,
    tmp: str,
    bad_data: str,
    energon: str,
    tokenizer: str,
    hf_llama: str,
    hf_qwen2_vl: str,
) -> dict:
    """DIP at PP=2 x DP=2 for 20 iterations with the planner process, checkpoints (saved in the
    background), evaluation and traces; then resume at iteration 3 (same layout and at PP=4);
    then the stock schedules; an Energon dataset with a Hugging Face tokenizer, saved and
    resumed."""

    from megatron_dip.training.checkpoint import storage

    # The trainer's planner service is a child process: the fixture runs non-daemonic workers.
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("megatron_dip.planner.service").setLevel(logging.ERROR)
    ckpt, traces = os.path.join(tmp, "ckpt"), os.path.join(tmp, "traces")
    data_flags = ["--dip-data", f"llava:{data}"]
    base = COMMON + data_flags
    out = {}
    out["dip"] = run(
        base + [
            "--pipeline-model-parallel-size", "2", "--train-iters", "20",
            "--dip-lookahead", "2", "--dip-search-time-ms", "100",
            "--save", ckpt, "--save-interval", "3", "--async-save",  # written in the background
            "--eval-interval", "2", "--eval-iters", "1",
            "--dip-trace-dir", traces, "--dip-trace-interval", "10",
        ],
        world_size=world_size,
    )  # fmt: skip
    # Runs compared with "dip" freeze the calibration ("dip" itself first recalibrates at
    # iteration 9: warm-up iteration 1, then the default window of 8; after all they compare).
    resume = [
        "--load", ckpt, "--ckpt-step", "3", "--dip-lookahead", "0", "--dip-calibration-frozen",
    ]  # fmt: skip
    out["resume"] = run(
        base
        + resume
        + ["--pipeline-model-parallel-size", "2", "--train-iters", "6"]
        + ["--eval-interval", "2", "--eval-iters", "1"],  # the eval stream resumes too
        world_size=world_size,
    )
    out["relayout"] = run(
        base + resume + ["--pipeline-model-parallel-size", "4", "--train-iters", "4"],
        world_size=world_size,
    )
    out.update(schedule_switch_runs(base, resume, ckpt=ckpt, tmp=tmp, world_size=world_size))
    # Megatron's interleaved schedule at a virtual pipeline size other than its usual 2 (the
    # distributed tests run 2): the reference of the stock runs below.
    out["interleaved"] = run(
        base + [
            "--pipeline-model-parallel-size", "2", "--train-iters", "3",
            "--dip-schedule", "interleaved", "--num-virtual-stages-per-pipeline-rank", "3",
        ],
        world_size=world_size,
    )  # fmt: skip
    # The start-up placement search (DIP segment counts and static Megatron placements), with
    # the planner process planning on the chosen placement.
    out["auto_placement"] = run(
        base + [
            "--pipeline-model-parallel-size", "2", "--train-iters", "2", "--dip-segments", "auto",
            "--dip-lookahead", "1", "--dip-search-time-ms", "0",
        ],
        world_size=world_size,
    )  # fmt: skip
    out["shared_sizing"] = shared_sizing_run()
    out.update(planner_fault_runs(base, world_size=world_size))
    out.update(optimizer_and_baseline_runs(base, tmp=tmp, world_size=world_size))
    out.update(bf16_runs(base, tmp=tmp, world_size=world_size))
    out["t2v"] = run(
        ["--model", "tiny-t2v", "--pipeline-model-parallel-size", "2", "--train-iters", "2",
         "--lr", "1e-3", "--dip-lookahead", "0", "--global-batch-size", "2"],
        world_size=world_size,
    )  # fmt: skip
    # Three modalities (ViT and audio encoder feeding the LLM), each on its own segments.
    out["omni"] = run(
        ["--model", "tiny-omni", "--pipeline-model-parallel-size", "2", "--train-iters", "8",
         "--lr", "3e-3", "--dip-lookahead", "0", "--global-batch-size", "4", "--seed", "7"],
        world_size=world_size,
    )  # fmt: skip
    out.update(emulated_runs(tmp=tmp, world_size=world_size, rank=rank))
    out.update(energon_runs(energon=energon, tokenizer=tokenizer, tmp=tmp, world_size=world_size))
    out.update(checkpoint_fault_runs(base, ckpt=ckpt, tmp=tmp, rank=rank, world_size=world_size))
    out.update(kept_history_runs(base, ckpt=ckpt, tmp=tmp, rank=rank, world_size=world_size))
    out.update(finetune_runs(base, hf=hf_llama, tmp=tmp, world_size=world_size))
    out.update(qwen2_vl_runs(base, hf=hf_qwen2_vl, tmp=tmp, world_size=world_size))
    out.update(tied_embedding_runs(base, world_size=world_size))
    out["overhead"] = overhead_measurement(world_size=world_size, rank=rank)
    out["decode"] = decode_failure_run(COMMON + ["--dip-data", f"llava:{bad_data}"], world_size)
    out["decode_skip"] = decode_skip_run(COMMON + ["--dip-data", f"llava:{bad_data}"], world_size)
    out["disagree"] = disagreeing_batch_error(rank)
    if rank == 0:
        out["trace_files"] = sorted(p.name for p in Path(traces).glob("*.json"))
        events = json.loads(Path(traces, out["trace_files"][-1]).read_text())["traceEvents"]
        out["trace_processes"] = sorted(
            e["args"]["name"] for e in events if e.get("name") == "process_name"
        )
        out["trace_spans"] = sum(e.get("ph") == "X" for e in events)
        out["ckpt_dirs"] = sorted(p.name for p in Path(ckpt).iterdir())
        common = storage.load_common(Path(ckpt, "iter_0000003"))
        out["ckpt3_calibration"] = common["training"]["calibration"]
    return out


@contextlib.contextmanager
def _captured_log():
    """The messages of our loggers while the block runs: planner warnings and log lines."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    loggers = [logging.getLogger(n) for n in ("megatron_dip.planner.service", "megatron_dip")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
    loggers[1].addHandler(handler)
    try:
        yield records
    finally:
        loggers[1].removeHandler(handler)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def shared_sizing_run() -> dict:
    """`setup.shared_by_rank0`, as the entry point sizes a job: computed on rank 0 alone and
    handed to every rank; rank 0's configuration error raised on every rank."""
    import torch.distributed as dist

    from megatron_dip.training.assembly.setup import shared_by_rank0
    from megatron_dip.training.config.arguments import ConfigError

    calls = []

    def compute() -> dict:
        calls.append(dist.get_rank())
        return {"placement": "static:cost-split-v1", "by": dist.get_rank()}

    def refuse() -> None:
        raise ConfigError("--dip-segments: refused on rank 0")

    def slow() -> str:
        time.sleep(3.0)
        return "late"

    got = shared_by_rank0(compute, cuda=False, timeout_s=60.0, startup_timeout_s=60.0)
    try:
        shared_by_rank0(refuse, cuda=False, timeout_s=60.0, startup_timeout_s=60.0)
        error = None
    except ConfigError as e:
        error = str(e)
    # --distributed-timeout-minutes bounds the wait for rank 0 (0.5 s here), whatever the
    # pipeline's timeout; rank 0 itself may or may not notice that nobody listened.
    try:
        late = shared_by_rank0(slow, cuda=False, timeout_s=60.0, startup_timeout_s=0.5)
    except RuntimeError as e:
        late = str(e)
    dist.barrier()
    return {"got": got, "calls": calls, "error": error, "late": late}


def planner_fault_runs(base: list[str], *, world_size: int) -> dict:
    """Greedy plans only (no search), so a plan is the same whether the planner process made it
    or the ranks inline: a run without a planner process, then runs whose planner is killed,
    slow, or raises (late iterations: rank 0's shared fallback). Each returns its log."""
    from megatron_dip.planner.service import PlannerFaults

    flags = base + [
        "--pipeline-model-parallel-size", "2", "--train-iters", "5",
        "--dip-search-time-ms", "0", "--dip-calibration-frozen",
    ]  # fmt: skip
    out = {"undisturbed": run(flags + ["--dip-lookahead", "0"], world_size=world_size)}
    faults = {
        "killed": PlannerFaults(kill_at_iteration=2),
        "slow": PlannerFaults(delay_s=SLOW_PLANNER_S),
        "raises": PlannerFaults(raise_at_iteration=0),
        "stopped": PlannerFaults(stop_at_iteration=2),  # SIGSTOP: found by its heartbeat
    }
    for name, fault in faults.items():
        extra = ["--dip-planner-timeout-s", "1"] if name == "stopped" else []
        with _captured_log() as messages:
            out[name] = run(
                flags + ["--dip-lookahead", "2", *extra],
                world_size=world_size,
                planner_faults=fault,
            )
        out[name]["log"] = list(messages)
    return out


def optimizer_and_baseline_runs(base: list[str], *, tmp: str, world_size: int) -> dict:
    """Per-token loss (an objective independent of how plans pack and place microbatches, so
    runs of different layouts train identically): --use-distributed-optimizer at PP=2 x DP=2
    for 5 iterations saving every 2; resumed from iteration 2; its iteration-2 checkpoint
    stepped once by the plain optimizer at PP=1 x DP=4 and saved; that loaded with the
    distributed optimizer for 2 more. PP=2 x TP=2 for 5 iterations, its iteration-3 checkpoint
    continued at PP=2 x TP=1 x DP=2. Megatron's 1F1B at PP=2 x DP=2 with Megatron's block
    recomputation of 2 layers per stage and the DP reduction overlapped through Megatron's DDP
    hooks."""
    dist_ckpt, plain_ckpt, tp_ckpt = (os.path.join(tmp, d) for d in ("dopt", "plain", "tp2"))
    flags = base + ["--dip-lookahead", "0", "--dip-calibration-frozen"]
    flags += ["--calculate-per-token-loss"]
    pp2 = flags + ["--pipeline-model-parallel-size", "2"]
    distopt = pp2 + ["--use-distributed-optimizer"]
    out = {}
    for name, argv in {
        "distopt": distopt + ["--train-iters", "5", "--save", dist_ckpt, "--save-interval", "2"],
        "distopt_resume": distopt + ["--train-iters", "5", "--load", dist_ckpt, "--ckpt-step", "2"],
        "distopt_to_plain": flags  # PP=1 x DP=4: torch's AdamW takes the gathered state
        + ["--train-iters", "3", "--load", dist_ckpt, "--ckpt-step", "2", "--save", plain_ckpt],
        "plain_to_distopt": distopt + ["--train-iters", "5", "--load", plain_ckpt],
        "tp2": pp2
        + ["--tensor-model-parallel-size", "2", "--train-iters", "5", "--save", tp_ckpt]
        + ["--save-interval", "3"],
        "tp2_to_tp1": pp2 + ["--train-iters", "5", "--load", tp_ckpt, "--ckpt-step", "3"],
        "1f1b_overlap": base
        + [
            "--pipeline-model-parallel-size",
            "2",
            "--train-iters",
            "3",
            "--dip-schedule",
            "1f1b",
            "--overlap-grad-reduce",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "2",
        ],
    }.items():
        out[name] = run(argv, world_size=world_size)
    return out


def finetune_runs(base: list[str], *, hf: str, tmp: str, world_size: int) -> dict:
    """A Hugging Face Llama imported at TP=2 x PP=2 by the 4 ranks (each reading its slices),
    then fine-tuned from it: --pretrained-checkpoint at TP=2 x PP=2 for 6 iterations, --load
    --finetune at PP=1 x DP=4 for 1, --dip-pretrained llm=... for 1, and from scratch for 1
    (per-token loss: the same objective under every layout)."""
    imported = os.path.join(tmp, "hf_import")
    flags = base + ["--dip-hf-config", f"llm={hf}", "--dip-lookahead", "0"]
    flags += ["--calculate-per-token-loss", "--dip-calibration-frozen"]
    result = _import(flags, save=imported, tp=2, pp=2)
    out = {"import_bytes": result.bytes_read, "import_initialised": list(result.initialised)}
    out["hf_dir"] = hf
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    for name, argv in {
        "finetune_tp2pp2": flags
        + tp2pp2
        + ["--pretrained-checkpoint", imported]
        + ["--train-iters", "6"],
        "finetune_pp1": flags + ["--load", imported, "--finetune", "--train-iters", "1"],
        "finetune_module": flags + ["--dip-pretrained", f"llm={imported}", "--train-iters", "1"],
        "finetune_scratch": flags + ["--train-iters", "1"],
    }.items():
        out[name] = run(argv, world_size=world_size)
    return out


def _import(flags: list[str], *, save: str, tp: int, pp: int):
    """tools/hf_checkpoint.py's import, on these ranks, of the model the flags describe."""
    from megatron_dip.training.checkpoint.huggingface import import_hf
    from megatron_dip.training.config.architecture import hf_folders
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.data_config import model_spec
    from megatron_dip.training.config.validate import apply_preset

    config, preset = apply_preset(parse_config(flags))
    model, _, _ = model_spec(config, preset)
    return import_hf(
        model=model, folders=hf_folders(config, model), save=save, tp=tp, pp=pp, seed=7
    )


def qwen2_vl_runs(base: list[str], *, hf: str, tmp: str, world_size: int) -> dict:
    """A Qwen2-VL model (ViT with Conv3d patches and blocked rotary, M-RoPE LLM) imported at
    TP=2 x PP=2 and fine-tuned for 2 iterations there and at PP=1 x DP=4 (per-token loss)."""
    imported = os.path.join(tmp, "hf_qwen2_vl_import")
    flags = base + ["--dip-hf-config", hf, "--dip-lookahead", "0", "--dip-segments", "vit=1,llm=1"]
    flags += ["--calculate-per-token-loss", "--dip-calibration-frozen"]
    _import(flags, save=imported, tp=2, pp=2)
    tuned = flags + ["--pretrained-checkpoint", imported, "--train-iters", "2"]
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    return {
        "vl_tp2pp2": run(tuned + tp2pp2, world_size=world_size),
        "vl_pp1": run(tuned, world_size=world_size),
    }


def tied_embedding_runs(base: list[str], *, world_size: int) -> dict:
    """An LLM with tied input/output embeddings, 3 iterations (per-token loss): in one chunk at
    PP=1 x DP=4, and with its copies on two pipeline ranks (PP=2 x DP=2) under DIP and under
    Megatron's 1F1B (their gradients summed over the embedding group)."""
    flags = base + ["--dip-arch", "llm.tie-embeddings=true", "--dip-lookahead", "0"]
    flags += ["--calculate-per-token-loss", "--dip-calibration-frozen", "--train-iters", "3"]
    pp2 = ["--pipeline-model-parallel-size", "2"]
    return {
        "tied_one_chunk": run(flags + ["--dip-segments", "vit=1,llm=1"], world_size=world_size),
        "tied_dip": run(flags + pp2, world_size=world_size),
        "tied_1f1b": run(flags + pp2 + ["--dip-schedule", "1f1b"], world_size=world_size),
    }


def energon_runs(*, energon: str, tokenizer: str, tmp: str, world_size: int) -> dict:
    """An Energon dataset (converted from LLaVA records whose captions hold the byte tokenizer's
    old fixed ids, '!' and '"' in the BPE) with a Hugging Face tokenizer under DIP at PP=2 x
    DP=2: 6 iterations saving at 3 (evaluating every 2), and the iteration-3 checkpoint resumed."""
    ckpt = os.path.join(tmp, "energon_ckpt")
    flags = COMMON + [
        "--dip-data", f"energon:{energon}", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tokenizer, "--pipeline-model-parallel-size", "2",
        "--dip-lookahead", "0", "--dip-calibration-frozen", "--train-iters", "6",
        "--eval-interval", "2", "--eval-iters", "1",
    ]  # fmt: skip
    return {
        "energon": run(flags + ["--save", ckpt, "--save-interval", "3"], world_size=world_size),
        "energon_resume": run(flags + ["--load", ckpt, "--ckpt-step", "3"], world_size=world_size),
    }


def schedule_switch_runs(
    base: list[str], resume: list[str], *, ckpt: str, tmp: str, world_size: int
) -> dict:
    """Megatron's 1F1B at PP=4 for 3 iterations, saving at 2 (selective recomputation in the
    stages); DIP at PP=2 x DP=2 continuing its iteration-2 checkpoint; 1F1B continuing DIP's
    iteration-3 checkpoint."""
    stock = os.path.join(tmp, "stock")
    flags = ["--pipeline-model-parallel-size", "4", "--dip-schedule", "1f1b"]
    out = {
        "1f1b": run(
            base
            + flags
            + ["--recompute-granularity", "selective", "--train-iters", "3"]
            + ["--save", stock, "--save-interval", "2"],
            world_size=world_size,
        )
    }
    out["dip_from_1f1b"] = run(
        base
        + ["--load", stock, "--ckpt-step", "2", "--dip-lookahead", "0"]
        + ["--pipeline-model-parallel-size", "2", "--train-iters", "3"],
        world_size=world_size,
    )
    out["1f1b_from_dip"] = run(
        base + resume + flags + ["--train-iters", "4"], world_size=world_size
    )
    return out


def _first_line_of(error: type, argv: list[str], world_size: int) -> str | None:
    """The message of `error` the run raised (None: it did not)."""
    try:
        run(argv, world_size=world_size)
    except error as e:
        return str(e)
    return None


def _listing(root: Path) -> list:
    """Every file under `root` with its mtime, but the --save lock the run held (`save_lock`)."""
    from megatron_dip.training.checkpoint.save_lock import LOCK_FILE

    return sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*") if p.name != LOCK_FILE)


def checkpoint_fault_runs(
    base: list[str], *, ckpt: str, tmp: str, rank: int, world_size: int
) -> dict:
    """A copy of DIP's iteration-3 checkpoint with 4 KB of random bytes inside its largest shard
    file, resumed (and saved into); a run whose loss is NaN from the first iteration (weights
    drawn with std 1e30). The error every rank raised, and the corrupt copy before and after."""
    import shutil

    import torch.distributed as dist

    from megatron_dip.training.checkpoint.dirs import CheckpointError
    from megatron_dip.training.checkpoint.save_lock import LOCK_FILE
    from megatron_dip.training.iteration.nonfinite import NonFiniteError

    corrupt = Path(tmp, "corrupt")
    if rank == 0:
        shutil.copytree(Path(ckpt, "iter_0000003"), corrupt / "iter_0000003")
        (corrupt / "latest_checkpointed_iteration.txt").write_text("3")
        shard = max(corrupt.glob("iter_0000003/*.distcp"), key=lambda p: p.stat().st_size)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 4096] = os.urandom(4096)
        shard.write_bytes(bytes(data))
    dist.barrier()
    listing = _listing(corrupt)
    flags = ["--pipeline-model-parallel-size", "2", "--train-iters", "6", "--dip-lookahead", "0"]
    out = {
        "corrupt": _first_line_of(
            CheckpointError, base + flags + ["--load", str(corrupt), "--save", str(corrupt)],
            world_size,
        ),
        "corrupt_untouched": listing == _listing(corrupt),
        "corrupt_lock_released": (corrupt / LOCK_FILE).read_text() == "",
        "nonfinite": _first_line_of(
            NonFiniteError, base + flags + ["--init-method-std", "1e30"], world_size
        ),
    }  # fmt: skip
    return out


def kept_history_runs(base: list[str], *, ckpt: str, tmp: str, rank: int, world_size: int) -> dict:
    """What a run keeps when it goes wrong (issue 26): a copy of DIP's iteration-3 checkpoint
    continued with --lr 1e30 saving every iteration (the streak stops it at iteration 7); a
    save whose writes fail with ENOSPC on rank 1 only; a --save another job holds (a process
    of rank 0's holding its lock). The line each rank ended with (and when), and the
    directories afterwards."""
    import shutil
    import subprocess
    import sys
    import time

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dip.training.checkpoint.dirs import TRACKER, CheckpointError
    from megatron_dip.training.checkpoint.save_lock import SaveLockedError
    from megatron_dip.training.iteration.nonfinite import NonFiniteError

    streak, full, locked = Path(tmp, "streak"), Path(tmp, "full"), Path(tmp, "locked")
    holder = None
    if rank == 0:
        shutil.copytree(Path(ckpt, "iter_0000003"), streak / "iter_0000003")
        (streak / TRACKER).write_text("3")
        locked.mkdir()
        code = (
            "import sys, time; from megatron_dip.training.checkpoint.save_lock import SaveLock, "
            "this_process; SaveLock(sys.argv[1]).acquire(this_process('job-42')); "
            "print('held', flush=True); time.sleep(600)"
        )
        holder = subprocess.Popen(
            [sys.executable, "-c", code, str(locked)], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout.readline().strip() == "held"
    dist.barrier()
    flags = base + ["--pipeline-model-parallel-size", "2", "--dip-lookahead", "0"]
    metrics = Path(tmp, "streak_metrics.jsonl")  # rank 0's, one line per iteration
    out: dict = {}
    out["streak"] = _first_line_of(
        NonFiniteError, flags + ["--load", str(streak), "--save", str(streak), "--lr", "1e30",
                                 "--override-opt_param-scheduler", "--train-iters", "9",
                                 "--save-interval", "1", "--dip-metrics-json", str(metrics)],
        world_size,
    )  # fmt: skip
    # From the streak's last iteration (its metrics line) to this rank's stop line.
    out["streak_exit_s"] = time.time() - metrics.stat().st_mtime
    dist.barrier()
    out["streak_dirs"] = sorted(p.name for p in streak.iterdir() if not p.name.startswith("."))
    out["streak_tracker"] = (streak / TRACKER).read_text()
    original, failed_at = filesystem_async._write_item, Path(tmp, "disk_full_at")
    if rank == 1:
        filesystem_async._write_item = functools.partial(_disk_full, failed_at)
    try:
        out["disk_full"] = _first_line_of(
            CheckpointError, flags + ["--save", str(full), "--train-iters", "1"], world_size
        )
    finally:
        filesystem_async._write_item = original
    dist.barrier()
    out["disk_full_exit_s"] = time.time() - failed_at.stat().st_mtime  # fault -> line
    out["disk_full_dirs"] = sorted(p.name for p in full.iterdir() if not p.name.startswith("."))
    started = time.time()
    out["locked"] = _first_line_of(
        SaveLockedError, flags + ["--save", str(locked), "--train-iters", "1"], world_size
    )
    out["locked_exit_s"] = time.time() - started  # launch of the run (not the process) -> line
    dist.barrier()
    if rank == 0:  # the times each fault took to stop the ranks (for the note)
        timings = {k: v for k, v in out.items() if k.endswith("_exit_s")}
        Path(tmp, "kept_history_timings.json").write_text(json.dumps(timings))
    if holder is not None:
        out["holder"] = holder.pid
        holder.kill()
        holder.wait()
    return out


def _disk_full(failed_at: Path, *args, **kwargs):
    """dist_checkpointing's file write on a full disk (`failed_at` records when)."""
    failed_at.touch()
    raise OSError(28, "No space left on device")


def bf16_runs(base: list[str], *, tmp: str, world_size: int) -> dict:
    """--bf16 on the CPU (Megatron's mixed-precision optimizer, bf16 messages, clipping):
    10 iterations at PP=2 x DP=2 (compared with the float32 "dip" run, same data and LR
    schedule) saving at iteration 5, resumed from it for 5 more (fp32 master weights restored);
    float32 and bf16 at PP=1 x DP=4."""
    ckpt = os.path.join(tmp, "bf16")
    flags = base + ["--dip-lookahead", "0", "--train-iters", "10"]
    pp2 = flags + ["--pipeline-model-parallel-size", "2", "--bf16"]
    return {
        "bf16_pp2": run(pp2 + ["--save", ckpt, "--save-interval", "5"], world_size=world_size),
        "bf16_pp2_resume": run(pp2 + ["--load", ckpt, "--ckpt-step", "5"], world_size=world_size),
        "fp32_pp1": run(flags, world_size=world_size),
        "bf16_pp1": run(flags + ["--bf16"], world_size=world_size),
    }


def decode_failure_run(flags: list[str], world_size: int) -> str | None:
    """A run whose first batch holds an image that passed the metadata checks but cannot be
    decoded: only the ranks of one replica load it. The error every rank raised (None: none)."""
    from megatron_dip.data.records import BadSampleError

    try:
        run(
            flags + ["--pipeline-model-parallel-size", "2", "--train-iters", "2",
                     "--dip-lookahead", "0"],
            world_size=world_size,
        )  # fmt: skip
    except BadSampleError as e:
        return str(e)
    return None


def decode_skip_run(flags: list[str], world_size: int) -> dict:
    """The same undecodable image under --dip-bad-samples skip: the run goes on (the sample
    trains as a blank with no loss), with its log messages."""
    with _captured_log() as messages:
        out = run(
            flags + ["--pipeline-model-parallel-size", "2", "--train-iters", "2",
                     "--dip-lookahead", "0", "--dip-bad-samples", "skip", "--log-interval", "1"],
            world_size=world_size,
        )  # fmt: skip
    out["log"] = list(messages)
    return out


def emulated_runs(*, tmp: str, world_size: int, rank: int) -> dict:
    """--dip-emulate-compute at PP=4: DIP, and Megatron's interleaved schedule on the one-list
    placement cut by cost (stages holding only ViT layers pass text-only microbatches on)."""
    flags = [
        "--dip-emulate-compute", "--dip-emulate-scale", "3000", "--model", "tiny-vlm",
        "--global-batch-size", "4", "--pipeline-model-parallel-size", "4", "--lr", "1e-3",
        "--train-iters", "2", "--dip-lookahead", "0", "--dip-calibration-frozen",
    ]  # fmt: skip
    out = {}
    for name, extra in (
        ("emulated_dip", ["--dip-schedule", "dip"]),
        (
            "emulated_interleaved",
            ["--dip-schedule", "interleaved", "--dip-stock-placement", "cost"],
        ),
    ):
        metrics = os.path.join(tmp, f"{name}.jsonl")
        out[name] = run(flags + extra + ["--dip-metrics-json", metrics], world_size=world_size)
        if rank == 0:
            out[name]["metrics"] = [json.loads(x) for x in Path(metrics).read_text().splitlines()]
    return out


def overhead_measurement(*, world_size: int, rank: int) -> dict:
    """tools/measure_overhead.py's measurement (`benchmark.overhead.measure_rank`) of zero-sleep
    emulated DIP and 1F1B iterations at PP=4, once each: the training's own step."""
    from megatron_dip.benchmark.overhead import make_case, measure_rank, plan_counts

    flags = [
        "--dip-emulate-compute", "--model", "tiny-vlm", "--global-batch-size", "4",
        "--pipeline-model-parallel-size", "4", "--lr", "1e-3", "--train-iters", "1",
        "--dip-lookahead", "0", "--dip-calibration-frozen",
    ]  # fmt: skip
    cases = [
        make_case(s, [*flags, "--dip-schedule", s], world_size=world_size, batches=1)
        for s in ("dip", "1f1b")
    ]
    seconds = measure_rank(rank=rank, world_size=world_size, cases=cases, repeats=2)
    return {"seconds": seconds, "counts": [plan_counts(c.plans[0]) for c in cases]}


def disagreeing_batch_error(rank: int) -> str | None:
    """Rank 3 formed another batch than the others (as if it read a record differently): the
    error every rank raises when agreeing on the loaded samples (None: none)."""
    import torch

    from megatron_dip.data.records import BadSampleError
    from megatron_dip.data.sample import BatchMeta, SampleMeta
    from megatron_dip.training.config.data_source import load_agreed

    batch = BatchMeta(0, (SampleMeta(0, 11 if rank == 3 else 10),))
    try:
        load_agreed(lambda: [], batch=batch, rank=rank, device=torch.device("cpu"))
    except BadSampleError as e:
        return str(e)
    return None
