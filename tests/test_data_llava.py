"""LLaVA-style reader (streaming JSON index), offline byte tokenizer and the generated tiny sample
dataset. Hugging Face tokenizers and chat templates: test_data_chat.py; image preprocessing:
test_data_image.py."""

import json
import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from megatron_dip.data.image import ImageProcessorConfig, smart_resize
from megatron_dip.data.image_text import ReaderConfig
from megatron_dip.data.json_index import JsonRecords
from megatron_dip.data.llava import LlavaDataset
from megatron_dip.data.meta import sample_meta
from megatron_dip.data.records import BadSampleError
from megatron_dip.data.sample import IMAGE_TOKEN, PAD_TOKEN
from megatron_dip.data.stream import BatchStream, StreamConfig
from megatron_dip.data.tiny_llava import make_tiny_llava_sample
from megatron_dip.data.tokenizer import ByteTokenizer
from megatron_dip.modelspec import tiny_vlm

MODEL = tiny_vlm()  # patch 8, merge 2: grid unit 16 px, vocab 128
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llava_sample(tmp_path_factory.mktemp("llava"), num_samples=16, seed=0)


@given(st.text(max_size=40))
def test_tokenizer_round_trips_any_text(text):
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert ids.size == 0 or (ids.min() >= 2 and ids.max() < TOK.vocab_size)


def test_tokenizer_layout_fits_the_tiny_vocab():
    assert TOK.vocab_size <= 128 and (TOK.pad_id, TOK.image_id) == (PAD_TOKEN, IMAGE_TOKEN)
    assert TOK.encode("ab").tolist() == [TOK.encode("a")[0], TOK.encode("a")[0] + 1]
    assert len(TOK.encode("é")) == 6  # two UTF-8 bytes, escaped as three tokens each
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([500])


def test_tiny_sample_round_trips(tiny):
    records = json.loads(tiny.read_text())
    ds = LlavaDataset(tiny, model=MODEL, config=ReaderConfig(image=ImageProcessorConfig(4096)))
    assert ds.num_samples == len(records) == 16
    for i, record in enumerate(records):
        s = ds.sample(i)
        assert s.sample_id == i and ds.record_id(i) == record["id"]
        assert sample_meta(s, model=MODEL) == ds.meta(i)
        # text: BOS, prompt with the image run, newline, caption, EOS; loss only on the caption
        prompt = record["conversations"][0]["value"]
        caption = record["conversations"][1]["value"]
        assert TOK.decode(s.text) == prompt.replace("<image>", "") + "\n" + caption
        assert TOK.decode(s.text[s.labels_mask == 1]) == caption
        assert s.text[s.labels_mask == 1][-1] == TOK.eos_id
        assert ds.meta(i).loss_tokens == len(TOK.encode(caption)) + 1  # the caption and EOS
        (image,) = s.media["vit"]
        with Image.open(tiny.parent / record["image"]) as im:
            w, h = im.size
        size = smart_resize(h, w, factor=16, min_pixels=256, max_pixels=4096)
        assert image.shape == (3, *size) and size[0] * size[1] <= 4096
        assert (s.text == IMAGE_TOKEN).sum() == image.shape[1] * image.shape[2] // 256
        assert image.min() >= -1.0 and image.max() <= 1.0


def test_tiny_sample_is_deterministic(tmp_path):
    a = make_tiny_llava_sample(tmp_path / "a", num_samples=3, seed=5)
    b = make_tiny_llava_sample(tmp_path / "b", num_samples=3, seed=5)
    assert a.read_text() == b.read_text()
    assert (a.parent / "images/0002.png").read_bytes() == (
        b.parent / "images/0002.png"
    ).read_bytes()


def test_image_pixels_survive_resizing(tmp_path):
    pixels = np.zeros((32, 48, 3), np.uint8)
    pixels[:, :24] = 255
    Image.fromarray(pixels).save(tmp_path / "x.png")
    conv = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "half"}]
    (tmp_path / "d.json").write_text(
        json.dumps([{"id": "x", "image": "x.png", "conversations": conv}])
    )
    (image,) = LlavaDataset(tmp_path / "d.json", model=MODEL).sample(0).media["vit"]
    assert image.shape == (3, 32, 48)
    assert np.allclose(image[:, :, :20], 1.0) and np.allclose(image[:, :, 28:], -1.0)


