"""The streaming source: archive then Redis, maxEntriesPerTrigger, restart from a checkpoint
with no entry skipped or repeated across the segment/Redis boundary, startingOffsets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from spark_support import Tick, offload, publish, ticks

from eventbus.errors import ConfigError
from eventbus.protocol.sharding import shard_of
from eventbus.spark.stream import parse_start

pytestmark = pytest.mark.integration


def _stream(spark: Any, store: str, topic: str, redis_url: str | None, **options: Any) -> Any:
    """A typed stream of `topic` from `store`, with Redis's tail at `redis_url` (None: the
    archive alone)."""
    r = (
        spark.readStream.format("eventbus")
        .option("store", store)
        .option("topic", topic)
        .option("model", "spark_support:Tick")
    )
    if redis_url is not None:
        r = r.option("redis_url", redis_url)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def _run(df: Any, out: Path, checkpoint: Path) -> list[Any]:
    """Run the query over everything available now, into a Parquet sink; its progress list."""
    q = (
        df.select("shard", "entry_id", "resource", "seq")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        q.processAllAvailable()
        return list(q.recentProgress)
    finally:
        q.stop()


def _keyed(events: list[Any], ids: list[str]) -> list[tuple[int, str]]:
    return sorted((shard_of(rid, 4), i) for (rid, _), i in zip(events, ids, strict=True))


def test_restart_from_checkpoint_no_skip_no_repeat(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store, out, cp = str(tmp_path / "seg"), tmp_path / "out", tmp_path / "cp"
    a = ticks(300)
    ids = publish(redis_db, topic, a)
    offload(redis_db, store, topic)  # archived and trimmed from Redis
    b = ticks(200, start=300)
    ids += publish(redis_db, topic, b)  # in Redis only
    progress = _run(_stream(spark, store, topic, redis_db, maxEntriesPerTrigger="120"), out, cp)
    sizes = [p["numInputRows"] for p in progress if p["numInputRows"]]
    assert len(sizes) >= 4 and max(sizes) <= 120  # the cap holds (30 per shard)
    offload(redis_db, store, topic)  # the tail moves to segments while the query is stopped
    c = ticks(150, start=500)
    ids += publish(redis_db, topic, c)
    _run(_stream(spark, store, topic, redis_db), out, cp)  # restart from the checkpoint
    rows = pq.read_table(out).to_pylist()
    got = sorted((r["shard"], r["entry_id"]) for r in rows)
    assert got == _keyed(a + b + c, ids)  # each entry exactly once
    per_resource: dict[str, list[int]] = {}
    for r in rows:
        per_resource.setdefault(r["resource"], []).append(r["seq"])
    assert all(sorted(v) == sorted(set(v)) for v in per_resource.values())


def test_starting_offsets_latest_and_json(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = str(tmp_path / "seg")
    old = publish(redis_db, topic, ticks(40))
    offload(redis_db, store, topic)
    df = _stream(spark, store, topic, redis_db, startingOffsets="latest")
    q = (
        df.select("entry_id", "seq")
        .writeStream.format("memory")
        .queryName(f"q_{topic[2:]}")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        q.processAllAvailable()  # the starting offset is fixed by the first batch
        publish(redis_db, topic, ticks(10, start=40))
        q.processAllAvailable()
        seqs = sorted(r.seq for r in spark.sql(f"select seq from q_{topic[2:]}").collect())
    finally:
        q.stop()
    assert seqs == list(range(40, 50))
    # a JSON offset: shard 0 from its 3rd entry on, the other shards from the beginning
    shard0 = sorted(
        (tuple(map(int, i.split("-"))), i)
        for (rid, _), i in zip(ticks(40), old, strict=True)
        if shard_of(rid, 4) == 0
    )
    start = json.dumps({"0": shard0[1][1]})
    q = (
        _stream(spark, store, topic, redis_db, startingOffsets=start)
        .select("shard")
        .writeStream.format("memory")
        .queryName(f"j_{topic[2:]}")
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        q.processAllAvailable()
        n = spark.sql(f"select count(*) from j_{topic[2:]} where shard = 0").collect()[0][0]
    finally:
        q.stop()
    assert n == len(shard0) - 2 + sum(1 for i in range(40, 50) if shard_of(f"res-{i % 7}", 4) == 0)


def test_parse_start() -> None:
    assert parse_start("earliest") == "earliest"
    assert parse_start('{"1": "5-2"}') == {"1": "5-2"}
    assert parse_start("1700000000000") == 1700000000000
    assert parse_start("2023-11-14T22:13:20Z") == 1700000000000
    with pytest.raises(ConfigError, match="startingOffsets"):
        parse_start("yesterday")


def test_query_behind_the_trim_point_continues_from_the_archive(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = tmp_path / "seg"
    store.mkdir()
    events = ticks(200)
    ids = publish(redis_db, topic, events)  # in Redis only
    seen: list[tuple[int, str]] = []
    batches: list[int] = []

    def collect(df: Any, batch_id: int) -> None:
        seen.extend((r.shard, r.entry_id) for r in df.select("shard", "entry_id").collect())
        batches.append(batch_id)
        if len(batches) == 1:  # the offloader archives and trims everything the query has not read
            offload(redis_db, str(store), topic)

    q = (
        _stream(spark, str(store), topic, redis_db, maxEntriesPerTrigger="40")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    assert len(batches) >= 4
    assert sorted(seen) == _keyed(events, ids)  # no gap, no repeat


def test_starting_offsets_time(spark: Any, redis_db: str, tmp_path: Path, topic: str) -> None:
    store = tmp_path / "seg"
    store.mkdir()
    events = ticks(60)
    ids = publish(redis_db, topic, events[:30])
    ids += publish(redis_db, topic, events[30:])
    at = int(ids[30].split("-")[0])
    want = sorted(k for k in _keyed(events, ids) if int(k[1].split("-")[0]) >= at)
    name = f"t_{topic[2:]}"
    q = (
        _stream(spark, str(store), topic, redis_db, startingOffsets=str(at))
        .select("shard", "entry_id")
        .writeStream.format("memory")
        .queryName(name)
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        q.processAllAvailable()
        got = sorted((r.shard, r.entry_id) for r in spark.sql(f"select * from {name}").collect())
    finally:
        q.stop()
    assert got == want and len(got) >= 30


def test_available_now_honours_the_per_trigger_cap_and_reports_the_latest_offset(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Trigger.AvailableNow reads what was there when the query started, in micro-batches of
    maxOffsetsPerTrigger (it read everything in one batch: Spark's wrapper drops the limit for a
    source without SupportsTriggerAvailableNow), then stops; entries published meanwhile are
    left for the next run, and show in the progress's latestOffset (the query's lag)."""
    store = tmp_path / "seg"
    store.mkdir()
    events = ticks(120)
    ids = publish(redis_db, topic, events)
    seen: list[tuple[int, str]] = []
    sizes: list[int] = []

    def collect(df: Any, batch_id: int) -> None:
        rows = df.select("shard", "entry_id").collect()
        seen.extend((r.shard, r.entry_id) for r in rows)
        sizes.append(len(rows))
        if len(sizes) == 1:
            publish(redis_db, topic, ticks(30, start=120))  # after the query started

    q = (
        _stream(spark, str(store), topic, redis_db, maxOffsetsPerTrigger="40")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(120)
        progress = list(q.recentProgress)
    finally:
        q.stop()
    assert sorted(seen) == _keyed(events, ids)  # all of them, once; none of the later 30
    assert len(sizes) >= 3 and max(sizes) <= 40
    source = progress[-1]["sources"][0]
    latest, end = json.loads(source["latestOffset"]), json.loads(source["endOffset"])
    latest, end = latest[topic], end[topic]  # keyed by topic, as Kafka's
    assert sum(1 for s in latest if latest[s] != end[s]) >= 1  # the 30 later entries: lag


def test_the_per_trigger_limit_follows_each_shards_lag(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """maxOffsetsPerTrigger is split in proportion to each shard's lag, as Kafka's source splits
    it over partitions: one shard 400 entries behind (archived and in Redis), three 12 behind.
    Each micro-batch reads the whole limit while entries wait, most of it from the far shard and
    some from each other one, until all drain together. Split evenly, the first batch read 61
    entries (25 of the far shard's, the three others emptied), the last 75."""
    store = str(tmp_path / "seg")
    rid = {}  # a resource of each of the 4 shards
    for i in range(100):
        rid.setdefault(shard_of(f"plane-{i}", 4), f"plane-{i}")
    far = 0

    def events(far_n: int, small_n: int, start: int) -> list[Any]:
        return [
            (rid[s], Tick(resource=rid[s], seq=start + i))
            for s in range(4)
            for i in range(far_n if s == far else small_n)
        ]

    first, later = events(300, 6, 0), events(100, 6, 1000)  # archived, then left in Redis
    ids = publish(redis_db, topic, first)
    offload(redis_db, store, topic, segment_max_entries=50)
    ids += publish(redis_db, topic, later)
    waiting = {s: sum(1 for r, _ in first + later if r == rid[s]) for s in range(4)}
    assert waiting == {0: 400, 1: 12, 2: 12, 3: 12}
    batches: list[dict[int, int]] = []
    seen: list[tuple[int, str]] = []

    def collect(df: Any, batch_id: int) -> None:
        rows = df.select("shard", "entry_id").collect()
        if rows:
            seen.extend((r.shard, r.entry_id) for r in rows)
            batches.append({s: sum(1 for r in rows if r.shard == s) for s in range(4)})

    q = (
        _stream(spark, store, topic, redis_db, maxOffsetsPerTrigger="100")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180)
    finally:
        q.stop()
    assert sorted(seen) == _keyed(first + later, ids)  # every entry once
    assert [sum(b.values()) for b in batches] == [100, 100, 100, 100, 36]  # the limit used
    # the first batch by lag: 1 each, the other 96 prorated over 399 : 11 : 11 : 11
    assert batches[0][far] == 90 and [batches[0][s] for s in (1, 2, 3)] == [4, 3, 3]
    assert all(b[s] >= 1 for b in batches[:4] for s in range(4))  # none starved, none emptied


@pytest.mark.parametrize("fail_on_data_loss", [None, "false"])
def test_fail_on_data_loss(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, fail_on_data_loss: str | None
) -> None:
    """Entries recorded lost inside a micro-batch's range fail the query (Kafka's
    failOnDataLoss, default true); with false the query warns on the driver and reads on. The
    stream used to read past gap records silently."""
    import anyio

    from eventbus.protocol.ids import EntryId
    from eventbus.tier.gaps import new_gap, record_gap
    from eventbus.tier.store import open_store

    store = tmp_path / "seg"
    store.mkdir()
    events = ticks(50)
    publish(redis_db, topic, events)
    gap = new_gap(topic, shard_of("res-0", 4), EntryId(5, 0), EntryId(9, 0), 3, "test", "test")
    anyio.run(record_gap, open_store(str(store)), gap)
    options = {"failOnDataLoss": fail_on_data_loss} if fail_on_data_loss else {}
    q = (
        _stream(spark, str(store), topic, redis_db, **options)
        .writeStream.format("memory")
        .queryName(f"q_{topic[2:]}_{fail_on_data_loss}")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        if fail_on_data_loss is None:
            with pytest.raises(Exception, match="gap record"):
                q.awaitTermination(120)
        else:
            assert q.awaitTermination(120)
            assert spark.table(f"q_{topic[2:]}_{fail_on_data_loss}").count() == 50
    finally:
        q.stop()


def _available_now(spark: Any, store: str, topic: str, redis_url: str, cp: Path) -> Any:
    return (
        _stream(spark, store, topic, redis_url)
        .writeStream.format("noop")
        .option("checkpointLocation", str(cp))
        .trigger(availableNow=True)
        .start()
    )


def test_a_checkpoint_of_another_topic_or_beyond_the_data_fails(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Offsets are keyed by topic, as Kafka's: a checkpoint of another topic fails the query
    (its entry IDs were taken as this topic's). Offsets past the archive's and the stream's last
    entries (Redis lost the stream, or another store) fail it too (failOnDataLoss), instead of
    reading nothing until new entries pass them."""
    import redis

    from eventbus.protocol.keys import Keys

    store = tmp_path / "seg"
    store.mkdir()
    other = topic + "-b"
    publish(redis_db, topic, ticks(20))
    publish(redis_db, other, ticks(20))
    cp = tmp_path / "cp"
    q = _available_now(spark, str(store), topic, redis_db, cp)
    assert q.awaitTermination(120)
    q = _available_now(spark, str(store), other, redis_db, cp)
    try:
        with pytest.raises(Exception, match="checkpoint holds offsets of topic"):
            q.awaitTermination(120)
    finally:
        q.stop()
    with redis.Redis.from_url(redis_db) as r:
        r.delete(*(Keys().stream(topic, s) for s in range(4)))
    q = _available_now(spark, str(store), topic, redis_db, cp)
    try:
        with pytest.raises(Exception, match="beyond the archive and the stream"):
            q.awaitTermination(120)
    finally:
        q.stop()


def test_micro_batches_list_only_new_segments(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Each micro-batch listed every segment of every shard (100k segment names took 2 s); the
    stream now lists each shard in full once, then only the keys after the last one seen."""
    from spark_support import reads

    store = str(tmp_path / "seg")
    publish(redis_db, topic, ticks(400))
    offload(redis_db, store, topic, segment_max_entries=20)
    q = (
        _stream(
            spark,
            store,
            topic,
            redis_db,
            maxOffsetsPerTrigger="100",
            store_factory="spark_support:listing_store",
        )
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(120)
        batches = sum(1 for p in q.recentProgress if p["numInputRows"])
    finally:
        q.stop()
    listings = [k for k in reads(store) if k.startswith("list:")]
    full = [k for k in listings if k.endswith(":-")]
    assert batches >= 4 and len(listings) > 4 * len(full)
    assert sorted({k.split(":")[1] for k in full}) == ["0", "1", "2", "3"]
    assert len(full) == 4  # one full listing per shard, however many batches


def test_a_topic_neither_archived_nor_registered_fails_the_stream(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """A misspelled topic is an error for a stream too, as for a batch read;
    it streamed nothing, for ever, without a word."""
    store = tmp_path / "seg"
    store.mkdir()
    publish(redis_db, topic, ticks(5))
    q = _available_now(spark, str(store), topic + "-typo", redis_db, tmp_path / "cp")
    try:
        with pytest.raises(Exception, match=r"-typo' is neither in the archive at .* nor in Redis"):
            q.awaitTermination(120)
    finally:
        q.stop()


def test_an_archive_only_stream_reads_micro_batches_that_end_inside_a_segment(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Without Redis (the archive is all there is), a micro-batch whose end falls inside a
    segment read nothing of it: the batch's end stood for the archive's end, so the segment
    (last entry past it) was left out, and the offsets moved on. 2,000 archived entries in one
    segment per shard, 300 per trigger: batches of 0 rows, then the last 200 alone (the flights
    bench lost 300,000 of 336,776 rows the same way)."""
    store = str(tmp_path / "seg")
    events = ticks(2000)
    ids = publish(redis_db, topic, events)
    offload(redis_db, store, topic, segment_max_entries=100_000)
    seen: list[tuple[int, str]] = []
    sizes: list[int] = []

    def collect(df: Any, batch_id: int) -> None:
        rows = df.select("shard", "entry_id").collect()
        seen.extend((r.shard, r.entry_id) for r in rows)
        sizes.append(len(rows))

    q = (
        _stream(spark, store, topic, None, maxOffsetsPerTrigger="300")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180)
    finally:
        q.stop()
    assert sorted(seen) == _keyed(events, ids)  # every entry, once
    assert len(sizes) >= 7 and max(sizes) <= 300 and min(sizes[:-1]) > 0
