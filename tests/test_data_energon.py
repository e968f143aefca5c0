"""Megatron-Energon datasets (`data.energon`, `data.energon_order`, `data.energon_write`), built
here from generated shards with `energon prepare`: captioning, VQA, interleaved and crude (the
LLaVA converter's, and one with a user cooker) samples; metadata without decoding images;
Energon's shard split over data-parallel replicas; a 3:1 blend; exact resume of the stream."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re

import numpy as np
import pytest
import webdataset
from megatron.energon import WorkerConfig
from PIL import Image, ImageFile

from megatron_dip.data import energon
from megatron_dip.data.energon import MAX_SAMPLES_PER_SEQUENCE, EnergonSource
from megatron_dip.data.energon_write import prepare, write_llava_energon
from megatron_dip.data.image_text import ReaderConfig
from megatron_dip.data.llava import LlavaDataset
from megatron_dip.data.meta import sample_meta
from megatron_dip.data.stream import BatchStream, StreamConfig
from megatron_dip.data.tiny_llava import make_tiny_llava_sample
from megatron_dip.data.tokenizer import ByteTokenizer
from megatron_dip.modelspec import tiny_vlm

MODEL = tiny_vlm()
TOK = ByteTokenizer()
CONFIG = ReaderConfig()
INTERLEAVED_LOADER = """
def sample_loader(raw: dict) -> dict:
    items = raw["json"]["sequence"]
    return dict(sequence=[raw[i["image"]] if isinstance(i, dict) else i for i in items])


def part_filter(part: str) -> bool:
    return True