def _write(tmp_path, records):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    return path


def _record(rid, image="0000.png", human="<image>\nhi", gpt="a cat"):
    rec = {
        "id": rid,
        "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}],
    }
    if image is not None:
        rec["image"] = image
    return rec


@pytest.fixture
def mixed_quality(tmp_path):
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / "0000.png")
    good = (tmp_path / "0000.png").read_bytes()
    (tmp_path / "broken.png").write_bytes(good[: len(good) // 2])
    return _write(
        tmp_path,
        [
            _record("ok"),
            _record("missing", image="nope.png"),
            _record("broken", image="broken.png"),
            _record("two-tags", human="<image><image>"),
            _record("text-only", image=None, human="hello"),
            {"id": "no-conv"},
        ],
    )


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (1, "id 'missing', image 'nope.png'.*nope.png"),
        (2, "id 'broken', image 'broken.png'.*broken.png"),
        (3, "id 'two-tags'.*2 <image> tags for 1 images"),
        (5, "id 'no-conv'.*'conversations'"),
    ],
)
def test_bad_records_raise_naming_id_and_path(mixed_quality, index, message):
    ds = LlavaDataset(mixed_quality, model=MODEL)
    with pytest.raises(BadSampleError, match=message):
        ds.meta(index)


def test_bad_records_are_counted_logged_and_skipped_by_the_stream(mixed_quality, caplog):
    ds = LlavaDataset(mixed_quality, model=MODEL, config=ReaderConfig(on_bad_sample="skip"))
    with caplog.at_level(logging.WARNING):
        batch = next(BatchStream(ds, config=StreamConfig(batch_samples=2, shuffle=False)))
    assert [m.sample_id for m in batch.samples] == [0, 4]
    assert ds.skipped == 3 and "id 'broken'" in caplog.text
    text_only = ds.sample(4)
    assert text_only.media.get("vit") == [] and TOK.decode(text_only.text) == "hello\na cat"
    with pytest.raises(BadSampleError, match="skipped as bad"):
        ds.sample(1)


def test_reader_rejects_models_it_cannot_feed(tiny):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        LlavaDataset(tiny, model=tiny_vlm(vocab=64))


# -- the streaming JSON index ------------------------------------------------------------------

