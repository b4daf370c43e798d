"""The writer: rows published as events in row order per partition, deterministic event IDs."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import pyarrow as pa
import pytest
import redis
from pydantic import BaseModel, Field, TypeAdapter, field_validator
from pyspark.sql.pandas.types import from_arrow_schema
from spark_support import Tick

from eventbus.errors import ConfigError, PayloadTooLarge
from eventbus.protocol.codec import decode_entry
from eventbus.protocol.keys import Keys
from eventbus.spark.options import SourceOptions
from eventbus.spark.payloads import plain_fields, typed_payloads
from eventbus.spark.writer import NAMESPACE, EventWriter, derived_event_id, derived_event_ids

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


class Reading(BaseModel):
    """A model of plain typed fields: its payloads are read from the Arrow columns."""

    sensor: str
    seq: int
    value: float
    ok: bool
    note: str | None
    unit: str = "C"
    scale: float | None = None


def _pydantic_payloads(batch: Any) -> list[Any]:
    adapter = TypeAdapter(list[Reading])
    dumped: list[Any] = adapter.dump_python(adapter.validate_python(batch.to_pylist()), mode="json")
    return dumped


def test_typed_columns_give_the_payloads_pydantic_gives() -> None:
    """A batch whose columns have the model's types: the payloads read from the columns equal
    pydantic's validate-and-dump of the rows (field order, defaults for absent columns,
    nulls in optional fields, extra columns dropped)."""
    fields = plain_fields(Reading)
    assert fields is not None
    batch = pa.record_batch(
        {
            "seq": pa.array([1, 2, 3], pa.int32()),
            "sensor": ["a", "b", "c"],
            "value": [1.5, -2.0, 0.0],
            "ok": [True, False, True],
            "note": ["x", None, "z"],
            "scale": [None, 2.0, None],
            "extra": [1, 2, 3],
        }
    )
    payloads = typed_payloads(batch, fields)
    assert payloads == _pydantic_payloads(batch)
    assert [list(p) for p in payloads or []] == [list(Reading.model_fields)] * 3


@pytest.mark.parametrize(
    "change",
    [
        {"value": pa.array([1, 2], pa.int64())},  # pydantic converts: int column, float field
        {"value": [1.0, float("nan")]},  # pydantic's json-mode dump decides
        {"value": [1.0, float("inf")]},
        {"sensor": ["a", None]},  # a null in a required field: pydantic says which row
        {"seq": ["1", "2"]},
    ],
)
def test_columns_that_would_not_validate_as_they_are_go_through_pydantic(
    change: dict[str, Any],
) -> None:
    columns: dict[str, Any] = {"sensor": ["a", "b"], "seq": [1, 2], "value": [1.0, 2.0]}
    columns |= {"ok": [True, True], "note": [None, None]} | change
    fields = plain_fields(Reading)
    assert fields is not None
    assert typed_payloads(pa.record_batch(columns), fields) is None
    missing = {k: v for k, v in columns.items() if k != "ok"}
    assert typed_payloads(pa.record_batch(missing), fields) is None  # a required field absent


def test_models_with_more_thanplain_fields_are_validated_by_pydantic() -> None:
    class Checked(BaseModel):
        seq: int

        @field_validator("seq")
        @classmethod
        def positive(cls, v: int) -> int:
            return abs(v)

    class Limited(BaseModel):
        seq: int = Field(ge=0)

    class Aliased(BaseModel):
        seq: int = Field(alias="n")

    for model in (Tick, Checked, Limited, Aliased):  # Tick: a list field
        assert plain_fields(model) is None, model


@pytest.mark.parametrize("key", [0, 7, "abc", "ünï", 2**70, 1.5])
def test_derived_event_ids_are_uuid5_of_topic_and_key(key: Any) -> None:
    assert derived_event_id("t", key) == uuid.uuid5(NAMESPACE, f"t/{key}").bytes
    assert derived_event_ids("t", [key, "x"]) == [derived_event_id("t", k) for k in (key, "x")]
    with pytest.raises(ConfigError, match="no event ID key"):
        derived_event_ids("t", [key, None])


@pytest.mark.parametrize("bad", [None, ""])
def test_a_row_without_resource_id_fails_the_task_with_nothing_of_its_chunk_published(
    redis_db: str, topic: str, bad: str | None
) -> None:
    table = pa.table({"rid": ["a", "b", "c", bad, "e"], "k": range(5)})
    opts = SourceOptions.parse(
        {"topic": topic, "redis_url": redis_db, "resource_id_col": "rid", "event_type": "Raw"},
        need_store=False,
    )
    writer = EventWriter(opts, from_arrow_schema(table.schema))
    with pytest.raises(ConfigError, match=r"row without a resource ID in column 'rid': .*'k': 3"):
        writer.write(iter([table.slice(0, 2).to_batches()[0], table.slice(2).to_batches()[0]]))
    published = sorted(env.payload["k"] for _, _, env in _entries(redis_db, topic, 16))
    assert published == [0, 1]


def test_resource_ids_of_a_number_column_are_its_text(redis_db: str, topic: str) -> None:
    table = pa.table({"rid": [10, 20], "k": [1, 2]})
    opts = SourceOptions.parse(
        {"topic": topic, "redis_url": redis_db, "resource_id_col": "rid", "event_type": "Raw"},
        need_store=False,
    )
    EventWriter(opts, from_arrow_schema(table.schema)).write(iter(table.to_batches()))
    envs = sorted((e.payload["k"], e.resource_id) for _, _, e in _entries(redis_db, topic, 16))
    assert envs == [(1, "10"), (2, "20")]


def test_rows_of_many_chunks_are_published_once_each_in_row_order(
    redis_db: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One task over several Arrow batches of several chunks each (`CHUNK` made small): the
    next chunk is built while the one before is with Redis, and every row still reaches its
    shard once, in row order."""
    import eventbus.spark.writer as writer_module

    monkeypatch.setattr(writer_module, "CHUNK", 7)
    table = pa.table({"rid": [f"r{i % 5}" for i in range(100)], "k": range(100)})
    opts = SourceOptions.parse(
        {"topic": topic, "redis_url": redis_db, "resource_id_col": "rid", "event_type": "Raw"},
        need_store=False,
    )
    writer = EventWriter(opts, from_arrow_schema(table.schema))
    published = writer.write(iter(table.to_batches(max_chunksize=30)))
    assert published.rows == 100
    entries = _entries(redis_db, topic, 16)
    assert sorted(e.payload["k"] for _, _, e in entries) == list(range(100))
    for shard in {s for s, _, _ in entries}:
        ks = [e.payload["k"] for s, _, e in entries if s == shard]  # entry-ID order
        assert ks == sorted(ks)


def test_a_worker_loading_the_writer_does_not_import_the_bus() -> None:
    """Spark's Python workers unpickle the writer by module path, each fresh one importing it
    before its first row: ``eventbus.spark.writer`` alone must not pull in the bus, the consumer
    or the native read path (it imported all of them through the packages' ``__init__``)."""
    import subprocess
    import sys

    code = (
        "import sys, eventbus.spark.writer; "
        "print(sorted(m for m in ('eventbus.app', 'eventbus.consumer', 'eventbus.spark.native', "
        "'eventbus.spark.stream') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
