"""Checkpoint files in one process (a one-rank gloo world): `storage`, the weights-only API
and the optimizer state of `training/checkpoint.py` / `optim_state.py` (the multi-process runs,
resharding and the faults of a training run are in test_training_dist.py).

* Weights saved under one chunking load under another; the directory holds dist_checkpointing's
  torch_dist files and the manifest, nothing temporary, and no process of the save is left;
  training starts from such a weights-only checkpoint with --no-load-optim.
* Every kind of damage (bytes flipped inside a shard file, truncated files, a missing file, a bad
  manifest) is one `CheckpointError` naming the file, and nothing is loaded.
* Adam's moments and step go out in global coordinates and come back into another chunking.
* An asynchronous save is invisible (no `iter_N`, no tracker) until it is finalized; a save
  whose writer fails is one error and publishes nothing.
* A rank killed after a save, or during an asynchronous one, leaves no process behind within 5 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from megatron.core import dist_checkpointing
from test_models import CFG

from megatron_dip import megatron_compat
from megatron_dip.modalities import build_module_chunks
from megatron_dip.models.chunk import ModelGroups
from megatron_dip.models.init import global_param_name
from megatron_dip.modelspec import tiny_t2v, tiny_vlm
from megatron_dip.training.assembly.build import LocalModel
from megatron_dip.training.checkpoint.dirs import MANIFEST, TRACKER, CheckpointError
from megatron_dip.training.checkpoint.state import (
    checksums,
    load_weights,
    optim_state,
    save_weights,
    storage,
)
from megatron_dip.training.checkpoint.storage import CheckpointWriter
from megatron_dip.training.config.arguments import parse_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def groups(single_rank_world) -> ModelGroups:
    world = single_rank_world
    return ModelGroups(tp=world, cp=world, embedding=world)


def _chunks(groups, ranges, *, model=None, seed=7):
    model = model or tiny_vlm()
    config = CFG if seed == 7 else type(CFG)(**{**CFG.__dict__, "seed": seed})
    return [
        c
        for m in model.modules
        for c in build_module_chunks(model, m.name, ranges(m), config=config, groups=groups)
    ]


def _processes() -> set[int]:
    """This process's descendants (other tests may have left some, e.g. a resource tracker)."""
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _weights(chunks) -> dict[str, torch.Tensor]:
    return {
        global_param_name(c, n): p.detach().clone() for c in chunks for n, p in c.named_parameters()
    }


def _two(m):
    return [(0, 3), (3, m.num_layers)]


def _one(m):
    return [(0, m.num_layers)]


