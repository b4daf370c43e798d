"""The archive's folders for any engine: a topic folder read by plain Spark, DuckDB and pyarrow
gives each archived event once (gap records and dictionaries kept apart); segments stored in
the earlier layout (``<topic>/<shard>/``) stay readable by every eventbus reader."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from spark_support import offload, publish, ticks

from eventbus.spark import read
from eventbus.tier.gaps import Gap, gap_json
from eventbus.tier.layout import dictionary_key
from eventbus.tier.replay import iter_topic
from eventbus.tier.store import open_store
from eventbus.tier.verify import verify_archive

pytestmark = pytest.mark.integration

MODEL = "spark_support:Tick"


def archive_with_records(redis_db: str, store: Path, topic: str) -> None:
    """200 ticks archived with typed columns, and next to them a gap record and a dictionary
    copy, as a lossy, compressed topic has them."""
    publish(redis_db, topic, ticks(200))
    offload(redis_db, str(store), topic, typed_models={topic: MODEL})
    gap = Gap(topic, 0, "1-0", "2-0", 0, 1, "test", "a record next to the segments")
    (store / gap.key).parent.mkdir(parents=True)
    (store / gap.key).write_text(gap_json(gap))
    (store / dictionary_key(topic, 1)).parent.mkdir(parents=True)
    (store / dictionary_key(topic, 1)).write_bytes(b"not parquet")


def test_plain_spark_reads_the_topic_folder_once(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """``spark.read.parquet("<store>/<topic>")``, no glob: every archived event once, ``shard``
    from the Hive-style folders equal to the segments' own column. (In the earlier layout Spark
    read the gap record's JSON as Parquet and failed.)"""
    from pyspark.sql import functions as F

    store = tmp_path / "archive"
    archive_with_records(redis_db, store, topic)
    df = spark.read.option("mergeSchema", "true").parquet(str(store / topic))
    rows = df.select("shard", "entry_id", "seq", F.input_file_name().alias("file")).collect()
    assert sorted(r["seq"] for r in rows) == list(range(200))
    assert len({(r["shard"], r["entry_id"]) for r in rows}) == 200
    assert all(f"/shard={r['shard']}/" in r["file"] for r in rows)
    assert {r["shard"] for r in rows} == {0, 1, 2, 3}


def test_duckdb_and_pyarrow_read_the_topic_folder_once(
    redis_db: str, tmp_path: Path, topic: str
) -> None:
    """DuckDB's ``read_parquet('<topic>/*/*.parquet', union_by_name = true)`` (docs/spark.md's
    line) and pyarrow's Hive-partitioned dataset of the topic folder: each event once."""
    import pyarrow.dataset as ds

    store = tmp_path / "archive"
    archive_with_records(redis_db, store, topic)
    duckdb = pytest.importorskip("duckdb")
    got = duckdb.sql(
        f"SELECT shard, entry_id, seq FROM read_parquet('{store / topic}/*/*.parquet', "
        "union_by_name = true)"
    ).fetchall()
    assert sorted(r[2] for r in got) == list(range(200))
    assert len({(r[0], r[1]) for r in got}) == 200
    table = ds.dataset(store / topic, format="parquet", partitioning="hive").to_table()
    assert sorted(table.column("seq").to_pylist()) == list(range(200))
    shards, ids = table.column("shard").to_pylist(), table.column("entry_id").to_pylist()
    assert len(set(zip(shards, ids, strict=True))) == 200


def test_segments_of_the_earlier_layout_stay_readable(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """Shards 0 and 1's segments moved to the earlier layout's folders (``<topic>/0/``), then
    more events archived (to the Hive-style folders) and a Redis tail: replay, verification,
    the Python source and the native path read each event once, old and new segments alike."""
    store = tmp_path / "archive"
    first = publish(redis_db, topic, ticks(200))
    offload(redis_db, str(store), topic, typed_models={topic: MODEL})
    for shard in (0, 1):
        shutil.move(store / topic / f"shard={shard}", store / topic / str(shard))
    second = publish(redis_db, topic, ticks(100, start=200))
    offload(redis_db, str(store), topic, typed_models={topic: MODEL})
    publish(redis_db, topic, ticks(30, start=300))  # the tail, in Redis only
    old = list((store / topic).glob("[01]/*.parquet"))
    assert old and list((store / topic).glob("shard=0/*.parquet"))

    objects = open_store(str(store))
    replayed = [(e.shard, e.entry_id) for e in iter_topic(objects, topic)]
    assert len(replayed) == len(set(replayed)) == 300
    assert verify_archive(objects, topic, expected_entry_ids=first + second).exactly_once

    options = {"store": str(store), "topic": topic, "redis_url": redis_db, "model": MODEL}
    python = spark.read.format("eventbus").options(**options).load()
    native = read(spark, options)
    assert {Path(p.removeprefix("file:")).resolve() for p in native.inputFiles()} >= {
        p.resolve() for p in old
    }
    for df in (python, native):
        seqs = [r["seq"] for r in df.select("seq").collect()]
        assert sorted(seqs) == list(range(330))
