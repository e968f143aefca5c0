"""Bad data and planner faults above the runtime, in-process (the distributed half is in
test_training_dist.py: a decode failure on some ranks stops every rank; killed, slow and raising
planner processes during training).

* --dip-bad-samples error: a missing or corrupt image, more images than fit in the sequence, a
  caption longer than the sequence, refused before any process group with a message naming the
  record (its id and file) and the reason; skip: left out, counted, logged once.
* An empty dataset or one with no usable sample: a clear error, not a hang.
* Pixels corrupt past a valid header pass the metadata check and fail at load, naming the record.
* Planner fault injection (`PlannerFaults`) and the plans it leaves the ranks to make: a greedy
  plan is the same made by the planner service or inline (--dip-lookahead 0: on every rank).
* A loss or gradient norm non-finite for --dip-max-nonfinite-iters consecutive iterations stops
  the run naming them (the distributed run that does: test_training_dist.py).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from PIL import Image

from megatron_dip.data.records import BadSampleError
from megatron_dip.data.sample import BatchMeta
from megatron_dip.data.stream import StreamError
from megatron_dip.training.config.arguments import parse_config
from megatron_dip.training.config.validate import ConfigError, resolve

VLM = ["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1e-3", "--global-batch-size", "2"]
T2V = ["--model", "tiny-t2v", "--train-iters", "2", "--lr", "1e-3", "--global-batch-size", "2"]


def corrupt_png_pixels(path: Path) -> None:
    """Scramble the compressed pixels of a PNG and fix the chunk checksum: the header and
    Pillow's `verify()` still pass, decoding fails (a file damaged past its header)."""
    data = bytearray(path.read_bytes())
    at = data.find(b"IDAT")
    (length,) = struct.unpack(">I", data[at - 4 : at])
    start = at + 4
    for k in range(start + 2, start + length - 4):
        data[k] ^= 0xFF
    data[start + length : start + length + 4] = struct.pack(
        ">I", zlib.crc32(data[at : start + length])
    )
    path.write_bytes(bytes(data))


def _image(root: Path, name: str, side: int = 32) -> str:
    Image.fromarray(np.full((side, side, 3), 90, np.uint8)).save(root / name)
    return name


