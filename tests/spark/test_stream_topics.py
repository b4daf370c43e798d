"""Kafka's ``subscribe`` in a stream: several topics, offsets keyed by topic then shard,
``maxOffsetsPerTrigger`` spread over every topic's shards, ``Trigger.AvailableNow`` honouring it,
lag over all topics in the progress, a restart from the checkpoint with nothing skipped or repeated,
a checkpoint of another topic set refused, ``failOnDataLoss`` per topic. A stream refused
``subscribe`` with several topics ("batch reads only, for now")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from spark_support import offload, publish, ticks

from eventbus.protocol.sharding import shard_of

pytestmark = pytest.mark.integration

SHARDS = 4


def _stream(spark: Any, store: str, topics: list[str], redis_url: str, **options: Any) -> Any:
    r = (
        spark.readStream.format("eventbus")
        .option("store", store)
        .option("subscribe", ",".join(topics))
        .option("redis_url", redis_url)
        .option("model", "spark_support:Tick")
    )
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def _keyed(topic: str, events: list[Any], ids: list[str]) -> list[tuple[str, int, str]]:
    return [(topic, shard_of(rid, SHARDS), i) for (rid, _), i in zip(events, ids, strict=True)]


def _available_now(df: Any, cp: Path, **sink: Any) -> Any:
    """Start `df` into a Parquet sink at ``sink["path"]`` (else the noop sink), with
    Trigger.AvailableNow; the query (already finished when this returns)."""
    w = df.writeStream.option("checkpointLocation", str(cp)).trigger(availableNow=True)
    if "path" in sink:
        w = w.format("parquet").option("path", str(sink["path"]))
    else:
        w = w.format("noop")
    q = w.start()
    try:
        assert q.awaitTermination(180)
    finally:
        q.stop()
    return q


def test_two_topics_with_a_per_trigger_limit_each_entry_once_and_lag_over_both(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Two topics (each partly archived, partly in Redis) in one stream under
    Trigger.AvailableNow and maxOffsetsPerTrigger: every micro-batch within the limit and
    taking from both topics while both have entries, every entry once with its topic column;
    entries published after the start are left for the next run and show as lag of both topics
    in the progress's latestOffset."""
    store = str(tmp_path / "seg")
    other = topic + "-b"
    a, b = ticks(160), ticks(90, start=1000)
    want = _keyed(topic, a[:100], publish(redis_db, topic, a[:100]))
    want += _keyed(other, b[:50], publish(redis_db, other, b[:50]))
    offload(redis_db, store, topic, segment_max_entries=30)
    offload(redis_db, store, other, segment_max_entries=30)
    want += _keyed(topic, a[100:], publish(redis_db, topic, a[100:]))  # in Redis only
    want += _keyed(other, b[50:], publish(redis_db, other, b[50:]))
    batches: dict[int, list[tuple[str, int, str, int]]] = {}

    def collect(df: Any, batch_id: int) -> None:
        rows = df.select("topic", "shard", "entry_id", "seq").collect()
        batches[batch_id] = [(r.topic, r.shard, r.entry_id, r.seq) for r in rows]
        if len(batches) == 1:  # after the query started: the next run's
            publish(redis_db, topic, ticks(14, start=5000))
            publish(redis_db, other, ticks(14, start=6000))

    q = (
        _stream(spark, store, [topic, other], redis_db, maxOffsetsPerTrigger="48")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180)
        progress = list(q.recentProgress)
    finally:
        q.stop()
    rows = [r for rows in batches.values() for r in rows]
    assert sorted(r[:3] for r in rows) == sorted(want)  # all of them, once; none of the later
    assert all(
        (r[0] == topic and r[3] < 1000) or (r[0] == other and 1000 <= r[3] < 2000) for r in rows
    )  # the topic column matches the payload published there
    sizes = [len(rows) for _, rows in sorted(batches.items())]
    assert len(sizes) >= 6 and max(sizes) <= 48 and sum(sizes) == 250
    first = {r[0] for r in batches[min(batches)]}
    assert first == {topic, other}  # the limit is spread over both topics' shards
    source = progress[-1]["sources"][0]
    latest, end = json.loads(source["latestOffset"]), json.loads(source["endOffset"])
    assert set(latest) == set(end) == {topic, other}  # keyed by topic, then shard
    for t in (topic, other):  # each topic's 14 later entries: lag
        assert any(latest[t][s] != end[t][s] for s in latest[t])


