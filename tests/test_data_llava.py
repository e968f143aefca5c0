"""LLaVA-style reader, offline tokenizer and the generated tiny sample dataset."""

import json
import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from megatron_dip.data.llava import LlavaConfig, LlavaDataset, grid_size
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


def test_grid_size_keeps_aspect_and_respects_max_side():
    assert grid_size(height=480, width=640, unit=16, max_side=64) == (48, 64)
    assert grid_size(height=20, width=90, unit=16, max_side=64) == (16, 64)
    assert grid_size(height=5, width=5, unit=16, max_side=64) == (16, 16)  # at least one unit
    assert grid_size(height=728, width=1000, unit=56, max_side=728) == (504, 728)
    with pytest.raises(ValueError, match="smaller than one grid unit"):
        grid_size(height=10, width=10, unit=16, max_side=8)


def test_tiny_sample_round_trips(tiny):
    records = json.loads(tiny.read_text())
    ds = LlavaDataset(tiny, model=MODEL, config=LlavaConfig(max_side=64))
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
        assert image.shape == (3, *grid_size(height=h, width=w, unit=16, max_side=64))
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
        (3, "id 'two-tags'.*more <image> tags than the 1 images"),
        (5, "id 'no-conv'.*'conversations'"),
    ],
)
def test_bad_records_raise_naming_id_and_path(mixed_quality, index, message):
    ds = LlavaDataset(mixed_quality, model=MODEL)
    with pytest.raises(BadSampleError, match=message):
        ds.meta(index)


def test_bad_records_are_counted_logged_and_skipped_by_the_stream(mixed_quality, caplog):
    ds = LlavaDataset(mixed_quality, model=MODEL, config=LlavaConfig(on_bad_sample="skip"))
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
