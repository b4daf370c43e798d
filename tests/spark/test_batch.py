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
        "topic", "shard", "entry_id", "entry_ms", "entry_seq", "resource_id", "event_type",
        "event_id", "published_at", "headers", "payload", "_corrupt",
    ]
    rows = df.collect()
    assert len(rows) == 250
    assert sorted(r.entry_id for r in rows) == sorted(ids)
    assert {r.event_type for r in rows} == {"Tick"}
    assert all(r._corrupt is None and r.published_at is not None for r in rows)
