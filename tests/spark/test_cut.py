"""The consistent cut: segments up to the checkpoint, XRANGE after it, every entry once, even
when the offloader archives and trims between planning and reading, or runs all along."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from spark_support import fast_tier, make_bus, offload, publish, ticks

from eventbus.protocol.keys import Keys
from eventbus.spark.objects import Objects
from eventbus.spark.planning import RangePart, SegmentsPart, plan_read
from eventbus.spark.pruning import Pruning
from eventbus.spark.reading import read_range, read_segments
from eventbus.tier import Offloader, open_store

pytestmark = pytest.mark.integration


def _read_cut(store: str, redis_url: str, topic: str, between: Any = None) -> list[tuple[int, str]]:
    objects = Objects(open_store(store))
    with redis.Redis.from_url(redis_url) as r:
        cut = plan_read(objects, topic, Pruning(), redis=r, keys=Keys(), shards=4)
        if between is not None:
            between()
        out = []
        for part in cut.parts:
            if isinstance(part, RangePart):
                batches = read_range(objects, r, Keys(), part)
            else:
                assert isinstance(part, SegmentsPart)
                batches = read_segments(objects, part.refs, None, None)
            for b in batches:
                out += zip(
                    b.column("shard").to_pylist(), b.column("entry_id").to_pylist(), strict=True
                )
    return out


def _keyed(redis_url: str, topic: str, ids: list[str], events: list[Any]) -> list[tuple[int, str]]:
    from eventbus.protocol.sharding import shard_of

    return sorted((shard_of(rid, 4), i) for (rid, _), i in zip(events, ids, strict=True))


def test_offloader_between_planning_and_reading(redis_db: str, tmp_path: Path, topic: str) -> None:
    store = str(tmp_path / "seg")
    first = ticks(300)
    ids = publish(redis_db, topic, first)
    offload(redis_db, store, topic)  # part archived and trimmed
    second = ticks(400, start=300)
    ids += publish(redis_db, topic, second)  # in Redis at planning time
    late = ticks(50, start=700)

    def archive_everything() -> None:
        publish(redis_db, topic, late)  # after the snapshot: not in this cut
        offload(redis_db, store, topic)  # archives and trims the planned tail

    got = _read_cut(store, redis_db, topic, between=archive_everything)
    assert sorted(got) == _keyed(redis_db, topic, ids, first + second)  # once each, no more


def test_spark_reads_while_offloader_runs(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = str(tmp_path / "seg")
    events = ticks(3000, resources=17)
    ids = publish(redis_db, topic, events)
    want = _keyed(redis_db, topic, ids, events)
    reading = threading.Event()  # the offloader works only while a Spark read is under way
    done = threading.Event()

    async def offloader() -> None:
        bus = make_bus(redis_db)
        off = Offloader(
            bus.redis,
            open_store(store),
            settings=bus.settings,
            topics=[topic],
            tier=fast_tier(segment_max_entries=20, read_count=20),
        )
        try:
            while not done.is_set():
                if reading.is_set():
                    await off.round(flush=True)
                await anyio.sleep(0.02)
        finally:
            await bus.aclose()

    def archived() -> dict[bytes, bytes]:
        with redis.Redis.from_url(redis_db) as r:
            return r.hgetall(Keys().checkpoints(topic))

    thread = threading.Thread(target=anyio.run, args=(offloader,))
    thread.start()
    overlapped = 0
    try:
        for _ in range(8):
            df = (
                spark.read.format("eventbus")
                .option("store", store)
                .option("topic", topic)
                .option("redis_url", redis_db)
                .option("packBytes", "0")
                .load()
            )
            before = archived()
            reading.set()
            rows = df.select("shard", "entry_id").collect()
            reading.clear()
            overlapped += archived() != before
            got = sorted((r.shard, r.entry_id) for r in rows)
            assert got == want  # every entry exactly once, whatever the offloader did meanwhile
            with redis.Redis.from_url(redis_db) as r:
                if sum(r.xlen(Keys().stream(topic, s)) for s in range(4)) == 0:
                    break
    finally:
        done.set()
        thread.join()
    assert overlapped >= 1


def test_segments_past_the_checkpoint_are_not_read_twice(
    redis_db: str, tmp_path: Path, topic: str
) -> None:
    """A Redis that lost the checkpoint (or a segment stored but not yet committed): the archive
    ends at the last segment, Redis gives what follows it."""
    store = str(tmp_path / "seg")
    a = ticks(300)
    ids = publish(redis_db, topic, a)
    offload(redis_db, store, topic, hot_window_s=3600)  # archived, nothing trimmed
    with redis.Redis.from_url(redis_db) as r:
        r.delete(Keys().checkpoints(topic))
        assert sum(r.xlen(Keys().stream(topic, s)) for s in range(4)) == 300  # still in Redis
    b = ticks(100, start=300)
    ids += publish(redis_db, topic, b)
    assert sorted(_read_cut(store, redis_db, topic)) == _keyed(redis_db, topic, ids, a + b)


class _OffloadMidway:
    """A Redis client whose second XRANGE page comes after an offloader round that archived
    and trimmed everything: the per-page re-check must take the rest from the segments."""

    def __init__(self, client: Any, run: Any) -> None:
        self.client, self.run, self.pages = client, run, 0

    def xrange(self, *args: Any, **kwargs: Any) -> Any:
        self.pages += 1
        if self.pages == 2:
            self.run()
        return self.client.xrange(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_the_tail_is_read_page_by_page(
    redis_db: str, tmp_path: Path, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's Redis tail comes in batches of at most XRANGE_COUNT entries (it was held in
    memory whole, one batch), exact while an offloader archives and trims between pages."""
    import eventbus.spark.reading as reading

    monkeypatch.setattr(reading, "XRANGE_COUNT", 25)
    store = str(tmp_path / "seg")
    Path(store).mkdir()
    events = ticks(400)
    ids = publish(redis_db, topic, events)
    objects = Objects(open_store(store))

    def read_tails(client: Any) -> tuple[list[tuple[int, str]], list[int]]:
        cut = plan_read(objects, topic, Pruning(), redis=client, keys=Keys(), shards=4)
        assert all(isinstance(p, RangePart) for p in cut.parts) and len(cut.parts) == 4
        out, sizes = [], []
        for part in cut.parts:
            for b in read_range(objects, client, Keys(), part):
                sizes.append(b.num_rows)
                shards, entry_ids = b.column("shard"), b.column("entry_id")
                out += zip(shards.to_pylist(), entry_ids.to_pylist(), strict=True)
        return sorted(out), sizes

    want = _keyed(redis_db, topic, ids, events)
    with redis.Redis.from_url(redis_db) as r:
        got, sizes = read_tails(r)
        assert got == want and max(sizes) == 25 and len(sizes) >= 16
        midway = _OffloadMidway(r, lambda: offload(redis_db, store, topic))
        got, sizes = read_tails(midway)
        assert midway.pages >= 2 and r.xlen(Keys().stream(topic, 0)) == 0  # it did trim
    assert got == want


def test_id_mask_takes_sequence_bounds_beyond_int64() -> None:
    """`EntryId.prev()` of ``<ms>-0`` has sequence 2^64 - 1: a filter ``entry_ms >= t`` on a
    segment holding entries of ms t - 1 and t failed the task (pyarrow refused the scalar)."""
    import pyarrow as pa

    from eventbus.protocol.ids import EntryId
    from eventbus.spark.reading import id_mask

    batch = pa.RecordBatch.from_pydict(
        {"entry_ms": [9, 9, 10, 10, 11], "entry_seq": [0, 1, 0, 1, 0]},
        schema=pa.schema([("entry_ms", pa.int64()), ("entry_seq", pa.int64())]),
    )
    top = (1 << 64) - 1
    kept = batch.filter(id_mask(batch, EntryId(10, 0).prev(), EntryId(10, top)))
    assert kept.column("entry_ms").to_pylist() == [10, 10]
    assert batch.filter(id_mask(batch, EntryId(9, 1), None)).num_rows == 3