RECORDS = [{"id": i, "t": "é" * i + "x", "nested": [1, {"s": "],{"}]} for i in range(40)]


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(RECORDS, indent=1),
        json.dumps(RECORDS),
        "\n".join(json.dumps(r) for r in RECORDS) + "\n",  # JSON Lines
    ],
    ids=["list-indented", "list-compact", "json-lines"],
)
def test_json_index_reads_every_record_by_offset(tmp_path, text):
    path = tmp_path / "records.json"
    path.write_text(text, encoding="utf-8")
    records = JsonRecords(path, chunk=7)  # a window smaller than a record: read on as needed
    assert len(records) == 40 and list(records) == RECORDS
    assert records[39] == RECORDS[39] and records.index_bytes == 40 * 16


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[{}", "not closed|expected ','"),
        ("[1]", "record 0 at byte 1 is not an object"),
        ('[{"a": 1},]', r"bad.json:1:11: invalid JSON in record 1 \(byte 10\): Expecting value"),
        ("[{}] x", "text after the JSON list"),
    ],
)
def test_json_index_refuses_malformed_files_naming_the_byte(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        JsonRecords(path)


@pytest.mark.parametrize("lines", [False, True], ids=["list", "json-lines"])
def test_malformed_json_is_one_line_naming_the_file_line_and_column(tmp_path, lines):
    """Deep in a file read through a small window (the text before it was dropped): the line
    and column are the file's, and the run stops before any process group, in one line."""
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.validate import ConfigError, resolve

    records = [json.dumps(r) for r in RECORDS]
    records[30] = records[30].replace('"t": "', '"t": "\n', 1)  # a raw newline in a string
    text = "\n".join(records) if lines else "[\n" + ",\n".join(records) + "\n]"
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    line = 31 + (not lines)
    column = len(records[30].split("\n")[0]) + 1  # where the string breaks
    want = rf"{path}:{line}:{column}: invalid JSON in record 30 \(byte \d+\): Invalid control"
    with pytest.raises(ValueError, match=want):
        JsonRecords(path, chunk=7)
    argv = [
        "--model",
        "tiny-vlm",
        "--lr",
        "1e-3",
        "--train-iters",
        "1",
        "--dip-data",
        f"llava:{path}",
    ]
    with pytest.raises(ConfigError) as info:
        resolve(parse_config(argv), world_size=1, cuda=False)
    message = str(info.value)
    assert message.startswith(f"--dip-data: cannot read {path}:{line}:{column}: "), message
    assert "\n" not in message and message.count(str(path)) == 1


_RSS_PROBE = """
import resource, sys
from megatron_dip.data.llava import LlavaDataset
from megatron_dip.modelspec import tiny_vlm
ds = LlavaDataset(sys.argv[1], model=tiny_vlm())
for i in range(0, ds.num_samples, ds.num_samples // 50):
    assert ds.meta(i) is not None
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, ds.records.index_bytes)
"""


def _write_text_records(path, n: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(n):
            human = "Describe the scene in detail please, with all of its objects. " * 2
            gpt = f"record {i}: " + "a long answer about many things " * 6
            conv = [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]
            f.write(("," if i else "") + json.dumps({"id": f"{i:09d}", "conversations": conv}))
        f.write("]\n")


def test_reader_memory_grows_with_the_index_not_the_file(tmp_path):
    """A 10x larger LLaVA file (4 -> 43 MB) grows the reader's peak RSS by less than twice its
    index (16 bytes a record), not by the parsed list (~6x the file); fresh processes."""
    import os
    import subprocess
    import sys

    peaks = {}
    for n in (10_000, 100_000):
        path = tmp_path / f"records{n}.json"
        _write_text_records(path, n)
        out = subprocess.run(
            [sys.executable, "-c", _RSS_PROBE, str(path)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            check=True,
            timeout=120,
        )
        peaks[n] = [int(x) for x in out.stdout.split()]
    (small, _), (large, index) = peaks[10_000], peaks[100_000]
    assert index == 100_000 * 16
    assert large - small < 2 * index, (small, large, index)


def _latin1_record(tmp_path, *, lines: bool):
    """A LLaVA file whose record 2 holds a Latin-1 byte ("café" written as 0xe9)."""
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / "0000.png")
    records = [json.dumps(_record(f"r{i}", gpt=f"cat {i}")) for i in range(4)]
    text = "\n".join(records) if lines else "[\n" + ",\n".join(records) + "\n]"
    data = text.encode().replace(b'"cat 2"', b'"caf\xe9 2"')
    path = tmp_path / "data.json"
    path.write_bytes(data)
    return path, data.index(b"\xe9")


@pytest.mark.parametrize("lines", [False, True], ids=["list", "json-lines"])
def test_a_non_utf8_byte_spoils_only_its_record(tmp_path, lines, caplog):
    """skip: that record is skipped (counted, logged once naming it, its file and line);
    error: one line naming the file, the line, the record and the byte."""
    path, at = _latin1_record(tmp_path, lines=lines)
    line = 4 if not lines else 3
    config = ReaderConfig(on_bad_sample="skip")
    with caplog.at_level(logging.WARNING):
        ds = LlavaDataset(path, model=MODEL, config=config)
        metas = [ds.meta(i) for i in range(4)] + [ds.meta(2)]
    assert [m is None for m in metas] == [False, False, True, False, True] and ds.skipped == 1
    skips = [r.getMessage() for r in caplog.records if "skipping bad record" in r.getMessage()]
    assert len(skips) == 1, skips
    assert f"LLaVA record 2 of {path}: {path}:{line}:" in skips[0]
    assert f"record 2 is not UTF-8 text (byte 0xe9 at offset {at})" in skips[0]
    with pytest.raises(ValueError) as info:
        LlavaDataset(path, model=MODEL)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}:") and "\n" not in message
    assert f"record 2 is not UTF-8 text (byte 0xe9 at offset {at})" in message
    assert message.endswith("--dip-bad-samples skip")


def test_image_paths_stay_inside_the_dataset_root(tmp_path, caplog):
    """A `../` path to a real file outside the root, and an absolute one: refused (error),
    skipped (skip), read with allow_outside_paths (--dip-allow-outside-paths)."""
    root = tmp_path / "data"
    root.mkdir()
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / "outside.png")
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(root / "0000.png")
    (root / "sub").mkdir()
    records = [
        _record("in"),
        _record("up", image="../outside.png"),
        _record("abs", image=str(tmp_path / "outside.png")),
        _record("down-up", image="sub/../0000.png"),  # stays inside: fine
    ]
    path = _write(root, records)
    strict = LlavaDataset(path, model=MODEL)
    for index, name in [(1, "'../outside.png'"), (2, repr(str(tmp_path / "outside.png")))]:
        with pytest.raises(BadSampleError) as info:
            strict.meta(index)
        message = str(info.value)
        assert message.startswith(f"LLaVA record {index} of {path} (id ")
        assert (
            f"path {name} leads outside the dataset root {root} (to {tmp_path}/outside.png)"
            in message
        )
        assert message.endswith("--dip-allow-outside-paths")
    assert strict.meta(3) is not None
    skip = LlavaDataset(path, model=MODEL, config=ReaderConfig(on_bad_sample="skip"))
    with caplog.at_level(logging.WARNING):
        assert [skip.meta(i) is None for i in range(4)] == [False, True, True, False]
    assert skip.skipped == 2 and "id 'up'" in caplog.text and "leads outside" in caplog.text
    allowed = LlavaDataset(path, model=MODEL, config=ReaderConfig(allow_outside_paths=True))
    assert all(allowed.meta(i) is not None for i in range(4))
    assert allowed.sample(1).media["vit"][0].shape == allowed.sample(0).media["vit"][0].shape


