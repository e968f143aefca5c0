"""BatchStream: lookahead, batch sizes, sharding by the planner's split, resumption."""

from dataclasses import replace

import pytest

from megatron_dip.data.meta import sample_meta
from megatron_dip.data.packing import PackingLimits, pack_microbatches, split_replicas
from megatron_dip.data.stream import BatchStream, StreamConfig
from megatron_dip.data.synthetic import SyntheticSource, generate_meta
from megatron_dip.modelspec import tiny_vlm

MODEL = tiny_vlm()
LIMITS = PackingLimits.vlm(seq_length=512)


def _synthetic(seed=0):
    return SyntheticSource("mixed", model=MODEL, seed=seed, scale=1 / 16)


class _ListSource:
    """A finite source with a few bad records (meta None), as the readers produce."""

    model = MODEL

    def __init__(self, n, bad=()):
        self.num_samples = n
        self.bad = set(bad)
        self._metas = generate_meta("mixed", model=MODEL, num_samples=n, seed=3, scale=1 / 16)

    def metas(self, indices):
        return [None if i in self.bad else self._metas[i] for i in indices]

    def sample(self, index):
        raise AssertionError("not needed")


def test_peek_shows_exactly_the_batches_next_returns():
    stream = BatchStream(_synthetic(), config=StreamConfig(batch_samples=10))
    ahead = stream.peek(3)
    assert stream.peek(2) == ahead[:2]
    assert [next(stream) for _ in range(3)] == ahead
    assert [b.iteration for b in ahead] == [0, 1, 2]
    assert [m.sample_id for m in ahead[1].samples] == list(range(10, 20))


def test_batch_in_microbatches_fills_exactly_that_many_sequences():
    stream = BatchStream(_synthetic(), config=StreamConfig(batch_microbatches=4, limits=LIMITS))
    batches = [next(stream) for _ in range(5)]
    ids = [m.sample_id for b in batches for m in b.samples]
    assert ids == list(range(len(ids)))  # contiguous, nothing lost between batches
    for b in batches:
        assert len(pack_microbatches(b.samples, limits=LIMITS)) == 4
        # the first sample of the next batch would have opened a fifth microbatch
    nxt = next(stream).samples[0]
    assert len(pack_microbatches(batches[-1].samples + (nxt,), limits=LIMITS)) == 5


def test_samples_of_a_replica_match_the_planned_metadata():
    stream = BatchStream(_synthetic(), config=StreamConfig(batch_samples=12))
    batch = next(stream)
    split = split_replicas(batch.samples, num_replicas=2, cost=lambda m: m.text_tokens)
    for replica in split:
        ids = [m.sample_id for m in replica]
        samples = stream.samples(batch, ids)
        assert [s.sample_id for s in samples] == ids
        assert [sample_meta(s, model=MODEL) for s in samples] == replica
    with pytest.raises(ValueError, match="not in batch 0"):
        stream.samples(batch, [999])


def test_resume_continues_identically():
    cfg = StreamConfig(seed=4, batch_microbatches=3, limits=LIMITS)
    a = BatchStream(_synthetic(), config=cfg)
    for _ in range(3):
        next(a)
    a.peek(2)  # lookahead must not leak into the saved position
    state = a.state_dict()
    expected = [next(a) for _ in range(3)]
    b = BatchStream(_synthetic(), config=cfg)
    b.load_state_dict(state)
    assert [next(b) for _ in range(3)] == expected
    other = BatchStream(_synthetic(), config=StreamConfig(seed=4, batch_samples=3))
    with pytest.raises(ValueError, match="another configuration"):
        other.load_state_dict(state)


def test_finite_source_epochs_are_seeded_permutations_and_bad_records_are_left_out():
    src = _ListSource(10, bad={3})
    stream = BatchStream(src, config=StreamConfig(seed=1, batch_samples=6))
    batches = [next(stream) for _ in range(3)]  # 18 samples: crosses into epoch 1 and 2
    ids = [m.sample_id for b in batches for m in b.samples]
    assert len(set(ids)) == len(ids)  # ids are stream positions: unique across epochs
    index = [stream._index(p) for p in ids]
    assert 3 not in index
    epoch0 = [i for p, i in zip(ids, index) if p < 10]
    assert sorted(epoch0) == [0, 1, 2, 4, 5, 6, 7, 8, 9] and epoch0 != sorted(epoch0)
    assert stream.skipped >= 1
    again = BatchStream(_ListSource(10, bad={3}), config=StreamConfig(seed=1, batch_samples=6))
    assert [next(again) for _ in range(3)] == batches
    for b in batches:
        for m in b.samples:
            assert m == replace(src._metas[stream._index(m.sample_id)], sample_id=m.sample_id)


def test_oversize_samples_error_or_skip():
    tight = PackingLimits.vlm(seq_length=40)
    metas = generate_meta("mixed", model=MODEL, num_samples=200, seed=0, scale=1 / 16)
    assert any(m.text_tokens > 40 for m in metas)
    with pytest.raises(ValueError, match="stream position .* more than a microbatch holds"):
        next(BatchStream(_synthetic(), config=StreamConfig(batch_samples=100, limits=tight)))
    skip = StreamConfig(batch_samples=20, limits=tight, on_oversize="skip")
    batch = next(BatchStream(_synthetic(), config=skip))
    assert all(m.text_tokens <= 40 for m in batch.samples) and len(batch.samples) == 20


def test_all_bad_source_fails_instead_of_spinning():
    stream = BatchStream(_ListSource(4, bad={0, 1, 2, 3}), config=StreamConfig(batch_samples=2))
    with pytest.raises(ValueError, match="no usable sample"):
        next(stream)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"batch_samples": 2, "batch_microbatches": 2},
        {"batch_microbatches": 2},
        {"batch_samples": 0},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        StreamConfig(**kwargs)


def test_changed_sample_is_caught_before_training():
    class Drifting(_ListSource):
        def sample(self, index):
            from megatron_dip.data.synthetic import generate_samples

            (s,) = generate_samples("mixed", model=MODEL, num_samples=1, seed=99, scale=1 / 16)
            return s

    stream = BatchStream(Drifting(5), config=StreamConfig(batch_samples=5, shuffle=False))
    batch = next(stream)
    with pytest.raises(ValueError, match="changed after planning"):
        stream.samples(batch)