def test_restart_from_the_checkpoint_neither_skips_nor_repeats(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """A two-topic query stops at a trigger boundary (AvailableNow, limited micro-batches);
    meanwhile one topic's Redis tail moves to segments and both get new entries; the restarted
    query continues from its checkpoint: the sink holds every entry of both topics once."""
    store, out, cp = str(tmp_path / "seg"), tmp_path / "out", tmp_path / "cp"
    other = topic + "-b"
    want = _keyed(topic, ticks(120), publish(redis_db, topic, ticks(120)))
    offload(redis_db, store, topic, segment_max_entries=25)
    want += _keyed(topic, ticks(60, start=120), publish(redis_db, topic, ticks(60, start=120)))
    want += _keyed(other, ticks(70), publish(redis_db, other, ticks(70)))  # in Redis only
    columns = ("topic", "shard", "entry_id")
    q = _available_now(
        _stream(spark, store, [topic, other], redis_db, maxOffsetsPerTrigger="40").select(*columns),
        cp,
        path=out,
    )
    first_run = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert len(first_run) >= 6 and max(first_run) <= 40
    assert sorted(tuple(r.values()) for r in pq.read_table(out).to_pylist()) == sorted(want)
    offload(redis_db, store, topic, segment_max_entries=25)  # the tail read from Redis: archived
    later = ticks(50, start=200)
    want += _keyed(topic, later, publish(redis_db, topic, later))
    want += _keyed(other, later, publish(redis_db, other, later))
    offload(redis_db, store, other, segment_max_entries=25)  # the other topic: archive only
    _available_now(
        _stream(spark, store, [topic, other], redis_db, maxOffsetsPerTrigger="40").select(*columns),
        cp,
        path=out,
    )
    got = sorted(tuple(r.values()) for r in pq.read_table(out).to_pylist())
    assert got == sorted(want)  # each entry exactly once across the restart


def test_a_checkpoint_of_another_topic_set_is_refused(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """A checkpointLocation serves one topic set: a query of another set (one more topic, one
    less, another) fails naming them, instead of taking the entry IDs as its own."""
    store = tmp_path / "seg"
    store.mkdir()
    other, third = topic + "-b", topic + "-c"
    for t in (topic, other, third):
        publish(redis_db, t, ticks(12))
    cp = tmp_path / "cp"
    _available_now(_stream(spark, str(store), [topic, other], redis_db), cp)
    for topics in ([topic, third], [topic], [topic, other, third]):
        q = (
            _stream(spark, str(store), topics, redis_db)
            .writeStream.format("noop")
            .option("checkpointLocation", str(cp))
            .trigger(availableNow=True)
            .start()
        )
        try:
            with pytest.raises(Exception, match="checkpoint holds offsets of topic"):
                q.awaitTermination(180)
        finally:
            q.stop()
    # the same set, in another order, is the same query
    _available_now(_stream(spark, str(store), [other, topic], redis_db), cp)


def test_starting_offsets_keyed_by_topic_and_fail_on_data_loss_per_topic(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """startingOffsets keyed by topic then shard bound each topic's shards; a gap record in one
    topic fails the query naming that topic (failOnDataLoss), and with failOnDataLoss=false
    both topics are read."""
    import anyio

    from eventbus.protocol.ids import EntryId
    from eventbus.tier.gaps import new_gap, record_gap
    from eventbus.tier.store import open_store

    store = tmp_path / "seg"
    store.mkdir()
    other = topic + "-b"
    a, b = ticks(40), ticks(30)
    keyed_a = _keyed(topic, a, publish(redis_db, topic, a))
    keyed_b = _keyed(other, b, publish(redis_db, other, b))
    s = keyed_a[0][1]
    shard_a = [k for k in keyed_a if k[1] == s]
    t = keyed_b[0][1]
    shard_b = [k for k in keyed_b if k[1] == t]
    starts = {topic: {str(s): shard_a[2][2]}, other: {str(t): shard_b[1][2]}}
    want = [k for k in keyed_a if k not in shard_a[:3]] + [
        k for k in keyed_b if k not in shard_b[:2]
    ]
    seen: list[tuple[str, int, str]] = []

    def collect(df: Any, batch_id: int) -> None:
        seen.extend((r.topic, r.shard, r.entry_id) for r in df.collect())

    def run(cp: str, **options: Any) -> Any:
        df = _stream(spark, str(store), [topic, other], redis_db, **options)
        return (
            df.select("topic", "shard", "entry_id")
            .writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(tmp_path / cp))
            .trigger(availableNow=True)
            .start()
        )

    q = run("cp1", startingOffsets=json.dumps(starts))
    try:
        assert q.awaitTermination(180)
    finally:
        q.stop()
    assert sorted(seen) == sorted(want)
    gap = new_gap(other, t, EntryId(5, 0), EntryId(9, 0), 3, "test", "test")
    anyio.run(record_gap, open_store(str(store)), gap)
    q = run("cp2")
    try:
        with pytest.raises(Exception, match=f"topic '{other}': 1 gap record"):
            q.awaitTermination(180)
    finally:
        q.stop()
    seen.clear()
    q = run("cp3", failOnDataLoss="false")
    try:
        assert q.awaitTermination(180)
    finally:
        q.stop()
    assert sorted(seen) == sorted(keyed_a + keyed_b)


@pytest.mark.parametrize("count", [1, 2])
def test_a_limit_below_the_shard_count_is_never_exceeded(
    spark: Any, redis_db: str, tmp_path: Path, topic: str, count: int
) -> None:
    """maxOffsetsPerTrigger=3 over one or two topics of 4 shards: every micro-batch reads at
    most 3 entries (the least advanced shards first), all are read once. A micro-batch took at
    least one entry from each shard with new entries (4 for one topic's 4 shards)."""
    store = tmp_path / "seg"
    store.mkdir()
    topics = [topic, topic + "-b"][:count]
    want = [k for t in topics for k in _keyed(t, ticks(10), publish(redis_db, t, ticks(10)))]
    sizes: list[int] = []
    seen: list[tuple[str, int, str]] = []

    def collect(df: Any, batch_id: int) -> None:
        rows = df.select("topic", "shard", "entry_id").collect()
        sizes.append(len(rows))
        seen.extend((r.topic, r.shard, r.entry_id) for r in rows)

    q = (
        _stream(spark, str(store), topics, redis_db, maxOffsetsPerTrigger="3")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180)
    finally:
        q.stop()
    assert sorted(seen) == sorted(want)
    assert max(sizes) <= 3 and sum(sizes) == len(want) == 10 * count
