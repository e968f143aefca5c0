"""Saving and loading sharded state dicts with Megatron-Core's `dist_checkpointing` (torch_dist),
published only when complete and verified before they are read.

Inside a checkpoint directory (Megatron-LM's torch_dist layout plus one file of ours):

    metadata.json        dist_checkpointing's: backend "torch_dist" and its version
    common.pt            the common (non-sharded) state, written by rank 0 (megatron-core 0.16;
                         0.19 writes it into rank 0's shards: `megatron_compat.common_state_file`)
    .metadata            torch.distributed.checkpoint's index: every tensor's chunks and files
    __R_T.distcp         rank R's shards, writer thread T (each rank writes only its own)
    checksums.json       MANIFEST (`checksums`): size and sha256 of every file above

Saving (`CheckpointWriter.save`, collective): rank 0 checks the free space against the newest
checkpoint's size and creates `iter_N.tmp` (every rank learns the outcome); `dist_checkpointing.save`
plans the write (`FullyParallelSaveStrategyWrapper` over the data-parallel group spreads the
replicated weights' writing over the replicas) and returns an `AsyncRequest`; that request runs in
a forked writer process (Megatron's `AsyncCallsQueue`), which writes the rank's files, then
hashes them. `--async-save` lets training continue meanwhile (the next iterations finalize it);
otherwise the save waits. The finalize step first exchanges every rank's outcome: when a write
failed anywhere, rank 0 removes `iter_N.tmp` and every rank raises the same line naming the rank,
the cause (no space left, permission, I/O error...) and the file. Otherwise rank 0 hashes the
common files, writes the manifest and renames `iter_N.tmp` to `iter_N` and rewrites the tracker,
each atomically; a training save (`verify=True`) is renamed to `iter_N.unverified` instead and
published only when `judge` says that the weights it holds trained with a finite loss (the loop
judges each checkpoint by the iteration after it). A crash at any point leaves the previous
checkpoint and tracker intact.

Processes: dist_checkpointing's writer sends its results through a multiprocessing Manager queue
whose server process it spawns at the first save (about 5 s) and which outlives a killed rank
(reparented to PID 1). Here a file in the local temporary directory carries those results instead
(`_FileResultsQueue`; with each rank's digests or write error: the checkpoint's own disk may be
the full one), so no server process exists; the forked writer process watches its parent
and exits, with its own writer children, within a second of the rank's death, and fails the save
when one of its file writers dies (dist_checkpointing's would wait for it forever). Waiting for
the writers is bounded (`CheckpointWriter(timeout_s=...)`, --dip-comm-timeout-s in training); a
failed or late save is one `CheckpointError` on every rank and publishes nothing.

Loading (collective, after `checksums.verify` checked every file against the manifest):
the requested keys and global shapes are checked against the checkpoint's index, and
`dist_checkpointing.load` fills the requested tensors in place, resharding as needed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron_dip import megatron_compat

from .checksums import digests
from .dirs import (
    CheckpointError,
    check_free_space,
    iteration_dir,
    newest_checkpoint,
    unverified_dir,
)
from .publish import (
    complete_on_rank0,
    describe_error,
    iteration_of,
    reason,
    rename_and_track,
    replace_dir,
)

logger = logging.getLogger(__name__)

WRITER_THREADS = 2  # files per rank and checkpoint (Megatron-LM's default thread count)
_OUTCOME = "outcome_{iteration:07d}.json"  # a rank's digests or write error (local temp dir)
_RESULTS = "write_results_{iteration:07d}.pkl"  # dist_checkpointing's results (local temp dir)
_KEPT = "the previous checkpoint and the tracker are unchanged"
_WATCH_S = 0.5


class _FileResultsQueue:
    """Where dist_checkpointing's writer puts its write results (`put` in the writer process,
    `get_nowait` in the rank at finalize): a file, instead of the queue of a Manager server
    process (module docstring). One save at a time per rank uses it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        del block, timeout
        tmp = self.path.with_name(self.path.name + ".part")
        with open(tmp, "wb") as f:
            try:
                pickle.dump(item, f)
            except (pickle.PicklingError, TypeError, AttributeError):  # an exotic exception
                f.seek(0)
                f.truncate()
                pickle.dump(RuntimeError(repr(item)), f)
        os.replace(tmp, self.path)

    def get_nowait(self):
        try:
            with open(self.path, "rb") as f:
                item = pickle.load(f)
        except FileNotFoundError:
            raise queue.Empty from None
        self.path.unlink()
        return item

    def peek(self):
        """The item put, left in place (None: nothing yet or unreadable)."""
        try:
            with open(self.path, "rb") as f:
                return pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError):
            return None

    def get(self, block: bool = True, timeout: float | None = None):
        del block, timeout
        return self.get_nowait()