"""


def _png(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _shards(root, samples, *, per_shard: int = 7):
    root.mkdir(parents=True, exist_ok=True)
    with webdataset.ShardWriter(str(root / "part-%06d.tar"), maxcount=per_shard, verbose=0) as w:
        for sample in samples:
            w.write(sample)
    return root


def _captions(n: int, offset: int = 0):
    for i in range(n):
        yield {
            "__key__": f"c{i:05d}",
            "png": _png(18 + i % 20, 40 - i % 15, offset + i),
            "txt": f"caption number {offset + i}".encode(),
        }


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("energon")
    out = {}
    out["caption"] = _shards(tmp / "caption", _captions(30))
    prepare(
        out["caption"], sample_type="CaptioningSample", field_map={"image": "png", "caption": "txt"}
    )
    out["headers"] = _shards(tmp / "headers", _captions(10))  # no media metadata in its index
    prepare(
        out["headers"],
        sample_type="CaptioningSample",
        field_map={"image": "png", "caption": "txt"},
        media_metadata=False,
    )
    vqa = (
        {
            "__key__": f"q{i:05d}",
            "png": _png(32, 32, 100 + i),
            "json": json.dumps(
                {
                    "question": f"what is {i}?",
                    "answers": ["no", f"it is {i}"],
                    "weights": [0.2, 0.8],
                }
            ).encode(),
        }
        for i in range(10)
    )
    out["vqa"] = _shards(tmp / "vqa", vqa)
    fields = {
        "image": "png",
        "context": "json[question]",
        "answers": "json[answers]",
        "answer_weights": "json[weights]",
    }
    prepare(out["vqa"], sample_type="VQASample", field_map=fields)
    docs = (
        {
            "__key__": f"d{i:05d}",
            "img0.png": _png(16, 48, 200 + i),
            "json": json.dumps(
                {"sequence": [f"before {i} ", {"image": "img0.png"}, " after"]}
            ).encode(),
        }
        for i in range(6)
    )
    out["interleaved"] = _shards(tmp / "interleaved", docs)
    prepare(out["interleaved"], sample_type="InterleavedSample")
    (out["interleaved"] / ".nv-meta" / "sample_loader.py").write_text(INTERLEAVED_LOADER)
    out["crude"] = _shards(tmp / "crude", _captions(8))
    prepare(out["crude"], sample_type="CrudeWebdataset")
    yaml = out["crude"] / ".nv-meta" / "dataset.yaml"
    yaml.write_text(yaml.read_text() + "subflavors:\n  kind: caption\n")
    out["llava_json"] = make_tiny_llava_sample(tmp / "llava", num_samples=12, seed=4)
    write_llava_energon(out["llava_json"], tmp / "llava_energon", samples_per_shard=5)
    out["llava"] = tmp / "llava_energon"
    blend = tmp / "blend.yaml"
    blend.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        f"      - weight: 3\n        path: {out['caption']}\n"
        f"      - weight: 1\n        path: {out['vqa']}\n"
    )
    out["blend"] = blend
    out["split"] = _shards(tmp / "split", _captions(20), per_shard=5)
    prepare(
        out["split"],
        sample_type="CaptioningSample",
        field_map={"image": "png", "caption": "txt"},
        split_ratio="3,1,0",
    )
    return out


def _source(path, **kw) -> EnergonSource:
    return EnergonSource(
        str(path),
        model=MODEL,
        config=kw.pop("config", CONFIG),
        seed=kw.pop("seed", 0),
        slots=kw.pop("slots", 2),
        **kw,
    )


def _check_consistent(src: EnergonSource, positions) -> list:
    samples = []
    for position, meta in zip(positions, src.metas(list(positions))):
        sample = src.sample(position)
        assert sample_meta(sample, model=MODEL) == meta
        samples.append(sample)
    return samples


def test_captioning_samples(datasets):
    src = _source(datasets["caption"])
    for s in _check_consistent(src, range(10)):
        loss = TOK.decode(s.text[s.labels_mask == 1])
        assert loss.startswith("caption number ") and s.text[s.labels_mask == 1][-1] == TOK.eos_id
        assert TOK.decode(s.text).startswith("\n" + energon.CAPTION_PROMPT)  # after the image
        (image,) = s.media["vit"]
        assert image.shape[0] == 3 and image.shape[1] % 16 == 0 and image.min() >= -1.0


def test_vqa_samples_answer_with_the_best_weighted_answer(datasets):
    for s in _check_consistent(_source(datasets["vqa"]), range(6)):
        question, answer = (
            TOK.decode(s.text[s.labels_mask == 0]),
            TOK.decode(s.text[s.labels_mask == 1]),
        )
        number = question.split("what is ")[1].split("?")[0]
        assert answer == f"it is {number}"


def test_interleaved_documents_carry_loss_on_all_text(datasets):
    for s in _check_consistent(_source(datasets["interleaved"]), range(6)):
        image = MODEL.module("vit").placeholder_id
        text = s.text[1:][s.text[1:] != image]
        assert s.labels_mask[1:][s.text[1:] != image].all() and TOK.decode(text).endswith(" after")
        assert len(s.media["vit"]) == 1 and s.media["vit"][0].shape == (3, 16, 48)


def test_crude_datasets_are_cooked_by_the_built_in_or_a_named_cooker(datasets):
    with pytest.raises(energon.BadSampleError, match="no cooker for crude samples"):
        _source(datasets["crude"]).metas([0])
    src = _source(datasets["crude"], cooker="energon_cookers:COOKERS")
    for s in _check_consistent(src, range(4)):
        assert TOK.decode(s.text[s.labels_mask == 1]).startswith("caption number ")
        assert len(s.media["vit"]) == 1
    with pytest.raises(ValueError, match="--dip-energon-cooker: cannot import"):
        _source(datasets["crude"], cooker="energon_cookers:NOPE")


def test_converted_llava_data_equals_the_llava_reader(datasets):
    src = _source(datasets["llava"])
    reader = LlavaDataset(datasets["llava_json"], model=MODEL)
    for position in range(12):
        _, index = src.locate(position)
        a, b = src.sample(position), reader.sample(index)
        np.testing.assert_array_equal(a.text, b.text)
        np.testing.assert_array_equal(a.labels_mask, b.labels_mask)
        for x, y in zip(a.media["vit"], b.media["vit"], strict=True):
            np.testing.assert_array_equal(x, y)
        assert src.metas([position])[0] == dataclasses.replace(
            reader.meta(index), sample_id=position
        )


def test_lookahead_decodes_no_image(datasets, monkeypatch):
    """With Energon's media metadata the lookahead reads no image bytes at all; without it,
    only the headers (Pillow's lazy open), never the pixels."""

    def refuse(*args, **kwargs):
        raise AssertionError("decoded an image for metadata")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    monkeypatch.setattr(energon.EncodedImage, "open", refuse)
    assert all(m is not None for m in _source(datasets["headers"]).metas(range(10)))
    monkeypatch.setattr(Image, "open", refuse)
    metas = _source(datasets["caption"]).metas(range(30))
    assert all(m is not None and m.instances_of("vit").tokens for m in metas)


def test_shards_are_split_over_replicas_as_energon_splits_them(datasets):
    """slots = DP x workers: the order's workers are Energon's (rank r, DP, workers) slices."""
    src = _source(datasets["caption"], slots=4)
    factory = src.parts[0].factory
    energon_slices = []
    for rank in range(2):
        config = WorkerConfig(rank=rank, world_size=2, num_workers=2)
        energon_slices += factory.shard_workers(
            factory.shards, worker_config=config, max_samples_per_sequence=MAX_SAMPLES_PER_SEQUENCE
        )
    assert src.orders[0].workers == [tuple(w) for w in energon_slices]
    epoch = [src.locate(p)[1] for p in range(30)]
    assert sorted(epoch) == list(range(30))  # every sample once per epoch
    rounds = min(b[-1] - b[0] for b in energon_slices)
    for w, bounds in enumerate(energon_slices):  # the workers take turns: draw p reads p % 4
        assert all(bounds[0] <= epoch[p] < bounds[-1] for p in range(w, 4 * rounds, 4))
    assert [src.locate(p)[1] for p in range(30, 60)] != epoch  # epochs reshuffle the slices
    assert sorted(src.locate(p)[1] for p in range(30, 60)) == list(range(30))


def test_a_blend_of_two_datasets_delivers_its_weights(datasets):
    src = _source(datasets["blend"])
    assert src.weights == pytest.approx([0.75, 0.25]) and len(src.parts) == 2  # normalised
    draws = [src.locate(p)[0] for p in range(400)]
    assert 0.9 * 300 <= draws.count(0) <= 1.1 * 300 and 0.9 * 100 <= draws.count(1) <= 1.1 * 100
    metas = src.metas(range(40))
    assert all(m.sample_id == p for p, m in enumerate(metas))
    _check_consistent(src, [p for p in range(40) if draws[p] == 1][:3])


def test_the_blend_is_logged_with_weights_and_its_realised_shares_counted(datasets, caplog):
    """The start-up log names each dataset with its weight and share; `realised_shares` (the
    interval line's --dip-log-blend) counts what the blend drew, incrementally and from 0."""
    import logging

    with caplog.at_level(logging.INFO, logger="megatron_dip.data.energon"):
        src = _source(datasets["blend"])
    line = next(r.getMessage() for r in caplog.records if "share 75.0%" in r.getMessage())
    assert f"{datasets['caption']}: weight 0.75, share 75.0%" in line
    assert f"{datasets['vqa']}: weight 0.25, share 25.0%" in line
    draws = [src.locate(p)[0] for p in range(400)]
    expected = [draws.count(0) / 400, draws.count(1) / 400]
    assert src.realised_shares(150) == pytest.approx(
        [draws[:150].count(0) / 150, draws[:150].count(1) / 150]
    )
    assert src.realised_shares(400) == pytest.approx(expected)  # counted on from 150
    assert src.realised_shares(10) == pytest.approx(
        [draws[:10].count(0) / 10, draws[:10].count(1) / 10]
    )


def test_the_stream_resumes_exactly_and_refuses_another_order(datasets):
    def stream(slots=2):
        return BatchStream(
            _source(datasets["blend"], slots=slots),
            config=StreamConfig(batch_samples=5, seed=3, shuffle=False),
        )

    full = stream()
    for _ in range(3):
        next(full)
    state = full.state_dict()
    assert state["source"] is not None and "energon" in state["source"]
    expected = [next(full) for _ in range(2)]
    resumed = stream()
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(2)] == expected
    got = resumed.samples(expected[1])
    assert [s.text.tolist() for s in got] == [s.text.tolist() for s in full.samples(expected[1])]
    with pytest.raises(ValueError, match="saved over another data source"):
        stream(slots=4).load_state_dict(state)


