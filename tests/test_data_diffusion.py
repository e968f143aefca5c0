"""The on-disk latent format for diffusion models: write, read, metadata from headers, bad records."""

import json

import numpy as np
import pytest
from metas import t2v_meta

from megatron_dip.data.diffusion import (
    LatentConfig,
    LatentDataset,
    latent_shape,
    write_latent_dataset,
)
from megatron_dip.data.meta import sample_meta
from megatron_dip.data.records import BadSampleError
from megatron_dip.data.stream import BatchStream, StreamConfig
from megatron_dip.data.synthetic import generate_samples
from megatron_dip.data.tokenizer import ByteTokenizer
from megatron_dip.modelspec import tiny_t2v, tiny_vlm

MODEL = tiny_t2v()  # DiT patch 2, 4 latent channels
TOK = ByteTokenizer()


def test_round_trip_of_synthetic_clips(tmp_path):
    clips = generate_samples("t2v", model=MODEL, num_samples=4, seed=0, scale=1 / 16)
    captions = ["a dog runs", "rain on a window", "two cats", "zoom into a city at night"]
    write_latent_dataset(
        tmp_path,
        [
            (f"c{i}", c, s.media["dit"][0].astype(np.float16))
            for i, (c, s) in enumerate(zip(captions, clips))
        ],
    )
    ds = LatentDataset(tmp_path, model=MODEL)
    assert ds.num_samples == 4
    for i, (caption, clip) in enumerate(zip(captions, clips)):
        s = ds.sample(i)
        assert (
            TOK.decode(s.text) == caption and s.text[0] == TOK.bos_id and s.text[-1] == TOK.eos_id
        )
        np.testing.assert_allclose(s.media["dit"][0], clip.media["dit"][0], atol=2e-3, rtol=1e-3)
        assert s.media["dit"][0].dtype == np.float32 and s.labels_mask is None
        t = clip.media["dit"][0].shape[0]
        (tokens,) = sample_meta(clip, model=MODEL).instances_of("dit").tokens
        expected = t2v_meta(i, len(caption) + 2, tokens, t, loss_tokens=tokens)
        assert ds.meta(i) == expected
        assert ds.record_id(i) == f"c{i}"


def test_metadata_is_read_from_the_header(tmp_path):
    write_latent_dataset(tmp_path, [("a", "x", np.zeros((3, 4, 6, 8), np.float16))])
    assert latent_shape(tmp_path / "latents/a.npz") == ((3, 4, 6, 8), np.dtype("float16"))
    np.savez_compressed(tmp_path / "latents/a.npz", latent=np.zeros((5, 4, 2, 2), np.float32))
    assert latent_shape(tmp_path / "latents/a.npz")[0] == (5, 4, 2, 2)


@pytest.fixture
def mixed_quality(tmp_path):
    good = np.zeros((2, 4, 4, 4), np.float32)
    write_latent_dataset(
        tmp_path,
        [
            ("ok", "a clip", good),
            ("odd", "odd size", np.zeros((2, 4, 3, 4), np.float32)),
            ("chan", "channels", np.zeros((2, 3, 4, 4), np.float32)),
        ],
    )
    np.savez(tmp_path / "latents/wrongkey.npz", video=good)
    (tmp_path / "latents/garbage.npz").write_bytes(b"not a zip file")
    records = json.loads((tmp_path / "captions.json").read_text())
    records += [
        {"id": "missing", "latent": "latents/none.npz", "caption": "x"},
        {"id": "wrongkey", "latent": "latents/wrongkey.npz", "caption": "x"},
        {"id": "garbage", "latent": "latents/garbage.npz", "caption": "x"},
        {"id": "nocap", "latent": "latents/ok.npz", "caption": ""},
    ]
    (tmp_path / "captions.json").write_text(json.dumps(records))
    return tmp_path


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (1, "id 'odd', latent 'latents/odd.npz'.*multiples of the DiT patch"),
        (2, "id 'chan'.*\\[T, 4, h, w\\]"),
        (3, "id 'missing', latent 'latents/none.npz'.*none.npz"),
        (4, "id 'wrongkey'.*holds no 'latent' array"),
        (5, "id 'garbage'.*zip"),
        (6, "id 'nocap'.*caption"),
    ],
)
def test_bad_records_raise_naming_id_and_file(mixed_quality, index, message):
    with pytest.raises(BadSampleError, match=message):
        LatentDataset(mixed_quality, model=MODEL).meta(index)


def test_bad_records_are_skipped_when_asked(mixed_quality):
    ds = LatentDataset(mixed_quality, model=MODEL, config=LatentConfig(on_bad_sample="skip"))
    stream = BatchStream(ds, config=StreamConfig(batch_samples=2, shuffle=False))
    batch = next(stream)
    assert [m.sample_id for m in batch.samples] == [0, 7]  # 7 = 0 of the second epoch
    assert ds.skipped == 6
    assert [s.sample_id for s in stream.samples(batch)] == [0, 7]


def test_reader_rejects_a_vlm_and_bad_ids(tmp_path):
    with pytest.raises(ValueError, match="not a text-to-video"):
        LatentDataset(tmp_path, model=tiny_vlm())
    with pytest.raises(ValueError, match="cannot name a file"):
        write_latent_dataset(tmp_path, [("../x", "c", np.zeros((1, 4, 2, 2)))])
