"""--finetune, --pretrained-checkpoint and --dip-pretrained (training/finetune.py): which
checkpoint a run resumes from and which weights it starts from, refused early with the flag named
(in-process, torch-free; the loading itself runs in test_training_dist.py)."""

from __future__ import annotations

import pytest

from megatron_dip.training.checkpoint.dirs import MANIFEST, TRACKER, iteration_dir
from megatron_dip.training.config.arguments import parse_config
from megatron_dip.training.config.validate import ConfigError, resolve

BASE = ["--model", "tiny-vlm", "--train-iters", "4", "--lr", "1e-3"]


def _resolve(*extra: str):
    return resolve(parse_config([*BASE, *extra]), world_size=1, cuda=False)


def _checkpoint(root, iteration: int = 3) -> str:
    """A directory that looks like one holding a complete checkpoint of `iteration`."""
    path = iteration_dir(root, iteration)
    path.mkdir(parents=True)
    (path / MANIFEST).write_text("{}")
    (root / TRACKER).write_text(str(iteration))
    return str(root)


def test_finetune_loads_the_weights_of_load_and_starts_at_iteration_0(tmp_path):
    ckpt = _checkpoint(tmp_path / "a")
    resumed = _resolve("--load", ckpt)
    assert resumed.resume.iteration == 3 and resumed.pretrained == ()
    tuned = _resolve("--load", ckpt, "--finetune")
    assert tuned.resume is None
    ((module, point),) = tuned.pretrained
    assert module == "" and point.iteration == 3


def test_pretrained_checkpoint_only_until_load_holds_one(tmp_path):
    pre = _checkpoint(tmp_path / "pre", 5)
    fresh = _resolve("--pretrained-checkpoint", pre, "--load", str(tmp_path / "run"))
    assert fresh.resume is None and [p.iteration for _, p in fresh.pretrained] == [5]
    run = _checkpoint(tmp_path / "run", 2)
    restarted = _resolve("--pretrained-checkpoint", pre, "--load", run, "--save", run)
    assert restarted.resume.iteration == 2 and restarted.pretrained == ()


def test_per_module_pretrained_weights(tmp_path):
    vit, llm = _checkpoint(tmp_path / "vit"), _checkpoint(tmp_path / "llm", 1)
    spec = _resolve("--dip-pretrained", f"vit={vit},llm={llm}")
    assert [(m, p.iteration) for m, p in spec.pretrained] == [("vit", 3), ("llm", 1)]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--finetune"], "^--finetune: needs --load"),
        (["--pretrained-checkpoint", "{empty}"], "^--pretrained-checkpoint .*no checkpoint"),
        (["--dip-pretrained", "dit={ckpt}"], "^--dip-pretrained: the model has no module 'dit'"),
        (["--dip-pretrained", "vit"], "^--dip-pretrained: 'vit' is not MODULE=DIR"),
        (["--dip-pretrained", "vit={empty}"], "^--dip-pretrained .*no checkpoint"),
        # fine-tuning from iteration 0 into the directory it reads would overwrite it
        (["--load", "{ckpt}", "--finetune", "--save", "{ckpt}"], "^--save .*already holds"),
    ],
)
def test_bad_finetune_flags_are_refused(tmp_path, flags, words):
    ckpt, empty = _checkpoint(tmp_path / "ckpt"), tmp_path / "empty"
    empty.mkdir()
    argv = [f.format(ckpt=ckpt, empty=empty) for f in flags]
    with pytest.raises(ConfigError, match=words):
        _resolve(*argv)