def test_evaluation_reads_the_val_split(datasets):
    from megatron_dip.training.config.data_source import DataSpec

    spec = DataSpec.parse(f"energon:{datasets['split']}", scale=1.0, image_size=32)
    train, val = spec.source(MODEL, seed=0), spec.source(MODEL, seed=0, evaluation=True)
    assert (train.split, val.split) == ("train", "val")
    assert (
        sum(p.num_samples for p in train.parts) == 15 and sum(p.num_samples for p in val.parts) == 5
    )
    assert spec.source(MODEL, seed=0, evaluation=True) is not None
    only_train = DataSpec.parse(f"energon:{datasets['caption']}", scale=1.0, image_size=32)
    assert only_train.source(MODEL, seed=0, evaluation=True).split == "train"


def test_converter_names_or_skips_records_whose_images_are_missing(tmp_path):
    path = make_tiny_llava_sample(tmp_path / "llava", num_samples=3, seed=5)
    records = json.loads(path.read_text())
    records[1]["image"] = "images/missing.png"
    path.write_text(json.dumps(records))
    with pytest.raises(energon.BadSampleError, match=r"record 1 \(id 'tiny00001'\).*missing.png"):
        write_llava_energon(path, tmp_path / "strict")
    assert write_llava_energon(path, tmp_path / "lenient", skip_bad=True) == (2, 1)
    assert [m.sample_id for m in _source(tmp_path / "lenient").metas(range(2))] == [0, 1]