def _died(pid: int) -> bool:
    """Whether child `pid` has exited abnormally (killed, or a non-zero status); the child is
    not reaped (its parent still joins it)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is not None and (info.si_code != os.CLD_EXITED or info.si_status != 0)


def _watch_writer(parent: int) -> None:
    """Watchdog thread of a forked writer process. When the rank that forked it is gone, or one
    of its own file writers died (dist_checkpointing's writer would wait for that one forever),
    kill its writers and exit: a dead rank leaves no process behind, and a dead file writer is
    a failed save the rank reports (its results never arrive)."""
    import psutil

    me = psutil.Process()
    while os.getppid() == parent:
        if any(_died(child.pid) for child in me.children()):
            break
        time.sleep(_WATCH_S)
    for child in me.children(recursive=True):
        child.kill()
    os._exit(1)


def _write_and_hash(write: Callable, outcome: Path, rank_pid: int, *args) -> None:
    """dist_checkpointing's write function (`args`: rank, write buckets, results queue), then
    the digests of the files it wrote, or the error that stopped it, into `outcome` (a local
    file: the checkpoint's disk may be the one that is full). Runs in the forked writer."""
    if os.getpid() != rank_pid:
        threading.Thread(target=_watch_writer, args=(rank_pid,), daemon=True).start()
    where = Path(args[1][0][0]).parent if args[1] else outcome
    bucket_errors = megatron_compat.record_write_errors()
    bucket_errors.clear()
    try:
        write(*args)
        result = args[2].peek() if isinstance(args[2], _FileResultsQueue) else None
        if isinstance(result, BaseException):
            raise result
        found = digests(Path(bucket[0]) for bucket in args[1])
    except Exception as e:  # what the rank reports (`CheckpointWriter._agree`)
        found = {"error": describe_error(e, where, also=bucket_errors)}
    tmp = outcome.with_name(outcome.name + ".part")
    tmp.write_text(json.dumps(found))
    os.replace(tmp, outcome)


class CheckpointWriter:
    """Saves sharded state dicts (module docstring); one per run, on every rank.

    `group`: the data-parallel group over which replicated tensors' writing is spread.
    `async_save`: return as soon as the writer process has started (`poll` each iteration and
    `wait` at the end finalize); otherwise `save` returns once the checkpoint is published.
    `timeout_s`: how long `wait` waits for the writers before every rank stops with an error
    naming the ranks still writing.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        async_save: bool,
        timeout_s: float = 600.0,
        verify: bool = False,
    ) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        megatron_compat.use_posix_checkpoint_files()
        self.group = group
        self.async_save = async_save
        self.calls = AsyncCallsQueue(persistent=False)
        self.published: list[Path] = []
        self.pending: list[Path] = []  # the `.tmp` directories of saves not yet published
        self.timeout_s = timeout_s
        self.verify = verify
        self.writing: dict[int, Path] = {}  # iteration -> `.tmp` of a save in flight
        self.staged: dict[int, Path] = {}  # iteration -> `.unverified`, awaiting its verdict
        self.verdicts: dict[int, bool] = {}  # verdicts that came before the write finished
        self.rejected: list[Path] = []  # `.unverified` checkpoints that failed verification
        self._gathered: list = []
        self._local = Path(tempfile.gettempdir()) / f"megatron_dip_save_{os.getpid()}"

    def _strategy(self):
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        base = get_default_save_sharded_strategy("torch_dist")
        base.thread_count = WRITER_THREADS
        if self.group is None or self.group.size() == 1:
            return base
        return FullyParallelSaveStrategyWrapper(base, self.group)

    def save(self, sharded_state_dict: dict, root: str | Path, iteration: int) -> Path:
        """Write `sharded_state_dict` as `root/iter_N` (collective; module docstring)."""
        from megatron.core import dist_checkpointing

        self.wait()  # one save in flight at a time
        final = iteration_dir(root, iteration)
        tmp = final.with_name(final.name + ".tmp")
        rank = dist.get_rank()
        self._prepare(tmp, iteration)
        self._local.mkdir(parents=True, exist_ok=True)
        outcome = self._local / _OUTCOME.format(iteration=iteration)
        outcome.unlink(missing_ok=True)
        megatron_compat.install_write_results_queue(
            _FileResultsQueue(self._local / _RESULTS.format(iteration=iteration))
        )
        request = dist_checkpointing.save(
            sharded_state_dict,
            str(tmp),
            sharded_strategy=self._strategy(),
            async_sharded_save=True,
            **megatron_compat.async_save_kwargs(),
        )
        if request.async_fn is not None:
            write = functools.partial(_write_and_hash, request.async_fn, outcome, os.getpid())
            request = request._replace(async_fn=write)
        else:  # nothing for this rank to write
            outcome.write_text("{}")
        request.finalize_fns.insert(0, functools.partial(self._agree, tmp, final, outcome, rank))
        request.finalize_fns.append(functools.partial(self._publish, tmp, final, iteration))
        self.calls.schedule_async_request(request)
        self.pending.append(tmp)
        self.writing[iteration] = tmp
        if not self.async_save:
            self.wait()
        return final

    def _prepare(self, tmp: Path, iteration: int) -> None:
        """Rank 0 checks the free space and creates `tmp`; every rank learns the outcome (one
        identical error everywhere, instead of rank 0 alone failing before a collective)."""
        outcome: list = [None, None]
        if dist.get_rank() == 0:
            try:
                outcome[1] = check_free_space(tmp.parent, iteration, newest_checkpoint(tmp.parent))
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except CheckpointError as e:
                outcome[0] = str(e)
            except OSError as e:
                outcome[0] = f"saving {tmp} failed on rank 0: {describe_error(e, tmp)}; " + _KEPT
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])
        if outcome[1] is not None and dist.get_rank() == 0:
            logger.warning(outcome[1])

    def _agree(self, tmp: Path, final: Path, outcome: Path, rank: int) -> None:
        """First finalize step on every rank (the writers of every rank have finished): the
        ranks exchange their writers' outcomes; when any failed, rank 0 removes the partial
        `tmp` and every rank raises the same one-line error naming the cause and the file."""
        try:
            found = json.loads(outcome.read_text())
        except (OSError, ValueError):
            found = {"error": "its writer process ended without a result (killed?)"}
        outcome.unlink(missing_ok=True)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        failed = [(r, f["error"]) for r, f in enumerate(everyone) if "error" in f]
        if not failed:
            self._gathered = everyone
            return
        (self._local / _RESULTS.format(iteration=iteration_of(final))).unlink(missing_ok=True)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        first, why = failed[0]
        more = f" (and on ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise CheckpointError(
            f"saving {tmp} failed on rank {first}{more}: {why}; the partial {tmp.name} was "
            f"removed; " + _KEPT
        )

    def _publish(self, tmp: Path, final: Path, iteration: int) -> None:
        """Last finalize step of a save on every rank (after dist_checkpointing's): the
        manifest, then the rename to `iter_N` and the tracker, or (`verify`) to `.unverified`
        until `judge` has its verdict (module docstring)."""
        outcome = [None]
        if dist.get_rank() == 0:
            try:
                complete_on_rank0(tmp, final, self._gathered)
                if self.verify:
                    replace_dir(tmp, unverified_dir(final.parent, iteration))
                else:
                    rename_and_track(tmp, final, iteration)
            except (CheckpointError, OSError) as e:
                outcome = [str(e)]
        dist.broadcast_object_list(outcome, src=0)  # every rank stops, or none
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])
        self.pending.remove(tmp)
        self.writing.pop(iteration, None)
        if not self.verify:
            self.published.append(final)
            logger.info("saved checkpoint of iteration %d to %s", iteration, final)
            return
        self.staged[iteration] = unverified_dir(final.parent, iteration)
        logger.debug("checkpoint of iteration %d written, awaiting verification", iteration)

    # -- verification (training saves) ----------------------------------------------------

    def judge(self, iteration: int, finite: bool) -> None:
        """The verdict on the checkpoint of `iteration` (collective, the same on every rank):
        whether the weights it holds have since trained with a finite loss and gradient norm.
        A finished save is published (or kept unverified) now, one in flight once written."""
        if iteration in self.writing or iteration in self.staged:
            self.verdicts[iteration] = finite
        self._settle()

    def _settle(self) -> None:
        for iteration in sorted(set(self.staged) & set(self.verdicts)):
            path, finite = self.staged.pop(iteration), self.verdicts.pop(iteration)
            if finite:
                self._promote(path, iteration)
                continue
            self.rejected.append(path)
            if dist.get_rank() == 0:
                logger.warning(
                    "checkpoint of iteration %d kept unpublished as %s: the next iteration, "
                    "computed with its weights, had a non-finite loss or gradient norm (loading "
                    "ignores it; the tracker is unchanged)",
                    iteration,
                    path,
                )

    def _promote(self, path: Path, iteration: int) -> None:
        final = iteration_dir(path.parent, iteration)
        outcome = [None]
        if dist.get_rank() == 0:
            try:
                rename_and_track(path, final, iteration)
            except OSError as e:
                outcome = [f"publishing {path} failed on rank 0: {describe_error(e, path)}"]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])
        self.published.append(final)
        logger.info("saved checkpoint of iteration %d to %s (verified)", iteration, final)

    def poll(self) -> None:
        """Finalize the saves whose writers have finished (collective: every rank, every
        iteration, while saves are in flight)."""
        if self.calls.get_num_unfinalized_calls():
            self._finalize(blocking=False)
            self._settle()

    def wait(self) -> None:
        """Block until every save is published (collective), at most `timeout_s`."""
        start = time.monotonic()
        while self.calls.get_num_unfinalized_calls():
            self._finalize(blocking=False)
            if not self.calls.get_num_unfinalized_calls():
                self._settle()
                with contextlib.suppress(OSError):
                    self._local.rmdir()  # empty once every save is finalized
                return
            self._stop_if_late(time.monotonic() - start)
            time.sleep(0.05)

    def _stop_if_late(self, waited: float) -> None:
        """The ranks agree whether the wait has lasted too long; if so every rank stops."""
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        late = torch.tensor([int(waited > self.timeout_s)], dtype=torch.int, device=device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if not late.item():
            return
        caller = self.calls.async_calls[0].async_caller
        busy = getattr(caller, "process", None) is not None and caller.process.is_alive()
        writing: list = [None] * dist.get_world_size()
        dist.all_gather_object(writing, busy)
        where = self.pending[0] if self.pending else "a checkpoint"
        self.abort()
        ranks = [r for r, b in enumerate(writing) if b]
        raise CheckpointError(
            f"saving {where}: the writers of ranks {ranks} did not finish within "
            f"{self.timeout_s:.0f} s (--dip-comm-timeout-s); the previous checkpoint and the "
            "tracker are unchanged"
        )

    def _finalize(self, *, blocking: bool) -> None:
        """Megatron's finalization (every rank raises if any rank's writer failed), with a
        failure named by its directory."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            self.calls.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:
            where = self.pending.pop(0) if self.pending else "a checkpoint"
            raise CheckpointError(
                f"saving {where} failed ({reason(e)}); the previous checkpoint and the "
                "tracker are unchanged"
            ) from e

    def abort(self) -> None:
        """Stop unfinished saves without publishing them (their `.tmp` stays incomplete): kill
        each writer process with its file writers."""
        import psutil

        for call in self.calls.async_calls:
            process = getattr(call.async_caller, "process", None)
            if process is not None and process.is_alive():
                with contextlib.suppress(psutil.Error):  # it may have just exited
                    for child in psutil.Process(process.pid).children(recursive=True):
                        child.kill()
            call.async_caller.close(abort=True)  # kills it
            if process is not None:
                process.join(timeout=5)
        self.calls.async_calls.clear()
        self.pending.clear()
        self.writing.clear()
        shutil.rmtree(self._local, ignore_errors=True)


def tensor_metadata(path: Path) -> dict:
    """{key: ShardedTensor without data (global shape, dtype)} of every tensor in a checkpoint
    (its `.metadata`; call after `verify`)."""
    from megatron.core import dist_checkpointing

    megatron_compat.use_posix_checkpoint_files()
    return dist_checkpointing.load_tensors_metadata(str(path))


def check_keys(path: Path, sharded_state_dict: dict, saved: dict) -> None:
    """Every requested tensor is in the checkpoint (`saved`: its `tensor_metadata`) with the
    requested global shape."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    missing, wrong = set(), set()
    for t in nested_values(sharded_state_dict):
        if not isinstance(t, ShardedTensor):
            continue
        if t.key not in saved:
            missing.add(t.key)
        elif tuple(saved[t.key].global_shape) != tuple(t.global_shape):
            wrong.add(f"{t.key} {tuple(saved[t.key].global_shape)} != {tuple(t.global_shape)}")
    if missing:
        shown = ", ".join(sorted(missing)[:3])
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) this run needs are not in the checkpoint "
            f"({shown}{', ...' if len(missing) > 3 else ''})"
        )
    if wrong:
        raise CheckpointError(f"{path}: global shapes differ from this run's: {sorted(wrong)[0]}")


def load_sharded(sharded_state_dict: dict, path: Path, *, saved: dict | None = None) -> dict:
    """`dist_checkpointing.load` of the requested tensors (filled in place) after `check_keys`
    (collective; call after `verify`; `saved`: the `tensor_metadata`, read if not given)."""
    from megatron.core import dist_checkpointing

    check_keys(path, sharded_state_dict, tensor_metadata(path) if saved is None else saved)
    return dist_checkpointing.load(sharded_state_dict, str(path))


def common_state_files(path: Path) -> list[str]:
    """The files of checkpoint `path` that its common state is read from: `common.pt`
    (megatron-core 0.16), or `.metadata` and the torch_dist shard it names for the
    "common_state" object (0.19); empty where `.metadata` cannot be read (a damaged checkpoint
    is the load's to name)."""
    name = megatron_compat.common_state_file()
    if name:
        return [name]
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception:  # unreadable .metadata: the load's verification names it
        return []
    shards = {i.relative_path for k, i in storage.items() if k.fqn.split("/")[0] == "common_state"}
    return [".metadata", *sorted(shards)]


def load_common(path: Path) -> dict:
    """The common state of a checkpoint (every rank reads it; call after `verify`)."""
    from megatron.core import dist_checkpointing

    megatron_compat.use_posix_checkpoint_files()
    try:
        return dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:  # a torch.load error of a file that passed its checksum
        raise CheckpointError(f"{path}: cannot read its common state ({e})") from None
