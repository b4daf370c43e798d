"""Typed segments end to end: ``eventbus offload --once`` with ``EVENTBUS_TIER_TYPED_MODELS`` writes
the payload as typed columns, an entry that does not validate keeps its ``data`` and is counted, and
DuckDB reads the archive's typed columns with one ``read_parquet`` call (docs/spark.md)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import duckdb
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel
from tier_support import Tick, make_bus, publish_ticks
from typer.testing import CliRunner

from eventbus.cli import app
from eventbus.tier.replay import iter_topic
from eventbus.tier.store import open_store

pytestmark = pytest.mark.integration
RUNNER = CliRunner()


class BadTick(BaseModel):
    """Published under the event type Tick, with a payload the registered Tick refuses."""

    __event_type__ = "Tick"
    resource: str
    seq: str


def test_offload_writes_typed_columns_duckdb_reads_them(redis_db: str, tmp_path: Path) -> None:
    async def publish() -> None:
        bus = make_bus(redis_db, shards=2)
        async with bus:
            await publish_ticks(bus, "typed", 100)
            await bus.publish("typed", BadTick(resource="r", seq="x"), resource_id="res-1")
        await bus.aclose()

    anyio.run(publish)
    store = tmp_path / "archive"
    env = {
        "EVENTBUS_TIER_HOT_WINDOW_S": "0",
        "EVENTBUS_TIER_TYPED_MODELS": json.dumps({"typed": f"{Tick.__module__}:Tick"}),
    }
    args = ["--store", str(store), "--redis-url", redis_db]
    off = RUNNER.invoke(app, ["offload", "--once", *args], env=env)
    assert off.exit_code == 0, off.output

    segments = sorted(store.glob("typed/*/*.parquet"))
    metas = [pq.read_schema(p).metadata for p in segments]
    assert {m[b"eventbus.segment_version"] for m in metas} == {b"2"}
    assert sum(int(m[b"eventbus.typed_invalid"]) for m in metas) == 1

    rows = duckdb.sql(
        f"SELECT shard, entry_id, resource, seq, typed_error FROM read_parquet("
        f"'{store}/typed/*/*.parquet', union_by_name = true) ORDER BY seq NULLS LAST"
    ).fetchall()
    assert len(rows) == 101
    assert [r[3] for r in rows[:100]] == list(range(100))
    assert all(r[2] == f"res-{r[3] % 13}" for r in rows[:100])
    bad = rows[100]
    assert bad[3] is None and bad[2] is None and "ValidationError: Tick: seq" in bad[4]

    # the raw data stays the source of truth: replay decodes the bad entry's payload as sent
    entries = list(iter_topic(open_store(str(store)), "typed"))
    assert len(entries) == 101
    assert any(e.envelope().payload == {"resource": "r", "seq": "x"} for e in entries)