def test_converter_keeps_images_inside_the_root_and_skips_non_utf8_records(tmp_path):
    """A `../` image path and a Latin-1 byte: named (strict) or skipped (--skip-bad); the
    outside path converts with allow_outside_paths; --split-ratio leaves a val split."""
    path = make_tiny_llava_sample(tmp_path / "llava", num_samples=4, seed=6)
    records = json.loads(path.read_text())
    (tmp_path / "outside.png").write_bytes((path.parent / records[0]["image"]).read_bytes())
    records[1]["image"] = "../outside.png"
    text = json.dumps(records, indent=1).encode()
    path.write_bytes(text.replace(b'"id": "tiny00003"', b'"id": "tiny\xe900003"', 1))
    with pytest.raises(energon.BadSampleError, match=r"record 1 .*leads outside the dataset root"):
        write_llava_energon(path, tmp_path / "strict")
    assert write_llava_energon(path, tmp_path / "lenient", skip_bad=True) == (2, 2)
    allowed = write_llava_energon(
        path,
        tmp_path / "outside",
        skip_bad=True,
        allow_outside_paths=True,
        split_ratio="2,1,0",
        samples_per_shard=1,
    )
    assert allowed == (3, 1)
    assert energon.has_samples(str(tmp_path / "outside"), split="val")


