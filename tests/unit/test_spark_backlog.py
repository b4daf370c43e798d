"""A stream query's lag per shard (`eventbus.spark.backlog`), by which maxOffsetsPerTrigger is
split: entries of a Redis stream in a range, counted from whichever side is shorter, and of a
shard's segments from their footers (each read once) and the ID columns of a segment only
partly in the range."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

import pyarrow as pa
import pyarrow.parquet as pq
from fakeredis import FakeRedis

from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.spark.backlog import (
    FIRST_PAGE,
    PAGE,
    Backlog,
    Span,
    segment_ids,
    stream_count,
    stream_nth,
)
from eventbus.spark.objects import Objects
from eventbus.tier.layout import SegmentRef


@pytest.fixture
def redis() -> Any:
    return FakeRedis()


def _ids(redis: Any, stream: str) -> list[EntryId]:
    return [parse_id(i) for i, _ in redis.xrange(stream)]


def _forty(redis: Any) -> tuple[list[EntryId], list[EntryId]]:
    """Stream ``s`` of 40 entries (IDs 1-0 .. 40-2, sequence parts varied): its IDs, and range
    bounds before, inside, at the ends of and past it."""
    for i in range(40):
        redis.xadd("s", {"n": i}, id=f"{i + 1}-{i % 3}")
    ids = _ids(redis, "s")
    return ids, [ZERO, ids[0], ids[5], ids[20], ids[38], ids[39], EntryId(99, 0)]


def _xrange_counts(redis: Any) -> list[int]:
    """The COUNT of every ``XRANGE`` `redis` sends from now on (0: none), recorded in order."""
    counts: list[int] = []
    real = redis.xrange

    def recording(*args: Any, count: int | None = None, **kw: Any) -> Any:
        counts.append(count or 0)
        return real(*args, count=count, **kw)

    redis.xrange = recording
    return counts


@pytest.mark.parametrize("page", [1, 3, 1000])
def test_stream_count_is_the_number_of_entries_in_the_range(redis: Any, page: int) -> None:
    ids, bounds = _forty(redis)
    for after in bounds:
        for upto in bounds:
            want = sum(1 for e in ids if after < e <= upto)
            assert stream_count(redis, "s", after, upto, page=page) == want, (after, upto)
    assert stream_count(redis, "missing", ZERO, EntryId(9, 0)) == 0


def test_stream_count_of_a_far_range_pages_the_short_rest(redis: Any) -> None:
    """A range holding most of the stream is counted from XLEN and the few entries outside
    it: 3 round trips of 2-entry pages for 100 entries, where paging the range takes 50."""
    for i in range(104):
        redis.xadd("s", {"n": i}, id=f"{i + 1}-0")
    calls: list[int] = []
    real = redis.pipeline

    def counting(**kw: Any) -> Any:
        calls.append(1)
        return real(**kw)

    redis.pipeline = counting
    assert stream_count(redis, "s", EntryId(2, 0), EntryId(102, 0), page=2) == 100
    assert len(calls) <= 3


def _segment(root: Path, first: int, count: int) -> SegmentRef:
    """A segment of `count` entries with IDs first-0 .. first+count-1-0 (only the ID columns a
    count needs), in shard 0 of topic t."""
    ms = list(range(first, first + count))
    key = f"t/0/{first}-0-{ms[-1]}-0.parquet"
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"entry_ms": pa.array(ms, pa.int64()), "entry_seq": pa.array([0] * count)})
    pq.write_table(table, path)
    return SegmentRef(EntryId(first, 0), EntryId(ms[-1], 0), key, path.stat().st_size, "t", 0)


def test_lag_counts_segments_then_the_stream(tmp_path: Path, redis: Any) -> None:
    from obstore.store import LocalStore

    objects = Objects(LocalStore(str(tmp_path)))
    refs = [_segment(tmp_path, 1, 10), _segment(tmp_path, 11, 10), _segment(tmp_path, 21, 10)]
    for i in range(26, 41):  # the stream still holds entries 26..30 (archived) and 31..40
        redis.xadd("s", {"n": i}, id=f"{i}-0")
    backlog = Backlog()
    cp = EntryId(30, 0)
    # after 5-0: 5 of the first segment (its IDs read), 20 from footers, 10 from Redis
    assert backlog.lag(objects, redis, "s", refs, EntryId(5, 0), EntryId(40, 0), cp) == 35
    assert backlog.lag(objects, redis, "s", refs, ZERO, EntryId(35, 0), cp) == 35
    assert backlog.lag(objects, redis, "s", refs, EntryId(33, 0), EntryId(40, 0), cp) == 7
    # without Redis the archive is all there is, up to the head
    assert backlog.lag(objects, None, "s", refs, ZERO, EntryId(25, 0), None) == 25
    for ref in refs:  # footers are remembered: a segment's count survives its object
        (tmp_path / ref.key).unlink()
    assert backlog.lag(objects, redis, "s", refs[1:], EntryId(10, 0), EntryId(40, 0), cp) == 30


class CountingObjects(Objects):
    """An `Objects` that counts its reads per key (``get`` and ``get_range``), as a
    ``store_factory`` wrapper would."""

    def __init__(self, store: Any, reads: dict[str, int]) -> None:
        super().__init__(store)
        self.reads = reads

    def get(self, key: str) -> bytes:
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().get_range(key, start, end)


def test_a_second_trigger_reads_no_segment_again(tmp_path: Path, redis: Any) -> None:
    """A query's offset inside a segment: its entry IDs are read at the first trigger, then
    remembered (segments are immutable), also by a reader that opens the store again (each
    trigger does) and by `segment_ids` (the n-th entry of a trigger's quota). They used to be
    downloaded at every trigger, twice (the lag, then the quota's end)."""
    from obstore.store import LocalStore

    refs = [_segment(tmp_path, 1, 10), _segment(tmp_path, 11, 10), _segment(tmp_path, 21, 10)]
    cp = EntryId(30, 0)
    for i in range(31, 41):
        redis.xadd("s", {"n": i}, id=f"{i}-0")
    backlog = Backlog()
    reads: dict[str, int] = {}
    trigger = CountingObjects(LocalStore(str(tmp_path)), reads)
    assert backlog.lag(trigger, redis, "s", refs, EntryId(5, 0), EntryId(40, 0), cp) == 35
    assert list(segment_ids(trigger, refs[0], EntryId(5, 0))) == [
        EntryId(i, 0) for i in (6, 7, 8, 9, 10)
    ]
    assert reads[refs[0].key] == 1 and sum(reads.values()) == 3  # IDs once, two footers
    reads.clear()
    again = CountingObjects(LocalStore(str(tmp_path)), reads)  # the next trigger's store
    assert backlog.lag(again, redis, "s", refs, EntryId(5, 0), EntryId(40, 0), cp) == 35
    assert reads == {}
    # the head inside the last segment: its IDs are read, once
    assert backlog.lag(again, redis, "s", refs, EntryId(7, 0), EntryId(25, 0), cp) == 18
    assert segment_ids(again, refs[2], EntryId(24, 0))[0] == EntryId(25, 0)
    assert reads == {refs[2].key: 1}
    # another folder's segment of the same key is another segment
    other = tmp_path / "other"
    twin = _segment(other, 1, 10)
    elsewhere = CountingObjects(LocalStore(str(other)), reads)
    assert len(segment_ids(elsewhere, twin, ZERO)) == 10 and reads[twin.key] == 1


def test_segment_ids_after_an_entry_are_a_sequence(tmp_path: Path) -> None:
    from obstore.store import LocalStore

    ref = _segment(tmp_path, 1, 10)
    ids = segment_ids(Objects(LocalStore(str(tmp_path))), ref, EntryId(6, 5))
    assert len(ids) == 4 and ids[0] == EntryId(7, 0) and ids[-1] == EntryId(10, 0)
    assert ids[1:3] == [EntryId(8, 0), EntryId(9, 0)] and list(ids)[2] == EntryId(9, 0)
    assert ids.count_upto(EntryId(8, 0)) == 2 and ids.count_upto(EntryId(1, 0)) == 0
    with pytest.raises(IndexError, match="index 4 out of range for 4 entry IDs"):
        ids[4]
    assert len(segment_ids(Objects(LocalStore(str(tmp_path))), ref, EntryId(10, 0))) == 0


def test_a_shard_nearly_caught_up_is_counted_from_small_pages(redis: Any) -> None:
    """3 entries waiting at the end of a 3,000-entry stream: the count asks Redis for a few
    entries, not for a 1,000-entry page of the stream before them (as it used to, at every
    trigger and shard)."""
    for i in range(3000):
        redis.xadd("s", {"n": i}, id=f"{i + 1}-0")
    asked: list[int] = []
    real = redis.pipeline

    def recording(**kw: Any) -> Any:
        pipe = real(**kw)
        xrange = pipe.xrange

        def counted(*args: Any, count: int | None = None, **kws: Any) -> Any:
            asked.append(count or 0)
            return xrange(*args, count=count, **kws)

        pipe.xrange = counted
        return pipe

    redis.pipeline = recording
    assert stream_count(redis, "s", EntryId(2997, 0), EntryId(3000, 0)) == 3
    assert sum(asked) <= 3 * FIRST_PAGE, asked
    asked.clear()  # a long range in a long stream still ends in pages of up to PAGE
    assert stream_count(redis, "s", EntryId(1500, 0), EntryId(3000, 0)) == 1500
    assert max(asked) == PAGE


def test_the_id_cache_evicts_the_least_recently_used_past_its_limit(tmp_path: Path) -> None:
    from obstore.store import LocalStore

    from eventbus.spark.backlog import _IdsCache

    cache = _IdsCache(limit=25)  # IDs: two 10-entry segments fit, a third evicts the oldest
    reads: dict[str, int] = {}
    objects = CountingObjects(LocalStore(str(tmp_path)), reads)
    a, b, c = _segment(tmp_path, 1, 10), _segment(tmp_path, 11, 10), _segment(tmp_path, 21, 10)
    for ref in (a, b, a, c, a, b):  # a used again before c comes: b is the one evicted
        assert len(cache.get(objects, ref)) == 10
    assert reads == {a.key: 1, b.key: 2, c.key: 1}


@pytest.mark.parametrize("page", [1, 3, 1000])
def test_stream_nth_is_the_nth_entry_id_in_the_range(redis: Any, page: int) -> None:
    ids, bounds = _forty(redis)
    for after in bounds:
        for upto in bounds:
            inside = [e for e in ids if after < e <= upto]
            for n in (1, 2, 3, 7, 40, 41):
                want = inside[min(n, len(inside)) - 1] if inside else None
                assert stream_nth(redis, "s", after, upto, n, page=page) == want, (after, upto, n)
    assert stream_nth(redis, "missing", ZERO, EntryId(9, 0), 5) is None
    for n, page in ((0, 10), (5, 0)):
        with pytest.raises(ValueError, match="at least 1"):
            stream_nth(redis, "s", ZERO, EntryId(99, 0), n, page=page)


def test_stream_nth_of_a_large_quota_holds_one_page_at_a_time(redis: Any) -> None:
    """A trigger limit of 2,500 entries is found in XRANGE pages of at most `page` entries, not
    one reply of 2,500 (a shard's tail is never held in memory at once)."""
    for i in range(3000):
        redis.xadd("s", {"n": i}, id=f"{i + 1}-0")
    counts = _xrange_counts(redis)
    assert stream_nth(redis, "s", EntryId(10, 0), EntryId(2900, 0), 2500, page=1000) == EntryId(
        2510, 0
    )
    assert counts == [1000, 1000, 500]


def test_a_stream_cut_in_redis_is_found_page_by_page(redis: Any, tmp_path: Path) -> None:
    """`Backlog.nth`, maxOffsetsPerTrigger's cut in a shard's Redis tail: 2,500 entries
    found in XRANGE pages of at most `PAGE` (one XRANGE COUNT 2500 before: the whole quota held
    at once)."""
    from eventbus.spark.objects import as_objects
    from eventbus.spark.options import SourceOptions

    (tmp_path / "archive").mkdir()
    opts = SourceOptions.parse({"store": str(tmp_path / "archive"), "topic": "t"})
    stream = opts.keys().stream("t", 0)
    for i in range(3000):
        redis.xadd(stream, {"n": i}, id=f"{i + 1}-0")
    counts = _xrange_counts(redis)
    objects = as_objects(opts.open_store())
    span = Span(objects, redis, stream, [], EntryId(10, 0), EntryId(3000, 0), None)
    cut = Backlog().nth(span, 2500)
    assert cut == EntryId(2510, 0)
    assert counts and max(counts) <= PAGE
