"""Entries compressed with a topic's zstd dictionary read by Spark from the archive: executors
load the dictionary the offloader copied beside the segments (they never talk to Redis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from spark_support import make_bus, offload, publish, ticks

from eventbus.cli.topic import sample_bodies
from eventbus.protocol.dictionaries import Dictionaries, dictionary_id
from eventbus.protocol.keys import Keys

pytestmark = pytest.mark.integration


def train(redis_url: str, topic: str) -> int:
    async def go() -> int:
        bus = make_bus(redis_url)
        try:
            async with bus:
                d = Dictionaries(bus.redis, bus.keys)
                return await d.train(
                    topic, await sample_bodies(bus, d, topic, 300, bus.settings), 2048
                )
        finally:
            await bus.aclose()

    return anyio.run(go)


def test_dictionary_entries_read_from_the_archive(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    import redis

    store = str(tmp_path / "seg")
    publish(redis_db, topic, ticks(300))
    dict_id = train(redis_db, topic)
    publish(redis_db, topic, ticks(100, start=300))  # a new publisher: uses the dictionary
    with redis.Redis.from_url(redis_db) as r:
        data = [f[b"data"] for s in range(4) for _, f in r.xrange(Keys().stream(topic, s))]
    assert sum(dictionary_id(d) == dict_id for d in data) == 100
    offload(redis_db, store, topic)
    df = (
        spark.read.format("eventbus")
        .option("store", store)
        .option("topic", topic)
        .option("model", "spark_support:Tick")
        .load()
    )
    rows = df.collect()
    assert len(rows) == 400
    assert all(r._corrupt is None for r in rows)
    assert sorted(r.seq for r in rows) == list(range(400))


def test_a_swapped_dictionary_in_the_archive_is_a_corrupt_row_not_another_payload(
    spark: Any, redis_db: str, tmp_path: Path, topic: str
) -> None:
    """The archive's copy of a dictionary replaced by another valid one (``res-`` spelled
    ``RES-`` inside it): the 100 entries that need it read as ``_corrupt`` rows naming the
    dictionary, never as events of resource ``RES-...``; the others read."""
    from eventbus.tier.layout import dictionary_key

    store = tmp_path / "seg"
    publish(redis_db, topic, ticks(300))
    dict_id = train(redis_db, topic)
    publish(redis_db, topic, ticks(100, start=300))
    offload(redis_db, str(store), topic)
    copy = store / dictionary_key(topic, dict_id)
    assert b"res-" in copy.read_bytes()
    copy.write_bytes(copy.read_bytes().replace(b"res-", b"RES-"))
    df = (
        spark.read.format("eventbus")
        .option("store", str(store))
        .option("topic", topic)
        .option("model", "spark_support:Tick")
        .load()
    )
    rows = df.collect()
    corrupt = [r for r in rows if r._corrupt is not None]
    assert len(rows) == 400 and len(corrupt) == 100
    assert all(f"dictionary {dict_id}" in r._corrupt for r in corrupt)
    assert sorted(r.seq for r in rows if r._corrupt is None) == list(range(300))
    assert all(r.resource.startswith("res-") for r in rows if r._corrupt is None)