def _record(rid: str, images: list[str], human: str = "<image>\nhi", gpt: str = "a cat") -> dict:
    rec = {"id": rid, "conversations": [
        {"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}  # fmt: skip
    if images:
        rec["image"] = images if len(images) > 1 else images[0]
    return rec


def _llava(tmp_path: Path, bad: dict | None, *, good: int = 12) -> str:
    """A LLaVA JSON of `good` ordinary records and `bad` (if any) in the middle."""
    ok = _image(tmp_path, "ok.png")
    records = [_record(f"good{i}", [ok]) for i in range(good)]
    if bad is not None:
        records.insert(good // 2, bad)
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    return str(path)


def _resolve(base: list[str], data: str, *extra: str):
    config = parse_config([*base, "--dip-data", data, *extra])
    return resolve(config, world_size=1, cuda=False)


def _stream(data: str, bad_samples: str):
    """The training stream of `data` for the tiny VLM (no `resolve`: the stream is the point)."""
    from megatron_dip.batching import packing_limits
    from megatron_dip.modelspec import tiny_vlm
    from megatron_dip.training.config.data_source import DataSpec, make_stream

    spec = DataSpec.parse(data, scale=1.0, image_size=32, bad_samples=bad_samples)
    model = tiny_vlm()
    return make_stream(spec, model, seed=0, global_batch_size=2, limits=packing_limits(model, 128))


def _bad_vlm_record(tmp_path: Path, kind: str, rid: str = "bad") -> tuple[dict, str]:
    """A record of one bad kind and the words its error must contain."""
    if kind == "missing image":
        return _record(rid, ["nope.png"]), rf"id '{rid}', image 'nope.png'.*cannot read image"
    if kind == "corrupt image":
        _image(tmp_path, "half.png")
        whole = (tmp_path / "half.png").read_bytes()
        (tmp_path / "half.png").write_bytes(whole[: len(whole) // 2])
        return _record(rid, ["half.png"]), rf"id '{rid}', image 'half.png'.*cannot read image"
    if kind == "too many images":  # 40 images of 4 LLM tokens: more than the 128 tokens
        rec = _record(rid, [_image(tmp_path, "ok.png")] * 40, human="<image>" * 40)
        return rec, rf"id '{rid}', image \[.*\]\)\): sample \d+ has \d+ text tokens, more than"
    assert kind == "long caption"
    return _record(rid, [], human="hi", gpt="word " * 40), rf"id '{rid}'.*text tokens, more than"


BAD_VLM = ["missing image", "corrupt image", "too many images", "long caption"]


@pytest.mark.parametrize("kind", BAD_VLM)
def test_bad_llava_sample_stops_the_stream_naming_it(tmp_path, kind):
    bad, words = _bad_vlm_record(tmp_path, kind)
    stream = _stream(f"llava:{_llava(tmp_path, bad)}", "error")
    with pytest.raises(StreamError, match=words):
        for _ in range(20):  # a few passes over the 13 records: the bad one comes
            next(stream)


@pytest.mark.parametrize("kind", ["corrupt image", "too many images"])
def test_bad_llava_sample_is_refused_before_any_process_group(tmp_path, kind):
    bad, words = _bad_vlm_record(tmp_path, kind)
    with pytest.raises(ConfigError, match=words) as info:
        _resolve(VLM, f"llava:{_llava(tmp_path, bad)}")
    flag = "--seq-length" if kind == "too many images" else "--dip-data"
    assert str(info.value).startswith(flag + ":"), info.value
    assert "--dip-bad-samples skip" in str(info.value)
    assert not dist.is_initialized()


def test_bad_llava_samples_are_skipped_counted_and_logged_once(tmp_path, caplog):
    bad = [_bad_vlm_record(tmp_path, kind, rid=f"bad{i}")[0] for i, kind in enumerate(BAD_VLM)]
    path = _llava(tmp_path, None, good=8)
    records = json.loads(Path(path).read_text()) + bad  # indices 8..11
    Path(path).write_text(json.dumps(records))
    with caplog.at_level(logging.WARNING, logger="megatron_dip.data"):
        stream = _stream(f"llava:{path}", "skip")
        stream.peek(3)
        batches = [next(stream) for _ in range(12)]  # several passes over the 12 records
    seen = {stream.dataset_index(m.sample_id) for b in batches for m in b.samples}
    assert seen == set(range(8))
    passes = sum(b.num_samples for b in batches) / 8
    assert stream.skipped >= 4 * int(passes)  # every pass skips all four
    for i in range(4):
        assert caplog.text.count(f"id 'bad{i}'") == 1, caplog.text  # logged once, with why
    assert "cannot read image" in caplog.text and "more than a microbatch holds" in caplog.text


def test_caption_longer_than_the_sequence_of_a_diffusion_model(tmp_path):
    from megatron_dip.data.diffusion import write_latent_dataset

    latent = np.zeros((1, 4, 4, 4), np.float32)
    records = [(f"c{i}", "a short caption", latent) for i in range(8)]
    records.insert(3, ("long", "many words " * 20, latent))
    write_latent_dataset(tmp_path / "latents", records)
    data = f"latents:{tmp_path / 'latents'}"
    with pytest.raises(ConfigError, match=r"^--seq-length: .*id 'long'.*text tokens, more than"):
        _resolve(T2V, data)
    spec = _resolve(T2V, data, "--dip-bad-samples", "skip")
    assert spec.data.bad_samples == "skip"


def test_empty_or_unusable_datasets_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ConfigError, match="^--dip-data: cannot form a batch: .*no samples"):
        _resolve(VLM, f"llava:{empty}")
    (tmp_path / "all_bad").mkdir()
    all_bad = tmp_path / "all_bad" / "data.json"
    all_bad.write_text(json.dumps([_record(f"b{i}", ["nope.png"]) for i in range(3)]))
    with pytest.raises(ConfigError, match="no usable sample in a whole pass over the 3 records"):
        _resolve(VLM, f"llava:{all_bad}", "--dip-bad-samples", "skip")


def test_synthetic_data_that_never_fits_is_refused_not_read_forever():
    with pytest.raises(ConfigError, match="^--seq-length: .*4096 consecutive stream positions"):
        _resolve(VLM, "synthetic-mixed", "--seq-length", "2", "--dip-bad-samples", "skip")


def test_pixels_corrupt_past_the_header_fail_at_load_naming_the_record(tmp_path):
    from megatron_dip.data.llava import LlavaDataset
    from megatron_dip.modelspec import tiny_vlm

    name = _image(tmp_path, "late.png")
    corrupt_png_pixels(tmp_path / name)
    path = _llava(tmp_path, _record("late", [name]), good=2)
    ds = LlavaDataset(path, model=tiny_vlm())
    assert ds.meta(1) is not None  # header and checksums are fine: nobody can tell yet
    with pytest.raises(BadSampleError, match=r"id 'late', image 'late.png'"):
        ds.sample(1)


def truncated_jpeg(root: Path, name: str, side: int = 32) -> str:
    """A JPEG cut to two thirds (a crawl interrupted mid-file): its header and Pillow's
    `verify()` pass, decoding fails."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(root / name)
    data = (root / name).read_bytes()
    (root / name).write_bytes(data[: len(data) * 2 // 3])
    return name


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_a_truncated_jpeg_is_caught_where_it_is_decoded(tmp_path, mode):
    """error: the record is named; skip: a blank image of the planned shape, no loss token,
    and why (the training loop names it once and counts it)."""
    from megatron_dip.data.image_text import ReaderConfig
    from megatron_dip.data.llava import LlavaDataset
    from megatron_dip.data.meta import sample_meta
    from megatron_dip.modelspec import tiny_vlm

    name = truncated_jpeg(tmp_path, "cut.jpg")
    path = _llava(tmp_path, _record("cut", [name]), good=2)
    ds = LlavaDataset(path, model=tiny_vlm(), config=ReaderConfig(on_bad_sample=mode))
    meta = ds.meta(1)
    assert meta is not None and meta.loss_tokens > 0  # nobody can tell from the header
    if mode == "error":
        with pytest.raises(BadSampleError, match=r"id 'cut', image 'cut.jpg'.*truncated"):
            ds.sample(1)
        return
    sample = ds.sample(1)
    assert re.search(r"id 'cut', image 'cut.jpg'.*cannot decode image 0: .*truncated", sample.bad)
    assert not sample.labels_mask.any() and not sample.media["vit"][0].any()
    blank = sample_meta(sample, model=tiny_vlm())
    assert blank.instances == meta.instances and blank.text_tokens == meta.text_tokens
    assert ds.sample(0).bad is None


# -- planner faults ----------------------------------------------------------------------------


def test_fault_injection_raises_or_stalls_while_batches_keep_arriving():
    from megatron_dip.planner.planner_loop import (
        InjectedFaultError,
        PlannerFaults,
        _receive,
        _stall,
    )

    pending: list = []
    _receive(BatchMeta(2, ()), pending, PlannerFaults(raise_at_iteration=3))
    with pytest.raises(InjectedFaultError, match="iteration 3"):
        _receive(BatchMeta(3, ()), pending, PlannerFaults(raise_at_iteration=3))
    assert [b.iteration for b in pending] == [2]
    inbox: queue.Queue = queue.Queue()
    for item in (BatchMeta(4, ()), None):
        inbox.put(item)
    assert _stall(PlannerFaults(delay_s=30.0), inbox, pending) is True  # stopped, not 30 s
    assert [b.iteration for b in pending] == [2, 4]
    assert _stall(PlannerFaults(delay_s=0.05), inbox, pending) is False


def test_greedy_plans_are_the_same_from_the_service_or_inline():
    """What lets a run fall back to inline plans without changing its losses."""
    from megatron_dip.schedule.serialize import plan_to_bytes
    from megatron_dip.training.config.data_source import make_stream
    from megatron_dip.training.iteration.planning import make_planner, replica_plan

    config = parse_config([*VLM, "--global-batch-size", "4", "--dip-search-time-ms", "0"])
    spec = resolve(config, world_size=2, cuda=False)
    assert spec.shape.dp == 2 and not spec.planner.use_search
    stream = make_stream(spec.data, spec.model, seed=0, global_batch_size=4, limits=spec.limits)
    service, inline = make_planner(spec), make_planner(spec)  # the process has its own
    for batch in stream.peek(3):
        published = service.plan_batch(batch, search=False)  # what the planner process sends
        for r in range(2):
            mine = replica_plan(inline, batch, r).plan
            assert plan_to_bytes(mine) == plan_to_bytes(published[r].plan)


# -- non-finite losses ---------------------------------------------------------------------------


def test_a_non_finite_streak_stops_the_run_naming_its_iterations():
    from megatron_dip.training.iteration.nonfinite import NonFiniteError, NonFiniteStreak

    streak = NonFiniteStreak(3)
    streak.observe(1, loss=float("nan"), grad_norm=float("nan"))
    streak.observe(2, loss=2.5, grad_norm=1.0)  # a finite iteration ends the streak
    streak.observe(3, loss=float("inf"), grad_norm=None)
    streak.observe(4, loss=2.5, grad_norm=float("nan"))
    with pytest.raises(
        NonFiniteError,
        match=r"^iterations 3-5: .*non-finite for 3 consecutive "
        r"iterations \(--dip-max-nonfinite-iters 3\)",
    ):
        streak.observe(5, loss=float("nan"), grad_norm=float("nan"))
    never = NonFiniteStreak(0)
    for it in range(1, 50):
        never.observe(it, loss=float("nan"), grad_norm=None)
    assert never.count == 49
