"""Batch reads: schema, typed decoding and _corrupt, partitions and order, the Redis tail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from spark_support import Tick, offload, publish, ticks

pytestmark = pytest.mark.integration


def read(spark: Any, store: str, topic: str, **options: Any) -> Any:
    r = spark.read.format("eventbus").option("store", store).option("topic", topic)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def test_raw_read_schema_and_rows(spark: Any, redis_db: str, tmp_path: Path, topic: str) -> None:
    store = str(tmp_path / "seg")
    ids = publish(redis_db, topic, ticks(250))
    offload(redis_db, store, topic)
    df = read(spark, store, topic)
    assert [f.name for f in df.schema.fields] == [
        "topic",
        "shard",
        "entry_id",
        "entry_ms",
        "entry_seq",
        "resource_id",
        "event_type",
        "event_id",
        "published_at",
        "headers",
        "payload",
        "_corrupt",
    ]
    rows = df.collect()
    assert len(rows) == 250
    assert sorted(r.entry_id for r in rows) == sorted(ids)
    assert {r.event_type for r in rows} == {"Tick"}
    assert all(r._corrupt is None and r.published_at is not None for r in rows)


def test_typed_columns_and_corrupt(spark: Any, redis_db: str, tmp_path: Path, topic: str) -> None:
    import redis

    from eventbus.protocol.keys import Keys

    store = str(tmp_path / "seg")
    publish(redis_db, topic, ticks(40, resources=1))
    stream = Keys().stream(topic, 0)
    # shard of res-0 with 4 shards
    from eventbus.protocol.sharding import shard_of

    stream = Keys().stream(topic, shard_of("res-0", 4))
    with redis.Redis.from_url(redis_db) as r:
        r.xadd(stream, {"rid": "res-0", "type": "Tick", "data": b"\x01\xc1garbage"})
        from spark_support import Tock

        from eventbus.protocol.codec import encode_entry, envelope_of

        bad = encode_entry(envelope_of("res-0", Tock(resource="res-0", n=1)))
        bad[b"type"] = b"Tick"  # a Tick without seq: does not validate
        r.xadd(stream, bad)
    offload(redis_db, store, topic)
    df = read(spark, store, topic, model="spark_support:Tick")
    names = df.schema.fieldNames()
    assert names[-5:] == ["resource", "seq", "price", "tags", "_corrupt"]
    assert df.schema["seq"].dataType.simpleString() == "bigint"
    assert df.schema["tags"].dataType.simpleString() == "array<string>"
    rows = df.orderBy("entry_ms", "entry_seq").collect()
    assert [r.seq for r in rows[:40]] == list(range(40))
    assert all(r._corrupt is None and r.price == 1.5 for r in rows[:40])
    assert rows[40].seq is None and rows[40]._corrupt.startswith("DecodeError")
    assert rows[41].seq is None and "seq" in rows[41]._corrupt
    with pytest.raises(Exception, match="DecodeError"):
        read(spark, store, topic, model="spark_support:Tick", mode="FAILFAST").collect()
    # validate=false: Arrow converts the payload maps (no pydantic: a missing field is null)
    fast = read(spark, store, topic, model="spark_support:Tick", validate="false")
    rows = fast.orderBy("entry_ms", "entry_seq").collect()
    assert [r.seq for r in rows[:40]] == list(range(40)) and rows[5].tags == []
    assert rows[40]._corrupt.startswith("DecodeError") and rows[41].seq is None


def test_models_by_event_type(spark: Any, redis_db: str, tmp_path: Path, topic: str) -> None:
    import json

    from spark_support import Tock

    store = str(tmp_path / "seg")
    publish(redis_db, topic, [*ticks(5), ("x", Tock(resource="x", n=7))])
    offload(redis_db, store, topic)
    rows = read(spark, store, topic, model=json.dumps({"Tock": "spark_support:Tock"})).collect()
    # a dict given as is: Spark passes str(dict) on
    same = read(spark, store, topic, model={"Tock": "spark_support:Tock"}).collect()
    assert sorted(map(tuple, same)) == sorted(map(tuple, rows))
    tock = [r for r in rows if r.event_type == "Tock"]
    assert len(rows) == 6 and tock[0].n == 7 and tock[0].resource == "x"
    assert all(r.n is None and r._corrupt is None for r in rows if r.event_type == "Tick")


def test_nested_model(spark: Any, redis_db: str, tmp_path: Path, topic: str) -> None:
    from spark_support import Nested

    store = str(tmp_path / "seg")
    publish(redis_db, topic, [("a", Nested(name="a", tick=Tick(resource="a", seq=3, tags=["x"])))])
    offload(redis_db, store, topic)
    (row,) = read(spark, store, topic, model="spark_support:Nested").collect()
    assert row.name == "a" and row.tick.seq == 3 and row.tick.tags == ["x"]


def test_partitions_one_per_segment_in_entry_order(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    from eventbus.tier import open_store
    from eventbus.tier.store import list_segments_sync

    store = str(tmp_path / "seg")
    publish(redis_db, topic, ticks(1000, resources=11))
    offload(redis_db, store, topic, segment_max_entries=50)
    segs = sum(len(list_segments_sync(open_store(store), topic, s)) for s in range(4))
    assert segs >= 20
    df = read(spark, store, topic, packBytes="0")
    assert df.rdd.getNumPartitions() == segs
    packed = read(spark, store, topic, packBytes=str(1 << 30))
    assert packed.rdd.getNumPartitions() == 4  # one per shard
    for frame in (df, packed):
        rows = frame.collect()  # partitions in order, rows in entry order within each
        by_shard: dict[int, list[Any]] = {}
        for r in rows:
            by_shard.setdefault(r.shard, []).append((r.entry_ms, r.entry_seq))
        for ids in by_shard.values():
            assert ids == sorted(ids) and len(set(ids)) == len(ids)
        assert len(rows) == 1000


def test_redis_tail_one_consistent_cut(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = str(tmp_path / "seg")
    first = publish(redis_db, topic, ticks(300))
    offload(redis_db, store, topic)
    tail = publish(redis_db, topic, ticks(120, start=300))
    df = read(spark, store, topic, redis_url=redis_db)
    rows = df.collect()
    assert sorted((r.shard, r.entry_id) for r in rows) == sorted(
        {(r.shard, r.entry_id) for r in rows}
    )
    assert sorted(r.entry_id for r in rows) == sorted(first + tail)
    # without redis_url: the archive only
    assert read(spark, store, topic).count() == 300


def test_missing_options_and_bad_store(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="option topic is required"):
        spark.read.format("eventbus").option("store", str(tmp_path)).load()
    with pytest.raises(Exception, match="option store is required"):
        spark.read.format("eventbus").option("topic", "t").load()
    with pytest.raises(Exception, match="cannot import model"):
        read(spark, str(tmp_path), "t", model="nope.nowhere:X")
    with pytest.raises(Exception, match="cannot open object store"):
        read(spark, "bogus://x/y", "t").collect()
    with pytest.raises(Exception, match="no segment store at"):
        read(spark, str(tmp_path / "typo"), "t").collect()
    with pytest.raises(Exception, match="option mode must be"):
        read(spark, str(tmp_path), "t", mode="LAX")


def test_a_topic_in_neither_the_archive_nor_redis_is_an_error(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """It read as an empty DataFrame: a misspelled topic looked like a quiet one."""
    publish(redis_db, topic, ticks(5))
    offload(redis_db, str(tmp_path), topic)
    assert read(spark, str(tmp_path), topic).count() == 5
    with pytest.raises(Exception, match=r"is neither in the archive at .* nor in Redis"):
        read(spark, str(tmp_path), topic + "x", redis_url=redis_db).collect()
    with pytest.raises(Exception, match=r"neither in the archive at .*\(and no redis_url given\)"):
        read(spark, str(tmp_path), topic + "x").collect()


def test_overlapping_segments_give_each_entry_once(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """A forged segment (or an offloader's leftover) over a range other segments hold: each
    entry once, as replay gives it (the read gave the overlapped entries twice)."""
    from eventbus.spark import read as read_native
    from eventbus.spark.objects import Objects
    from eventbus.spark.reading import read_segments
    from eventbus.tier.layout import segment_key
    from eventbus.tier.replay import iter_shard
    from eventbus.tier.segment_write import encode_segment
    from eventbus.tier.store import open_store

    store = str(tmp_path / "seg")
    publish(redis_db, topic, ticks(30), shards=1)
    offload(redis_db, store, topic, shards=1, segment_max_entries=10)
    entries = list(iter_shard(open_store(store), topic, 0))
    assert len(entries) == 30
    forged = [(e.entry_id, e.fields()) for e in entries[4:25]]
    first, last = forged[0][0], forged[-1][0]
    data, _ = encode_segment(topic, 0, first, last, forged)
    path = Path(store) / segment_key(topic, 0, first, last)
    path.write_bytes(data)
    assert len(list((Path(store) / topic / "shard=0").glob("*.parquet"))) == 4
    want = sorted(str(e.entry_id) for e in entries)
    # the path of stream batches and of a cut's tail: segments read in one task
    objects = Objects(open_store(store))
    batches = read_segments(objects, objects.segments(topic, 0), None, None)
    assert sorted(i for b in batches for i in b.column("entry_id").to_pylist()) == want
    for df in (
        read(spark, store, topic),
        read(spark, store, topic, redis_url=redis_db, packBytes="0"),
        read_native(spark, store=store, topic=topic),
    ):
        assert sorted(r.entry_id for r in df.collect()) == want


def test_batch_starting_and_ending_offsets(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Kafka's batch options: per shard, entries after startingOffsets and up to endingOffsets
    (inside segments and in Redis); shards left out are unbounded. They were ignored."""
    import json

    from eventbus.protocol.sharding import shard_of

    store = str(tmp_path / "seg")
    events = ticks(200)
    ids = publish(redis_db, topic, events)
    offload(redis_db, store, topic, segment_max_entries=7)
    ids += publish(redis_db, topic, ticks(40, start=200))  # in Redis only
    per_shard: dict[int, list[str]] = {}
    for (rid, _), i in zip(events + ticks(40, start=200), ids, strict=True):
        per_shard.setdefault(shard_of(rid, 4), []).append(i)
    s, t = sorted(per_shard)[:2]
    a = per_shard[s]  # shard s: bounded inside segments
    b = per_shard[t]  # shard t: from a segment into the Redis tail
    starts = {topic: {str(s): a[2], str(t): b[5]}}
    ends = {str(s): a[20]}
    want = a[3:21] + b[6:] + [i for k, v in per_shard.items() if k not in (s, t) for i in v]
    for extra in ({}, {"redis_url": redis_db}):
        got = read(
            spark,
            store,
            topic,
            startingOffsets=json.dumps(starts),
            endingOffsets=json.dumps(ends),
            **extra,
        )
        rows = [r.entry_id for r in got.collect()]
        archived_only = not extra
        if archived_only:
            tail = set(ids[200:])
            assert sorted(rows) == sorted(i for i in want if i not in tail)
        else:
            assert sorted(rows) == sorted(want)
    with pytest.raises(Exception, match="endingOffsets of a batch read"):
        read(spark, store, topic, endingOffsets="earliest").collect()


def test_subscribe_reads_several_topics(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Kafka's ``subscribe``: several topics in one batch read, told apart by the topic column
    (archive and Redis tail of each); with topic it is refused. (Streams: test_stream_topics.py.)"""
    store = str(tmp_path / "seg")
    other = topic + "-b"
    publish(redis_db, topic, ticks(30))
    publish(redis_db, other, ticks(20))
    offload(redis_db, store, topic)
    offload(redis_db, store, other)
    publish(redis_db, other, ticks(5, start=20))  # in Redis only
    df = (
        spark.read.format("eventbus")
        .option("store", store)
        .option("subscribe", f"{topic},{other}")
        .option("redis_url", redis_db)
        .option("model", "spark_support:Tick")
        .load()
    )
    counts = {r.topic: r["count"] for r in df.groupBy("topic").count().collect()}
    assert counts == {topic: 30, other: 25}
    with pytest.raises(Exception, match="topic and subscribe exclude each other"):
        read(spark, store, topic, subscribe=other).collect()
