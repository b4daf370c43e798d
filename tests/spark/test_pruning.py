"""Pruning skips objects (reads counted by a store wrapper), corrupt segments, gap records, S3."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F
from spark_support import offload, publish, reads, ticks

from eventbus.protocol.sharding import shard_of
from eventbus.tier import open_store
from eventbus.tier.store import list_segments_sync

pytestmark = pytest.mark.integration


def counted(spark: Any, store: str, topic: str, **options: Any) -> Any:
    r = (
        spark.read.format("eventbus")
        .option("store", store)
        .option("topic", topic)
        .option("store_factory", "spark_support:counting_store")
        .option("packBytes", "0")
    )
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


@pytest.fixture
def archived(redis_db: str, tmp_path: Path, topic: str) -> tuple[str, list[str]]:
    store = str(tmp_path / "seg")
    ids = publish(redis_db, topic, ticks(800, resources=9))
    offload(redis_db, store, topic, segment_max_entries=50)
    return store, ids


def _segments(store: str, topic: str) -> dict[int, list[Any]]:
    return {s: list_segments_sync(open_store(store), topic, s) for s in range(4)}


def test_shard_and_resource_filters_skip_segments(
    spark: Any, archived: tuple[str, list[str]], topic: str, redis_db: str
) -> None:
    store, _ = archived
    segs = _segments(store, topic)
    total = sum(len(v) for v in segs.values())
    df = counted(spark, store, topic)
    assert df.count() == 800 and len(reads(store)) == total
    Path(store).parent.joinpath("reads.log").unlink()
    assert counted(spark, store, topic).where("shard = 2").count() == sum(
        1 for i in range(800) if shard_of(f"res-{i % 9}", 4) == 2
    )
    assert sorted(set(reads(store))) == sorted(r.key for r in segs[2])
    Path(store).parent.joinpath("reads.log").unlink()
    rows = counted(spark, store, topic, shards="4").where(F.col("resource_id") == "res-3").collect()
    assert len(rows) == len([i for i in range(800) if i % 9 == 3])
    assert {k.split("/")[1] for k in reads(store)} == {f"shard={shard_of('res-3', 4)}"}


def test_entry_time_and_id_filters_skip_segments(
    spark: Any, archived: tuple[str, list[str]], topic: str
) -> None:
    store, ids = archived
    segs = [r for refs in _segments(store, topic).values() for r in refs]
    pivot = segs[len(segs) // 2].first.ms
    want = sum(1 for i in ids if int(i.split("-")[0]) >= pivot)
    assert counted(spark, store, topic).where(F.col("entry_ms") >= pivot).count() == want
    assert sorted(set(reads(store))) == sorted(r.key for r in segs if r.last.ms >= pivot)
    Path(store).parent.joinpath("reads.log").unlink()
    one, shard = ids[123], shard_of(f"res-{123 % 9}", 4)
    df = counted(spark, store, topic).where((F.col("entry_id") == one) & (F.col("shard") == shard))
    (row,) = df.collect()
    assert row.entry_id == one and row.shard == shard
    assert len(set(reads(store))) == 1  # the one segment of that shard holding the ID


def test_published_at_pruned_by_parquet_statistics(
    spark: Any, archived: tuple[str, list[str]], topic: str
) -> None:
    store, _ = archived
    future = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)
    assert counted(spark, store, topic).where(F.col("published_at") > future).count() == 0
    segs = [r.key for refs in _segments(store, topic).values() for r in refs]
    # footers only (one open per segment), never a whole-object get
    assert sorted(reads(store)) == sorted(segs)


def test_without_pushdown_reads_everything(
    spark: Any, archived: tuple[str, list[str]], topic: str
) -> None:
    store, _ = archived
    n = sum(len(v) for v in _segments(store, topic).values())
    assert counted(spark, store, topic, pushdown="false").where("shard = 1").count() > 0
    assert len(reads(store)) == n


def test_corrupt_segment_permissive_and_failfast(
    spark: Any, archived: tuple[str, list[str]], topic: str
) -> None:
    store, _ = archived
    victim = _segments(store, topic)[1][0]
    path = Path(store) / victim.key
    path.write_bytes(path.read_bytes()[:-200])  # truncated
    df = counted(spark, store, topic)
    rows = df.where(F.col("_corrupt").isNotNull()).collect()
    assert len(rows) == 1 and victim.key in rows[0]._corrupt and rows[0].shard == 1
    assert rows[0].entry_id is None
    with pytest.raises(Exception, match="corrupt segment"):
        counted(spark, store, topic, mode="FAILFAST").count()


def test_gaps_surfaced(
    spark: Any, archived: tuple[str, list[str]], topic: str, caplog: Any
) -> None:
    import anyio

    from eventbus.protocol.ids import EntryId
    from eventbus.spark.objects import Objects
    from eventbus.spark.planning import plan_read
    from eventbus.spark.pruning import Pruning
    from eventbus.spark.surfacing import surface_gaps
    from eventbus.tier.gaps import new_gap, record_gap

    store, _ = archived
    gap = new_gap(topic, 2, EntryId(5, 0), EntryId(9, 0), 17, "trimmed (test)", "test")
    anyio.run(record_gap, open_store(store), gap)
    cut = plan_read(Objects(open_store(store)), topic, Pruning())
    assert [g["key"] for g in cut.gaps] == [gap.key]
    with pytest.warns(RuntimeWarning, match="17 entries known lost"):
        surface_gaps(topic, cut.gaps, "warn")
    side = (
        spark.read.format("eventbus")
        .option("store", store)
        .option("topic", topic)
        .option("table", "gaps")
        .load()
        .collect()
    )
    assert len(side) == 1 and side[0].lost_entries == 17 and side[0].shard == 2
    assert side[0].key == gap.key and side[0].after == "5-0"
    with pytest.raises(Exception, match="gap record"):
        counted(spark, store, topic, onGap="fail").count()
    assert counted(spark, store, topic).count() == 800  # default: warn, and read on


def test_s3_through_moto(
    spark: Any, s3_env: str, redis_db: str, topic: str, s3_endpoint: str
) -> None:
    # Spark's Python workers were started before this test set the AWS variables: pass them in
    # the store URL's configuration instead, through a store factory
    from spark_support import MOTO_ENDPOINT

    MOTO_ENDPOINT.write_text(s3_endpoint)
    publish(redis_db, topic, ticks(200))
    offload(redis_db, s3_env, topic)
    tail = publish(redis_db, topic, ticks(30, start=200))
    df = (
        spark.read.format("eventbus")
        .option("store", s3_env)
        .option("topic", topic)
        .option("store_factory", "spark_support:moto_store")
        .option("redis_url", redis_db)
        .option("model", "spark_support:Tick")
        .load()
    )
    rows = df.collect()
    assert len(rows) == 230 and sorted(r.seq for r in rows) == list(range(230))
    assert set(tail) <= {r.entry_id for r in rows}
