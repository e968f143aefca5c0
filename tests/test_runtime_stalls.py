"""The stall post-mortem of `runtime/stalls.py`, in one process: a file store stands in for the
job's, the other ranks' reports and heartbeats are written into it by hand (the 4-process
faults: test_faults.py)."""

from __future__ import annotations

import json
import threading

import pytest
import torch.distributed as dist

from megatron_dip.runtime.errors import PipelineTimeoutError, StallError
from megatron_dip.runtime.stalls import Phase, PhaseWatch, describe_stall, is_comm_failure
from megatron_dip.training.checkpoint.dirs import CheckpointError


def test_communication_failures_are_told_from_a_ranks_own_errors():
    assert is_comm_failure(RuntimeError("Application timeout caused pair closure"))
    assert is_comm_failure(RuntimeError("[gloo/pair.cc:537] Connection reset by peer"))
    assert is_comm_failure(dist.DistBackendError("anything"))
    assert is_comm_failure(TimeoutError("timed out after 5 s"))
    err = PipelineTimeoutError("x", rank=0, index=1, peer=1, key=None, tensor=None)
    assert is_comm_failure(err)
    assert not is_comm_failure(ValueError("LLaVA record 3: cannot decode image 0"))
    assert not is_comm_failure(RuntimeError("shape mismatch in chunk llm0"))
    late = CheckpointError("the writers did not finish within 600 s (--dip-comm-timeout-s)")
    assert not is_comm_failure(late)  # our own errors name their cause already


def _beat(store, prefix: str, rank: int, n: int, phase: str, iteration: int) -> None:
    record = {"n": n, "phase": phase, "iteration": iteration, "group": "world"}
    store.set(f"{prefix}/beat/{rank}", json.dumps(record))


def test_the_post_mortem_names_who_arrived_who_waits_elsewhere_and_who_stalled(tmp_path):
    """Rank 0 times out in 'grad sync' with rank 1; rank 1's heartbeat moves (it waits in the
    pipeline), rank 2's does not (stopped), rank 3 reported its own timeout in 'grad sync' and
    finished that post-mortem (it exits, so it beats no more)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    watch = PhaseWatch(store=store, rank=0, world_size=4, timeout_s=5.0, beat_s=0.1)
    prefix = watch.prefix
    _beat(store, prefix, 2, 7, "pipeline schedule", 3)
    store.set(
        f"{prefix}/report/3",
        json.dumps(
            {"phase": "grad sync", "iteration": 4, "group": "world", "failed": False, "done": True}
        ),
    )
    stop = threading.Event()

    def alive_rank_1() -> None:  # a rank blocked in another phase still beats
        n = 0
        while not stop.is_set():
            n += 1
            _beat(store, prefix, 1, n, "pipeline schedule", 4)
            stop.wait(0.05)

    thread = threading.Thread(target=alive_rank_1)
    thread.start()
    watch.start()
    watch.iteration = 4
    try:
        with pytest.raises(StallError) as info, watch.phase("grad sync", group_name="world"):
            raise RuntimeError("Application timeout caused pair closure")
    finally:
        stop.set()
        thread.join()
        watch.stop()
    line = str(info.value)
    assert info.value.stalled == [2] and info.value.phase == "grad sync"
    assert line.startswith("rank 0: 'grad sync' of iteration 4 over the world [0, 1, 2, 3] failed")
    assert "arrived: [0, 3]" in line
    assert "rank 1 (alive in 'pipeline schedule' (iteration 4))" in line
    assert "Stalled: rank 2 (no heartbeat for" in line
    assert "last heartbeat in 'pipeline schedule' (iteration 3)" in line
    assert "\n" not in line


def test_a_rank_stopped_after_reporting_its_own_stall_is_named_stalled(tmp_path):
    """On loaded CI, rank 2 timed out, reported, and was stopped (SIGSTOP) during its own
    post-mortem: its report hid it and every line said "Stalled: none". A report not marked
    done, with a heartbeat that does not move, is a stall; one marked done is not; and this
    rank marks its own report done once its post-mortem ends."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    watch = PhaseWatch(store=store, rank=0, world_size=3, timeout_s=5.0, beat_s=0.1)
    prefix = watch.prefix
    reported = {"phase": "plan fetch", "iteration": 10, "group": "world", "failed": False}
    _beat(store, prefix, 1, 4, "plan fetch", 10)
    store.set(f"{prefix}/report/1", json.dumps({**reported, "done": True}))  # exited
    _beat(store, prefix, 2, 9, "plan fetch", 10)
    store.set(f"{prefix}/report/2", json.dumps(reported))  # stopped in its post-mortem
    watch.start()
    watch.iteration = 10
    try:
        with pytest.raises(StallError) as info, watch.phase("sample agreement"):
            raise TimeoutError("timed out after 5 s")
    finally:
        watch.stop()
    assert info.value.stalled == [2], str(info.value)
    assert "Stalled: rank 2 (no heartbeat for" in str(info.value)
    assert json.loads(store.get(f"{prefix}/report/0"))["done"] is True


def test_a_rank_that_failed_is_named_with_its_error():
    line = describe_stall(
        rank=1,
        phase=Phase("stats gather", 5, "world", (0, 1)),
        cause="RuntimeError: Connection closed by peer",
        reports={
            0: {
                "phase": "pipeline schedule",
                "iteration": 5,
                "failed": True,
                "error": "ValueError: bad shape",
            }
        },
        beats={0: {"n": 3, "phase": "pipeline schedule", "iteration": 5}},
        stalled=[],
        grace_s=1.5,
    )
    assert "not arrived: rank 0 (alive in 'pipeline schedule' (iteration 5))" in line
    assert "Failed: rank 0 in 'pipeline schedule' (iteration 5): ValueError: bad shape" in line
    assert "Stalled" not in line


