"""The writer: rows published as events in row order per partition, deterministic event IDs."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import redis

from eventbus.errors import ConfigError, PayloadTooLarge
from eventbus.protocol.codec import decode_entry
from eventbus.protocol.keys import Keys
from eventbus.spark.options import SourceOptions
from eventbus.spark.writer import EventWriter, derived_event_id

pytestmark = pytest.mark.integration


def _entries(redis_url: str, topic: str, shards: int = 4) -> list[tuple[int, str, Any]]:
    out = []
    with redis.Redis.from_url(redis_url) as r:
        for s in range(shards):
            for eid, fields in r.xrange(Keys().stream(topic, s)):
                out.append((s, eid.decode(), decode_entry(fields)))
    return out


def test_rows_published_in_order_with_model(spark: Any, redis_db: str, topic: str) -> None:
    rows = [(f"res-{i % 5}", i, float(i)) for i in range(3000)]
    df = spark.createDataFrame(rows, "resource string, seq long, price double")
    df = df.repartition(3, "resource").sortWithinPartitions("seq")
    (
        df.write.format("eventbus")
        .option("topic", topic)
        .option("redis_url", redis_db)
        .option("resource_id_col", "resource")
        .option("model", "spark_support:Tick")
        .option("event_id_col", "seq")
        .option("shards", "4")
        .mode("append")
        .save()
    )
    entries = _entries(redis_db, topic)
    assert len(entries) == 3000
    per_resource: dict[str, list[int]] = {}
    for _, _, env in sorted(entries, key=lambda e: tuple(map(int, e[1].split("-")))):
        assert env.event_type == "Tick"
        per_resource.setdefault(env.resource_id, []).append(env.payload["seq"])
    for seqs in per_resource.values():
        assert seqs == sorted(seqs)  # row order kept for every resource
    assert {env.payload["seq"]: env.event_id_bytes for _, _, env in entries} == {
        i: derived_event_id(topic, i) for i in range(3000)
    }


def test_rewrite_gives_same_event_ids(spark: Any, redis_db: str, topic: str) -> None:
    df = spark.createDataFrame([("a", 1), ("b", 2)], "rid string, k long")
    for _ in range(2):  # a retried job publishes again, with the same IDs
        (
            df.write.format("eventbus")
            .option("topic", topic)
            .option("redis_url", redis_db)
            .option("resource_id_col", "rid")
            .option("event_type", "Raw")
            .option("event_id_col", "k")
            .mode("append")
            .save()
        )
    envs = [e for _, _, e in _entries(redis_db, topic, 16)]
    assert len(envs) == 4 and len({e.event_id for e in envs}) == 2
    assert {e.payload["k"] for e in envs} == {1, 2} and envs[0].event_type == "Raw"


def test_writer_options_checked(spark: Any, redis_db: str, topic: str) -> None:
    df = spark.createDataFrame([("a", 1)], "rid string, k long")

    def w() -> Any:  # a DataFrameWriter keeps its options: a fresh one per case
        return df.write.format("eventbus").option("topic", topic).mode("append")

    with pytest.raises(Exception, match="redis_url is required"):
        w().option("resource_id_col", "rid").option("event_type", "X").save()
    with pytest.raises(Exception, match="no column 'nope'"):
        w().option("redis_url", redis_db).option("resource_id_col", "nope").option(
            "event_type", "X"
        ).save()
    with pytest.raises(Exception, match="model or option event_type"):
        w().option("redis_url", redis_db).option("resource_id_col", "rid").save()


def test_row_that_does_not_validate_fails_the_write(spark: Any, redis_db: str, topic: str) -> None:
    df = spark.createDataFrame([("a", "not a number")], "resource string, seq string")
    with pytest.raises(Exception, match="does not validate as Tick: seq"):
        (
            df.write.format("eventbus")
            .option("topic", topic)
            .option("redis_url", redis_db)
            .option("resource_id_col", "resource")
            .option("model", "spark_support:Tick")
            .mode("append")
            .save()
        )
    assert _entries(redis_db, topic, 16) == []


def test_a_row_over_the_size_limit_fails_the_task_with_nothing_of_its_chunk_published(
    redis_db: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One task (`EventWriter.write`, no JVM needed) over two Arrow batches, the second with a
    row over `max_payload_bytes` (random text: compression does not bring it under): the
    first batch's rows stay published, none of the second's is (a chunk of rows is encoded and
    checked before any of it is sent); before, the other rows of the chunk were published."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    monkeypatch.setenv("EVENTBUS_MAX_PAYLOAD_BYTES", "4096")
    blobs = ["small"] * 10
    blobs[7] = secrets.token_hex(8192)
    table = pa.table({"rid": [f"r{i % 3}" for i in range(10)], "k": range(10), "blob": blobs})
    opts = SourceOptions.parse(
        {"topic": topic, "redis_url": redis_db, "resource_id_col": "rid", "event_type": "Raw"},
        need_store=False,
    )
    writer = EventWriter(opts, from_arrow_schema(table.schema))
    with pytest.raises(PayloadTooLarge):
        writer.write(iter([table.slice(0, 4).to_batches()[0], table.slice(4).to_batches()[0]]))
    published = sorted(env.payload["k"] for _, _, env in _entries(redis_db, topic, 16))
    assert published == [0, 1, 2, 3]


def test_a_null_event_id_key_is_an_error_not_one_id_for_every_such_row() -> None:
    """A null ``event_id_col`` gave every such row the ID of ``"<topic>/None"`` (the string key
    "None"'s too): a subscriber's de-duplication window then dropped all but the first."""
    assert derived_event_id("t", "None") != derived_event_id("t", "none")
    with pytest.raises(ConfigError, match="no event ID key"):
        derived_event_id("t", None)