def _resolve(*flags):
    from megatron_dip.training.config.arguments import parse_config
    from megatron_dip.training.config.validate import resolve

    argv = ["--model", "tiny-vlm", "--lr", "1e-3", "--train-iters", "1", "--global-batch-size",
            "2", "--dip-image-size", "32", *flags]  # fmt: skip
    return resolve(parse_config(argv), world_size=1, cuda=False)


def test_each_bad_record_is_logged_once_per_rank(mixed_quality, caplog):
    """The run's readers (the start-up check of the first batches, training, evaluation)
    share one log: each bad record is named once; the missing validation split too."""
    from megatron_dip.training.config.data_source import make_stream

    records = json.loads(mixed_quality.read_text())
    path = _write(mixed_quality.parent, records + [_record(f"ok{i}") for i in range(8)])
    with caplog.at_level(logging.WARNING):
        spec = _resolve("--dip-data", f"llava:{path}", "--dip-bad-samples", "skip")
        for evaluation in (False, True):
            stream = make_stream(
                spec.data,
                spec.model,
                seed=1,
                global_batch_size=2,
                limits=spec.limits,
                evaluation=evaluation,
            )
            for _ in range(3):  # every record, more than once
                next(stream)
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    for rid in ("missing", "broken", "two-tags", "no-conv"):
        assert sum(f"id '{rid}'" in s for s in skips) == 1, (rid, skips)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluation:")]
    assert len(notes) == 1 and f"llava:{path} has no validation split" in notes[0]
    assert "not held out" in notes[0]


def test_the_outside_paths_flag_reaches_the_reader(tmp_path):
    path = make_tiny_llava_sample(tmp_path / "llava", num_samples=4, seed=0)
    assert not _resolve("--dip-data", f"llava:{path}").data.reader_config().allow_outside_paths
    spec = _resolve("--dip-data", f"llava:{path}", "--dip-allow-outside-paths")
    assert spec.data.reader_config().allow_outside_paths


def test_a_non_utf8_record_stops_the_run_at_start_up_in_one_line(tmp_path):
    from megatron_dip.training.config.validate import ConfigError

    path, _ = _latin1_record(tmp_path, lines=True)
    with pytest.raises(ConfigError) as info:
        _resolve("--dip-data", f"llava:{path}")
    message = str(info.value)
    assert message.startswith(f"--dip-data: cannot read {path}:3:") and "\n" not in message
    assert "record 2 is not UTF-8" in message
    assert _resolve("--dip-data", f"llava:{path}", "--dip-bad-samples", "skip") is not None
