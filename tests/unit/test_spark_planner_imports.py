"""The Python processes Spark starts to plan a read (a stream's planner, a batch read's planner
worker) import only what planning uses: not the settings (pydantic-settings), the tier's
metrics (prometheus), the entry codec (msgspec, zstandard), Redis clients, anyio, pydantic or
pandas: each such process starts from nothing, a stream's planner at every query start
(docs/spark.md, "What Spark's Python processes import to plan")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from eventbus.protocol.ids import EntryId
from eventbus.tier.layout import segment_key

# what a planning process must not import (a read with redis_url imports the redis client to
# plan: these plans have none); the read is typed, and planning does not need its model
HEAVY = (
    "anyio",
    "eventbus.config.settings",
    "eventbus.protocol.codec",
    "eventbus.tier.gaps",
    "eventbus.tier.typed",
    "importlib.metadata",
    "msgspec",
    "pandas",
    "prometheus_client",
    "pydantic",
    "pydantic_settings",
    "redis",
    "zstandard",
)

# Spark computes the schema in another process (``schema()``, which imports the models) and
# hands it to the planner: here the untyped one stands for it
PLAN = """
import json, sys
from pyspark.sql.streaming.datasource import ReadAllAvailable
from eventbus.spark.schema import read_schema
from eventbus.spark.source import EventbusSource

model = "examples.flights.flightdata:Flight"
source = EventbusSource({"store": sys.argv[1], "topic": "orders", "model": model})
schema = read_schema(None)
stream = source.streamReader(schema)
start = stream.initialOffset()
end = stream.latestOffset(start, ReadAllAvailable())
streamed = stream.partitions(start, end)
batch = source.reader(schema)
list(batch.pushFilters([]))
planned = batch.partitions()
parts = [len(streamed), len(planned)]
print(json.dumps({"parts": parts, "end": end, "modules": list(sys.modules)}))
"""


def _archive(root: Path) -> str:
    """Two shards of `orders` with two segments each (planning reads keys, not contents)."""
    for shard in (0, 1):
        for first, last in ((EntryId(1, 0), EntryId(5, 0)), (EntryId(6, 0), EntryId(9, 0))):
            path = root / segment_key("orders", shard, first, last)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
    return str(root)


def test_planning_a_typed_stream_and_batch_read_imports_no_model_codec_settings_or_metrics(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PLAN, _archive(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.splitlines()[-1])
    assert said["parts"] == [2, 2]  # one range per shard; one segments task per shard
    assert said["end"] == {"orders": {"0": "9-0", "1": "9-0"}}
    heavy = sorted(
        m for m in said["modules"] if any(m == h or m.startswith(f"{h}.") for h in HEAVY)
    )
    assert heavy == []