def test_weights_load_under_another_chunking_and_nothing_is_left_behind(groups, tmp_path):
    saved = _chunks(groups, _two)
    before = _processes()
    path = save_weights(tmp_path, model=tiny_vlm(), chunks=saved, iteration=4)
    assert path == tmp_path / "iter_0000004" and (tmp_path / TRACKER).read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", TRACKER]
    files = sorted(p.name for p in path.iterdir())
    common = [megatron_compat.common_state_file()] if megatron_compat.common_state_file() else []
    assert files == sorted(
        [".metadata", "__0_0.distcp", "__0_1.distcp", MANIFEST, *common, "metadata.json"]
    )
    assert sorted(checksums.read_manifest(path)) == [f for f in files if f != MANIFEST]
    assert _processes() <= before  # no Manager, no writer left
    other = _chunks(groups, _one, seed=99)
    fresh = _weights(other)
    assert not all(torch.equal(v, fresh[k]) for k, v in _weights(saved).items())
    assert load_weights(tmp_path, model=tiny_vlm(), chunks=other) == 4
    want, got = _weights(saved), _weights(other)
    assert set(want) == set(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key


@pytest.fixture(scope="module")
def saved(groups, tmp_path_factory) -> Path:
    """One weights checkpoint of tiny-vlm (iteration 0); tests damage copies of it."""
    root = tmp_path_factory.mktemp("saved")
    save_weights(root, model=tiny_vlm(), chunks=_chunks(groups, _two))
    return root


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def test_weights_of_another_model_are_refused(groups, copy):
    t2v = tiny_t2v()
    with pytest.raises(CheckpointError, match=r"saved from model .* this run builds"):
        load_weights(copy, model=t2v, chunks=_chunks(groups, _one, model=t2v))


def _common_state_file(path: Path) -> str:
    """The file holding the common state: `common.pt` (megatron-core 0.16), or the torch_dist
    shard that .metadata names for the "common_state" object (0.19)."""
    return storage.common_state_files(path)[-1]


def _damage(path: Path, kind: str) -> str:
    """Damage one file of the checkpoint at `path` as `kind` says; the file's name."""
    shard = max(path.glob("__*.distcp"), key=lambda p: p.stat().st_size)
    target = {"flipped": shard, "truncated": shard, "missing": shard}.get(kind)
    if kind == "common state":
        target, kind = path / _common_state_file(path), "truncated"
    if kind in ("metadata.json", ".metadata"):
        target, kind = path / kind, "truncated"
    data = bytearray(target.read_bytes())
    if kind == "flipped":  # 4 KB of random bytes in the middle, size unchanged
        at = len(data) // 2
        data[at : at + 4096] = os.urandom(4096)
        target.write_bytes(bytes(data))
    elif kind == "truncated":
        target.write_bytes(bytes(data[: len(data) // 2]))
    else:
        target.unlink()
    return target.name


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("flipped", "sha256 differs from the manifest"),
        ("truncated", "truncated"),
        ("missing", "missing"),
        ("metadata.json", "truncated"),
        ("common state", "truncated"),
        (".metadata", "truncated"),
    ],
)
def test_a_damaged_file_is_named_and_nothing_is_loaded(groups, copy, kind, words):
    name = _damage(copy / "iter_0000000", kind)
    target = _chunks(groups, _one, seed=99)
    before = _weights(target)
    with pytest.raises(CheckpointError, match=rf"iter_0000000/{name}: .*{words}") as info:
        load_weights(copy, model=tiny_vlm(), chunks=target)
    assert "\n" not in str(info.value)
    after = _weights(target)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (copy / TRACKER).read_text() == "0"


def test_a_missing_or_unreadable_manifest_is_named(copy):
    path = copy / "iter_0000000"
    (path / MANIFEST).write_text('{"sha256": {"common.pt": [1')
    with pytest.raises(CheckpointError, match=rf"{MANIFEST}: unreadable checksum manifest"):
        checksums.verify(path)
    (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checksums.verify(path)


def _train_one_iteration(*flags: str) -> float:
    """The iteration-1 loss of tiny-vlm trained in this process (a one-rank world)."""
    from megatron_dip.training.config.validate import resolve
    from megatron_dip.training.iteration.loop import pretrain

    argv = ["--model", "tiny-vlm", "--train-iters", "1", "--lr", "1e-3", "--seed", "7"]
    argv += ["--global-batch-size", "2", "--dip-lookahead", "0", *flags]
    result = pretrain(resolve(parse_config(argv), world_size=1, cuda=False))
    return result.losses[1]


def test_training_starts_from_weights_only_checkpoints(groups, tmp_path):
    """What an importer writes: the run's own initial weights (seed 7, float32) give the loss of
    a run from scratch; other weights another one. Without --no-load-optim it is refused."""
    from megatron_dip.models import ModelConfig

    fresh = _train_one_iteration()
    for seed in (7, 8):
        config = ModelConfig(seed=seed)
        model = tiny_vlm()
        chunks = [
            c
            for m in model.modules
            for c in build_module_chunks(model, m.name, _two(m), config=config, groups=groups)
        ]
        save_weights(tmp_path / str(seed), model=model, chunks=chunks)
    assert _train_one_iteration("--load", str(tmp_path / "7"), "--no-load-optim") == fresh
    assert _train_one_iteration("--load", str(tmp_path / "8"), "--no-load-optim") != fresh
    with pytest.raises(CheckpointError, match="holds model weights only .* --no-load-optim"):
        _train_one_iteration("--load", str(tmp_path / "7"))


def _plain_adamw(chunks):
    from megatron_dip.training.assembly.optim import PlainAdamW
    from megatron_dip.training.config.settings import training_settings

    model = LocalModel(list(chunks))
    config = parse_config(["--lr", "1e-2", "--train-iters", "3"])
    spec = SimpleNamespace(training=training_settings(config))
    world = chunks[0].groups.tp
    return model, PlainAdamW(model, spec=spec, mp_group=world)


def _moments(model, optimizer) -> dict:
    names = {id(p): k for k, p in model.named_parameters()}
    return {
        names[id(p)]: {k: v.clone() for k, v in optimizer.optimizer.state[p].items()}
        for p in optimizer.params
    }


def test_adam_moments_and_step_load_into_another_chunking(groups, tmp_path):
    model, optimizer = _plain_adamw(_chunks(groups, _two))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in optimizer.params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        assert optimizer.step()[0]
    sharded, common = optim_state.sharded_state(optimizer, model.param_layouts(), dp_rank=0)
    assert common == {"step": 2}
    state = {"model": model.sharded_state_dict(data_parallel_rank=0), "optimizer": sharded}
    path = CheckpointWriter(group=None, async_save=False).save(state, tmp_path, 2)

    model2, fresh = _plain_adamw(_chunks(groups, _one, seed=99))
    saved_keys = set(dist_checkpointing.load_tensors_metadata(str(path)))
    request, masters, set_steps = optim_state.load_request(
        fresh, model2.param_layouts(), dp_rank=0, saved_keys=saved_keys
    )
    assert not masters  # float32 parameters are their own masters
    checksums.verify(path)
    storage.load_sharded({"optimizer": request}, path)
    set_steps(common["step"])
    want, got = _moments(model, optimizer), _moments(model2, fresh)
    assert set(want) == set(got)
    for key in want:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(want[key][name], got[key][name]), (key, name)


def test_an_asynchronous_save_is_invisible_until_finalized(groups, tmp_path):
    chunks = _chunks(groups, _two)
    writer = CheckpointWriter(group=None, async_save=True)
    state = {"model": LocalModel(chunks).sharded_state_dict(data_parallel_rank=0)}
    final = writer.save(state, tmp_path, 5)
    assert not final.exists() and not (tmp_path / TRACKER).exists()
    assert (tmp_path / "iter_0000005.tmp").is_dir()
    writer.wait()
    assert writer.published == [final] and (tmp_path / TRACKER).read_text() == "5"
    checksums.verify(final)


def _still_writing(*args, **kwargs):
    time.sleep(600)


def test_an_aborted_save_stops_its_writer_and_publishes_nothing(groups, tmp_path, monkeypatch):
    """What a failed run does with a save in flight (it cannot wait for ranks that stopped)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer_class = filesystem_async.FileSystemWriterAsync
    save_function_and_args = writer_class.get_save_function_and_args

    def _stalled_save_function(self):
        # The function the writer process runs (`write_preloaded_data_multiproc` on
        # megatron-core 0.16, `..._multithread` on 0.19) never returns.
        save_fn, preload_fn, args = save_function_and_args(self)
        return (_still_writing if save_fn is not None else None), preload_fn, args

    monkeypatch.setattr(writer_class, "get_save_function_and_args", _stalled_save_function)
    before = _processes()
    writer = CheckpointWriter(group=None, async_save=True)
    state = {"model": LocalModel(_chunks(groups, _two)).sharded_state_dict(data_parallel_rank=0)}
    writer.save(state, tmp_path, 3)
    assert _processes() - before  # the writer process is running
    writer.abort()
    assert _processes() <= before and writer.pending == []
    assert not (tmp_path / "iter_0000003").exists() and not (tmp_path / TRACKER).exists()


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _killed(*args, **kwargs):
    os.kill(os.getpid(), 9)


@pytest.mark.parametrize("fault", ["disk full", "writer killed"])
def test_a_failed_write_is_one_error_and_publishes_nothing(groups, tmp_path, monkeypatch, fault):
    """A file writer that fails, or is killed (dist_checkpointing's writer would wait for it
    forever): the save fails on every rank, naming it; nothing is published."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    save_weights(tmp_path, model=tiny_vlm(), chunks=_chunks(groups, _two), iteration=1)
    before = _processes()
    if fault == "disk full":
        monkeypatch.setattr(filesystem_async, "_write_item", _disk_full)
    else:
        writer = filesystem_async.FileSystemWriterAsync
        monkeypatch.setattr(writer, "write_preloaded_data", staticmethod(_killed))
    with pytest.raises(
        CheckpointError,
        match=r"saving .*iter_0000002.tmp failed .*tracker are "
        r"unchanged",
    ):
        save_weights(tmp_path, model=tiny_vlm(), chunks=_chunks(groups, _two), iteration=2)
    assert (tmp_path / TRACKER).read_text() == "1" and not (tmp_path / "iter_0000002").exists()
    assert _processes() <= before


_RANK_SCRIPT = """
import json, os, signal, sys, time
import psutil, torch, torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron_dip.cpu_support import apply_cpu_fixes
from megatron_dip.training.checkpoint.storage import CheckpointWriter

root = sys.argv[1]
dist.init_process_group("gloo", store=dist.FileStore(root + "/store", 1), rank=0, world_size=1)
apply_cpu_fixes()
state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(1000.0))}
CheckpointWriter(group=None, async_save=False).save(state, root + "/ckpt", 1)
after_save = [p.pid for p in psutil.Process().children(recursive=True)]
FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(
    lambda *args, **kwargs: time.sleep(600)  # a writer that is still writing when the rank dies
)
CheckpointWriter(group=None, async_save=True).save(state, root + "/ckpt", 2)
time.sleep(1.0)
writers = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps({"after_save": after_save, "writers": writers}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_rank_leaves_no_checkpoint_process_behind(tmp_path):
    """Megatron's writer keeps a Manager server process (spawned at the first save) that
    outlives a killed rank; here a completed save leaves no process, and the writer of a save
    in flight exits within 5 s of the rank's death."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_RANK_SCRIPT))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == -9, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["after_save"] == []
    assert found["writers"], "the asynchronous save should have a writer process"
    deadline = time.monotonic() + 5.0
    alive = found["writers"]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [
            p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]
    assert alive == [], f"processes {alive} outlived the killed rank by 5 s"
    assert not (tmp_path / "ckpt" / "iter_0000002").exists()  # never published
    assert (tmp_path / "ckpt" / TRACKER).read_text() == "1"
    assert json.loads((tmp_path / "ckpt" / "iter_0000001" / MANIFEST).read_text())["sha256"]