def _jpeg(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def test_a_header_corrupt_after_prepare_blanks_the_sample_in_skip_mode(tmp_path):
    """The index's media metadata planned the sample; its JPEG header was then corrupted in
    the shard (same length, so the tar index holds): skip trains a blank of the planned shape
    with no loss and says why; error names the sample."""
    images = [_jpeg(24, 40, i) for i in range(4)]
    samples = [
        {"__key__": f"j{i}", "jpg": image, "txt": f"caption {i}".encode()}
        for i, image in enumerate(images)
    ]
    root = _shards(tmp_path / "jpeg", samples, per_shard=4)
    prepare(root, sample_type="CaptioningSample", field_map={"image": "jpg", "caption": "txt"})
    shard = root / "part-000000.tar"
    data = shard.read_bytes()
    at = data.index(images[2])
    shard.write_bytes(data[:at] + b"\0" * 16 + data[at + 16 :])  # its SOI and APP0 markers
    skip = _source(root, slots=1, config=ReaderConfig(on_bad_sample="skip"))
    metas = skip.metas(list(range(4)))
    assert all(m is not None for m in metas)  # planned from the index: the header is not read
    samples = [skip.sample(p) for p in range(4)]
    bad = [s for s in samples if s.bad is not None]
    assert len(bad) == 1 and "cannot identify image file" in bad[0].bad
    assert "Energon sample" in bad[0].bad and "part-000000.tar" in bad[0].bad
    assert not bad[0].labels_mask.any() and not bad[0].media["vit"][0].any()
    for sample, meta in zip(samples, metas):  # the planned shapes, blank or not
        seen = sample_meta(sample, model=MODEL)
        assert dataclasses.replace(seen, loss_tokens=meta.loss_tokens) == meta
    strict = _source(root, slots=1)
    position = next(p for p, s in enumerate(samples) if s.bad is not None)
    with pytest.raises(energon.BadSampleError, match=r"Energon sample \d+ \(part-000000.tar"):
        strict.sample(position)


def test_evaluation_without_a_val_split_says_so(datasets, caplog):
    from megatron_dip.training.config.data_source import DataSpec

    only_train = DataSpec.parse(f"energon:{datasets['caption']}", scale=1.0, image_size=32)
    with caplog.at_level(logging.WARNING):
        only_train.source(MODEL, seed=0)
        assert caplog.text == ""
        only_train.source(MODEL, seed=0, evaluation=True)
    assert f"energon:{datasets['caption']} has no validation split" in caplog.text
    assert "'val' split has no samples" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        split = DataSpec.parse(f"energon:{datasets['split']}", scale=1.0, image_size=32)
        split.source(MODEL, seed=0, evaluation=True)
    assert "no validation split" not in caplog.text


def test_the_interval_line_of_a_training_run_names_the_realised_blend(
    datasets, caplog, single_rank_world
):
    """--dip-log-blend end to end: a one-process run on the 3:1 blend logs, on its interval
    line, the shares of the samples it has consumed (what `realised_shares` counts)."""
    from test_training_scenarios import COMMON, run

    flags = COMMON + ["--dip-data", f"energon:{datasets['blend']}", "--dip-log-blend"]
    flags += ["--train-iters", "2", "--log-interval", "2", "--dip-lookahead", "0"]
    with caplog.at_level(logging.INFO):
        run(flags + ["--dip-calibration-frozen"], world_size=1)
    (line,) = [r.getMessage() for r in caplog.records if " | blend: " in r.getMessage()]
    consumed = int(re.search(r"consumed samples: +(\d+)", line).group(1))
    assert line.startswith("iteration      2/") and consumed >= 8  # 2 x 4 packed microbatches
    names = [str(datasets["caption"]), str(datasets["vqa"])]
    shares = re.search(rf" \| blend: {names[0]} ([\d.]+)%, {names[1]} ([\d.]+)%$", line)
    caption, vqa = (float(v) for v in shares.groups())
    assert caption > vqa > 0 and caption + vqa == pytest.approx(100, abs=0.1)
    # whole samples of the `consumed` drawn (the run's own draw, with its seed, is counted)
    drawn = round(vqa * consumed / 100)
    assert f"{100 * drawn / consumed:.1f}" == f"{vqa:.1f}"
