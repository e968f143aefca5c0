"""BatchStream: lookahead, batch sizes, sharding by the planner's split, resumption."""

from dataclasses import replace

import pytest

from megatron_dip.data.meta import sample_meta
from megatron_dip.data.packing import PackingLimits, pack_microbatches, split_replicas
from megatron_dip.data.stream import BatchStream, StreamConfig, StreamError
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


def test_unbounded_source_of_only_oversize_samples_stops_at_the_bound():
    """Regression: skipping every sample of an unbounded source used to read forever."""
    nothing_fits = PackingLimits.vlm(seq_length=1)
    config = StreamConfig(
        batch_microbatches=2, limits=nothing_fits, on_oversize="skip", max_consecutive_skips=300
    )
    stream = BatchStream(_synthetic(), config=config)
    with pytest.raises(
        StreamError,
        match="no usable sample in 300 consecutive .*"
        "max_consecutive_skips=300.*more than a microbatch holds",
    ) as info:
        next(stream)
    assert info.value.oversize and info.value.position is None


def test_unusable_batch_fails_when_consumed_so_every_rank_stops_at_the_same_iteration():
    """Only the planner's rank peeks ahead: a bad sample two batches ahead must not stop it
    before the other ranks (which never peek) reach that batch."""

    class Refusing(_ListSource):
        def metas(self, indices):
            if 7 in indices:
                raise ValueError("record 7 (id 'x', image 'a.png'): cannot read image a.png")
            return super().metas(indices)

    def stream():
        return BatchStream(Refusing(20), config=StreamConfig(batch_samples=3, shuffle=False))

    planner_rank, other_rank = stream(), stream()
    ahead = planner_rank.peek(4)  # batches 0 and 1 only: batch 2 holds position 7
    assert [b.iteration for b in ahead] == [0, 1]
    for _ in range(2):
        assert next(planner_rank) == next(other_rank)
    for s in (planner_rank, other_rank):
        with pytest.raises(StreamError, match="stream position 7: record 7 .*a.png") as info:
            next(s)
        assert info.value.position == 7 and not info.value.oversize
        with pytest.raises(StreamError, match="position 7"):
            s.peek(1)  # the very next batch cannot be formed: peek says so too
        assert s.state_dict()["position"] == 6  # nothing of the bad batch was consumed


def test_oversize_error_names_the_record_and_skips_are_logged_once(caplog):
    metas = generate_meta("mixed", model=MODEL, num_samples=60, seed=3, scale=1 / 16)
    tight = PackingLimits.vlm(seq_length=max(m.text_tokens for m in metas) - 1)
    big = [i for i, m in enumerate(metas) if m.text_tokens > tight.seq_length]

    class Described(_ListSource):
        def describe(self, index):
            return f"record {index} (id 'r{index}')"

    config = StreamConfig(batch_samples=59, limits=tight, shuffle=False)
    with pytest.raises(
        StreamError,
        match=rf"stream position {big[0]} \(record {big[0]} "
        rf"\(id 'r{big[0]}'\)\): .*more than a microbatch holds",
    ):
        next(BatchStream(Described(60), config=config))
    stream = BatchStream(Described(60), config=replace(config, on_oversize="skip"))
    with caplog.at_level("WARNING", logger="megatron_dip.data.stream"):
        stream.peek(1)
        batch = next(stream)
    assert stream.skipped == len(big) and batch.num_samples == 59
    assert caplog.text.count("skipping stream position") == len(big)  # peek + next: once
    assert f"(id 'r{big[0]}')): sample {big[0]} has" in caplog.text


def test_empty_source_is_a_clear_error_not_a_hang():
    with pytest.raises(StreamError, match="no samples"):
        next(BatchStream(_ListSource(0), config=StreamConfig(batch_samples=2)))


def test_a_refused_record_read_ahead_in_a_chunk_spares_the_batches_before_it():
    class Refusing(_ListSource):
        def metas(self, indices):
            if 40 in indices:
                raise ValueError("record 40 is broken")
            return super().metas(indices)

    config = StreamConfig(batch_microbatches=1, limits=LIMITS, shuffle=False)
    stream = BatchStream(Refusing(64), config=config)
    first = next(stream)  # its chunked read reached position 40; the batch ended before it
    assert max(m.sample_id for m in first.samples) < 40
    with pytest.raises(StreamError, match="stream position 40: record 40 is broken"):
        for _ in range(64):
            next(stream)