def test_without_a_stalled_or_failed_rank_the_line_says_so():
    line = describe_stall(
        rank=0,
        phase=Phase("stats gather", 2, "world", (0, 1)),
        cause="TimeoutError: x",
        reports={1: {"phase": "grad sync", "iteration": 2, "failed": False}},
        beats={},
        stalled=[],
        grace_s=1.5,
    )
    assert "not arrived: rank 1 (alive in 'grad sync' (iteration 2))" in line
    assert "Stalled: none (every rank is alive" in line


def test_an_error_raised_from_a_communication_failure_is_a_stall(tmp_path):
    """A save that failed because a peer died (CheckpointError from gloo's error): the line
    names the dead rank and keeps the checkpoint's message as the cause."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    watch = PhaseWatch(store=store, rank=0, world_size=2, timeout_s=2.0, beat_s=0.1)
    with pytest.raises(StallError) as info, watch.phase("checkpoint publish"):
        try:
            raise RuntimeError("[gloo/pair.cc:553] Connection closed by peer")
        except RuntimeError as e:
            raise CheckpointError("saving iter_0000002.tmp failed (Connection closed)") from e
    assert "failed (CheckpointError: saving iter_0000002.tmp failed" in str(info.value)
    assert "Stalled: rank 1 (no heartbeat" in str(info.value)


def test_other_errors_pass_through_a_phase_untouched(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    watch = PhaseWatch(store=store, rank=0, world_size=2, timeout_s=5.0)
    with pytest.raises(ValueError, match="bad sample"), watch.phase("sample agreement"):
        raise ValueError("bad sample")
    assert watch.current.name == "start-up"  # the phase ended with the block
    watch.report_failure(ValueError("bad sample"))  # what a failed run does before it raises
    assert store.timeout.total_seconds() == 300  # the store keeps its own timeout


def test_on_nccl_a_phase_about_to_time_out_is_reported_before_the_watchdog(tmp_path, caplog):
    """NCCL's watchdog aborts the process at the timeout, before Python sees an error: the
    heartbeat thread logs the line shortly before (`early`). Here the phase simply outlasts
    timeout - grace; rank 1 never beat (stalled)."""
    import logging
    import time

    store = dist.FileStore(str(tmp_path / "store"), 1)
    watch = PhaseWatch(store=store, rank=0, world_size=2, timeout_s=2.5, beat_s=0.1, early=True)
    watch.start()
    try:
        level = caplog.at_level(logging.ERROR, logger="megatron_dip.runtime.stalls")
        with level, watch.phase("grad sync", group_name="data-parallel group"):
            deadline = time.monotonic() + 10
            while "about to time out" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        watch.stop()
    line = next(r.getMessage() for r in caplog.records if "about to time out" in r.getMessage())
    assert line.startswith("error: rank 0: 'grad sync' of iteration 0 over the data-parallel")
    assert "NCCL's watchdog aborts the rank at 2.5 s" in line
    assert "Stalled: rank 1 (no heartbeat" in line


class _FlakyStore:
    """A file store whose connection can be cut (`down`): every call then fails as a TCPStore's
    does once its host died."""

    def __init__(self, path) -> None:
        self.inner, self.down, self.calls = dist.FileStore(str(path), 1), False, 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args):
            self.calls += 1
            if self.down:
                raise dist.DistNetworkError("Broken pipe")
            return method(*args)

        return call


def test_a_rank_that_loses_the_jobs_store_says_so_and_stops(tmp_path):
    """torchrun's agent (the store's host) is SIGKILLed: the heartbeat's writes fail, and after
    two failed beats the rank logs one line naming the store and its phase (then, outside
    tests, it exits: the real launcher kill is in test_faults.py)."""
    from megatron_dip.runtime.stalls import describe_store_host

    store, lost = _FlakyStore(tmp_path / "store"), []
    done = threading.Event()
    host = describe_store_host(
        {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    )
    watch = PhaseWatch(
        store=store,
        rank=3,
        world_size=4,
        timeout_s=5.0,
        beat_s=0.05,
        store_host=host,
        on_store_lost=lambda line: (lost.append(line), done.set()),
    )
    watch.start()
    try:
        with watch.phase("optimizer step"):
            store.down = True
            assert done.wait(60), "the heartbeat did not notice the lost store"
    finally:
        watch.stop()
    assert len(lost) == 1 and watch.store_lost
    line = lost[0]
    assert line.startswith(
        "rank 3: lost the job's store (hosted by the torchrun agent at n1:29500)"
    )
    assert "DistNetworkError: Broken pipe" in line and "in 'optimizer step' of iteration 0" in line
    assert (
        describe_store_host({"MASTER_ADDR": "n1", "MASTER_PORT": "1"}) == "hosted by rank 0 at n1:1"
    )


def test_one_failed_heartbeat_is_not_a_lost_store(tmp_path):
    """A single failed write (a store busy for a moment) is retried and forgotten."""
    store, lost = _FlakyStore(tmp_path / "store"), []
    watch = PhaseWatch(
        store=store, rank=0, world_size=1, timeout_s=5.0, beat_s=0.05, on_store_lost=lost.append
    )
    store.down = True
    assert not watch._write_beat()
    store.down = False
    assert watch._write_beat() and watch._failing is None
    store.down = True
    assert not watch._write_beat() and not watch._store_gone()  # one attempt: not yet
    assert lost == []
