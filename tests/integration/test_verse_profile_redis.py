"""The Verse profile's publisher and consumer on redis-server; see
`cases.verse_profile_cases`. The mixed fleet is `test_verse_fleet.py`."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from cases.backends import Backend, RedisBackend
from cases.verse_peer import find_partition
from cases.verse_profile_cases import (
    CHANNEL,
    GROUP,
    TOPIC,
    Placed,
    VerseProfileCases,
    create_groups,
    verse_bus,
)
from support import running, wait_until

from eventbus.protocol.verse import VerseKeys

pytestmark = pytest.mark.anyio


class TestVerseProfileOnRedis(RedisBackend, VerseProfileCases):
    pass


async def test_a_verse_lock_key_of_another_type_stops_only_its_shard(
    r: Any, redis_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hash written where shard 0's Verse lock key (a string) belongs: shard 1's events are
    all handled, shard 0 is reported once at ERROR (not once per lock round) naming the key;
    once the key is deleted, shard 0 is taken and its events handled. (The lock script failed
    with WRONGTYPE for the whole round: nothing was handled.)"""
    caplog.set_level(logging.WARNING, logger="eventbus")
    backend = Backend("redis", r, redis_db)
    bus = verse_bus(backend, shards=2, lock_interval_ms=20)
    seen: list[Placed] = []

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Placed) -> None:
        seen.append(event)

    await create_groups(r, shards=2)
    bad = VerseKeys().lock(CHANNEL, 0, GROUP)
    await r.hset(bad, "owner", "someone")
    ids = [f"o{i}" for i in range(40)]
    on = {rid: find_partition(rid, 2) for rid in ids}
    for i, rid in enumerate(ids):
        await bus.publish(TOPIC, Placed(order_id=rid, seq=i), resource_id=rid)
    rounds = 0
    async with running(bus):
        locks = bus.consumers[0].ownership.locks
        acquire = locks.acquire

        async def counted(candidates: Any) -> Any:
            nonlocal rounds
            rounds += 1
            return await acquire(candidates)

        locks.acquire = counted  # type: ignore[method-assign]
        await wait_until(lambda: len(seen) == sum(s == 1 for s in on.values()) and rounds >= 5)
        assert {e.order_id for e in seen} == {rid for rid, s in on.items() if s == 1}
        await r.delete(bad)
        await wait_until(lambda: len(seen) == 40)
    errors = [x.getMessage() for x in caplog.records if x.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "shard 0 of topic 'orders' is not handled" in errors[0] and bad in errors[0]
    assert "WRONGTYPE" in errors[0]
    assert any("shard 0's lock key is usable again" in x.getMessage() for x in caplog.records)
