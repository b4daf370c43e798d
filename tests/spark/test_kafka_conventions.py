"""Kafka's conventions where this source departed from them silently: the writer's save modes,
a stream's ``endingOffsets`` error, offsets past a shard's last entry, bounded offsets of an
unknown shard or ending before their start, a time start for batch reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from spark_support import offload, publish, ticks

from eventbus.errors import ConfigError
from eventbus.protocol.keys import Keys
from eventbus.spark import read
from eventbus.tier.errors import TierError

pytestmark = pytest.mark.integration

# Spark's fixed 10 s for a stream planner's Python process to connect back, missed on a loaded
# machine before any eventbus code runs (docs/spark.md, "A stream that fails with ...")
CONNECT_BACK = "Python worker failed to connect back"


def _stream_failure(start: Callable[[str], Any], name: str, attempts: int = 3) -> str:
    """The error text of a stream query that must fail, started by ``start(query_name)``; a
    query whose planner process missed Spark's connect-back bound is started again, as the
    docs tell users (nothing was read). Fails the test if the query does not fail."""
    for attempt in range(attempts):
        query = start(f"{name}_{attempt}")
        try:
            query.processAllAvailable()
        except Exception as exc:
            said = str(exc)
            if CONNECT_BACK not in said or attempt + 1 == attempts:
                return said
        else:
            pytest.fail("the stream query did not fail")
        finally:
            query.stop()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("mode", ["overwrite", "ignore"])
def test_the_writer_refuses_save_modes_that_would_replace_or_skip(
    spark: Any, redis_db: str, topic: str, mode: str
) -> None:
    """Published events cannot be replaced (``overwrite`` appended a second copy) or skipped
    when the topic exists (``ignore``): only ``append`` publishes; nothing is published."""
    df = spark.createDataFrame([("a", 1)], "resource string, seq long")
    writer = (
        df.write.format("eventbus")
        .option("topic", topic)
        .option("redis_url", redis_db)
        .option("resource_id_col", "resource")
        .option("event_type", "Tick")
        .option("shards", "1")
        .mode(mode)
    )
    with pytest.raises(Exception, match=r"mode|append|Ignore|ignore") as caught:
        writer.save()
    assert "UnboundLocalError" not in str(caught.value)
    with redis.Redis.from_url(redis_db) as r:
        assert r.xlen(Keys().stream(topic, 0)) == 0


def test_a_stream_with_ending_offsets_fails_with_the_config_error_itself(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = tmp_path / "archive"
    store.mkdir()
    publish(redis_db, topic, ticks(5))
    df = (
        spark.readStream.format("eventbus")
        .option("store", str(store))
        .option("topic", topic)
        .option("redis_url", redis_db)
        .option("endingOffsets", "latest-ish")
        .load()
    )
    said = _stream_failure(
        lambda name: df.writeStream.format("memory").queryName(name).start(), f"e_{topic[2:]}"
    )
    assert "ConfigError: option endingOffsets is for batch reads" in said
    assert "UnboundLocalError" not in said


def test_offsets_past_a_shards_last_entry_are_said_not_read_as_an_empty_range(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """A batch read starting after a shard's last entry warns on the driver (``onGap=fail``:
    fails); a new stream starting there fails (failOnDataLoss): entries added later with
    smaller IDs would never be read."""
    store = str(tmp_path / "archive")
    ids = publish(redis_db, topic, ticks(30), shards=1)
    offload(redis_db, store, topic, shards=1)
    publish(redis_db, topic, ticks(5, start=30), shards=1)
    far = f"{int(ids[-1].split('-')[0]) + 10**9}-0"
    start = json.dumps({topic: {"0": far}})
    options = {"store": store, "topic": topic, "redis_url": redis_db}
    with pytest.warns(RuntimeWarning, match=r"startingOffsets past the last entry \(shard 0"):
        assert read(spark, options, startingOffsets=start).count() == 0
    with pytest.raises(TierError, match="startingOffsets past the last entry"):
        read(spark, options, startingOffsets=start, onGap="fail")
    stream = spark.readStream.format("eventbus").options(**options, startingOffsets=start).load()
    said = _stream_failure(
        lambda name: stream.writeStream.format("memory").queryName(name).start(), f"b_{topic[2:]}"
    )
    assert "offsets are beyond the archive and the stream" in said


def test_bounded_offsets_of_an_unknown_shard_or_ending_before_the_start_are_errors(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    store = str(tmp_path / "archive")
    ids = publish(redis_db, topic, ticks(20), shards=2)
    offload(redis_db, store, topic, shards=2)
    options = {"store": store, "topic": topic, "redis_url": redis_db}
    with pytest.raises(ConfigError, match="has no shard 5"):
        read(spark, options, startingOffsets=json.dumps({"5": ids[0]}))
    backwards = {
        "startingOffsets": json.dumps({"0": ids[9]}),
        "endingOffsets": json.dumps({"0": ids[1]}),
    }
    with pytest.raises(ConfigError, match="before it starts"):
        read(spark, options, **backwards)
    with pytest.raises(Exception, match="before it starts"):  # the Python source too
        spark.read.format("eventbus").options(**options, **backwards).load().collect()
    with pytest.raises(Exception, match="not an entry ID"):
        read(spark, options, endingOffsets=json.dumps({topic: {"0": 23}}))
