"""`eventbus.spark.read_stream`: micro-batches planned by the eventbus stream (its offsets,
per-trigger limit and checkpoint), each read by the native path: the archived part through
Spark's Parquet reader, the Redis tail through the Python source; rows as the Python stream's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from spark_support import offload, publish, ticks

from eventbus.spark import read_stream

pytestmark = pytest.mark.integration

MODEL = "spark_support:Tick"


def _run(spark: Any, options: dict[str, Any], checkpoint: Path) -> list[dict[str, Any]]:
    """One ``Trigger.AvailableNow`` run of `read_stream`: per micro-batch, its rows (as dicts,
    in entry-ID order per shard) and the Parquet files Spark read for it."""
    batches: list[dict[str, Any]] = []

    def process(df: Any, batch_id: int) -> None:
        got = [r.asDict() for r in df.collect()]
        files = [f for f in df.inputFiles() if f.endswith(".parquet")]
        batches.append({"id": batch_id, "rows": got, "files": files})

    q = (
        read_stream(spark, process, options)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(300)
    finally:
        q.stop()
    return batches


def _key(r: dict[str, Any]) -> tuple[int, int, int]:
    return (r["shard"], r["entry_ms"], r["entry_seq"])


def test_micro_batches_read_the_archive_natively_and_the_tail_from_redis_each_entry_once(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """An archive and a Redis tail, ``maxOffsetsPerTrigger=100``: batches of at most 100
    entries, the archived ones read from their segments by Spark's reader; every entry once,
    equal to the Python stream's rows; a restart from the checkpoint reads only what came
    after."""
    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(300), shards=2)
    offload(redis_db, store, topic, shards=2, typed_models={topic: MODEL})
    publish(redis_db, topic, ticks(50, start=300), shards=2)  # the Redis tail
    options = {
        "store": store,
        "topic": topic,
        "redis_url": redis_db,
        "model": MODEL,
        "maxOffsetsPerTrigger": 100,
    }
    batches = _run(spark, options, tmp_path / "cp")
    got = [r for b in batches for r in b["rows"]]
    assert sorted(r["seq"] for r in got) == list(range(350))
    assert len(batches) >= 4 and max(len(b["rows"]) for b in batches) <= 100
    assert batches[0]["files"]  # the first batches are archived entries: Parquet files
    python = spark.read.format("eventbus").options(**options).load()
    assert sorted(got, key=_key) == sorted((r.asDict() for r in python.collect()), key=_key)

    publish(redis_db, topic, ticks(20, start=350), shards=2)
    later = _run(spark, options, tmp_path / "cp")  # the same checkpoint
    assert sorted(r["seq"] for b in later for r in b["rows"]) == list(range(350, 370))


def test_an_archive_only_stream_reads_each_batch_from_its_segments_only(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Without Redis, a micro-batch ending inside a segment reads that segment's rows up to its
    end only; the next batch the rest: every archived entry once, all through Spark's reader."""
    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(240), shards=1)
    offload(redis_db, store, topic, shards=1, typed_models={topic: MODEL})
    options = {"store": store, "topic": topic, "model": MODEL, "maxOffsetsPerTrigger": 70}
    batches = _run(spark, options, tmp_path / "cp")
    assert [len(b["rows"]) for b in batches] == [70, 70, 70, 30]
    assert all(b["files"] for b in batches)
    ordered = [r["seq"] for b in batches for r in sorted(b["rows"], key=_key)]
    assert ordered == list(range(240))


def test_a_batch_read_refuses_the_streams_internal_plan_option(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """``_plan`` (the micro-batch plan `read_stream` asks the stream for) is no batch option: a
    batch read with it fails with a `ConfigError` naming it, instead of returning plan rows."""
    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(10), shards=1)
    offload(redis_db, store, topic, shards=1)
    df = spark.read.format("eventbus").options(store=store, topic=topic, _plan="true").load()
    with pytest.raises(Exception, match=r"ConfigError: option _plan is internal") as caught:
        df.collect()
    assert "read_stream" in str(caught.value)


def test_each_micro_batchs_bounds_come_from_its_planned_partition_without_a_job(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """`batch_bounds` takes a micro-batch's offsets from the `PlanPart` Spark planned for it
    (no Spark job reading the plan row in a Python worker): the same offsets as the row, batch
    after batch, and no job runs for them."""
    from eventbus.spark.native_stream import _planned, batch_bounds

    store = str(tmp_path / "archive")
    publish(redis_db, topic, ticks(90), shards=2)
    offload(redis_db, store, topic, shards=2, typed_models={topic: MODEL})
    plans = (
        spark.readStream.format("eventbus")
        .options(store=store, topic=topic, maxOffsetsPerTrigger="40", _plan="true")
        .load()
    )
    seen: list[tuple[Any, Any, Any, int, int]] = []
    tracker = spark.sparkContext.statusTracker()

    def each(plan: Any, batch_id: int) -> None:
        spark.sparkContext.setJobGroup(f"bounds-{batch_id}", "batch_bounds")
        fast, planned = batch_bounds(plan), _planned(plan)
        jobs = len(tracker.getJobIdsForGroup(f"bounds-{batch_id}"))
        rows = [tuple(r) for r in plan.collect()]
        counted = len(tracker.getJobIdsForGroup(f"bounds-{batch_id}"))  # the group sees jobs
        seen.append((fast, planned, rows, jobs, counted))

    q = (
        plans.writeStream.foreachBatch(each)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(300)
    finally:
        q.stop()
    assert len(seen) >= 3
    for fast, planned, rows, jobs, counted in seen:
        assert rows and fast == planned == rows[0]
        assert jobs == 0 and counted >= 1
