"""A consumer's fenced writes to the parked hash (``lua/fenced_hash.lua``, review32 F4 and F6),
on a real redis-server: consumers driven round by round by the test (no read loop, no
heartbeats), the lock moved on in Redis as after a pause past the liveness TTL."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Tick

from eventbus import EventBus, Settings
from eventbus.consumer.engine import Consumer
from eventbus.errors import ConfigError
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS, VERSE

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def _failing_bus(s: Settings, **bus: Any) -> EventBus:
    """A bus whose subscriber of topic "t", group "g" fails every event once and parks."""
    b = EventBus(s, **bus)

    @b.subscriber("t", group="g", on_failure="park", max_attempts=1)
    async def fails(event: Tick) -> None:
        raise RuntimeError(f"cannot handle {event.resource}:{event.seq}")

    return b


async def _driven(bus: EventBus, s: Settings, member_id: str) -> Consumer:
    """A `Consumer` of `bus`'s subscription under `member_id`, with the bus's profile."""
    await bus.registry.ensure(bus.subscriptions[0].topic)
    member = Member(bus.redis, bus.keys, s, "t", "g", member_id, bus.profile)
    return Consumer(member, bus.registry, bus.subscriptions[0])


async def _work(c: Consumer) -> None:
    """Run one worker and the acks of `c` until every entry it read is finished (acked or
    let go)."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(c.pipeline.acks.loop)
        tg.start_soon(c.pipeline.worker, tg)
        while c.in_flight:
            await c.pipeline.acks.wait_idle()
        tg.cancel_scope.cancel()


async def _park_after_the_lock_moved_on(bus: EventBus, s: Settings, r: Any) -> Consumer:
    """Consumer C locks shard 0 and reads x:1; then C's liveness lapses in Redis (a pause past
    the TTL; C's own lease still looks valid) and consumer D takes the shard. C's handler fails
    x:1 and C parks x. Returns C, its shard table as the park left it."""
    c = await _driven(bus, s, "consumer-c")
    d = await _driven(bus, s, "consumer-d")
    await r.xgroup_create(bus.keys.stream("t", 0), "g", id="0", mkstream=True)
    await bus.publish("t", Tick(resource="x", seq=1), resource_id="x")
    assert await c.pipeline.round(1) and c.in_flight == 1  # shard 0 locked, x:1 read
    await r.zrem(bus.keys.members("t", "g"), "consumer-c")
    await d.ownership.lock_round(d.pipeline)
    assert list(d.ownership.table.held) == [0]
    await _work(c)  # x:1 fails; C dead-letters it and parks x
    return c


@pytest.mark.single_node("one shard; the interleaving is the same")
async def test_a_refused_park_drops_the_shard_at_once(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """review32 F4: Redis refused C's park (the lock moved on). C used to keep the shard until
    its next lock round (here a minute away) and read the shard's next entries into its PEL.
    Now the refusal drops the shard: nothing more of it is read by C."""
    s = settings(shards=1, lock_interval_ms=60_000)
    bus = _failing_bus(s)
    stream = bus.keys.stream("t", 0)
    try:
        c = await _park_after_the_lock_moved_on(bus, s, r)
        assert await r.hget(bus.keys.parked("t", "g"), "x") is None  # refused
        held = c.ownership.table.held
        assert held == {}, f"still held after the refusal: {sorted(held)}"
        await bus.publish("t", Tick(resource="x", seq=2), resource_id="x")
        await bus.publish("t", Tick(resource="y", seq=1), resource_id="y")
        assert not await c.pipeline.round(1)
        mine = await r.xpending_range(stream, "g", "-", "+", 10, "consumer-c")
        assert mine == [], f"C read the shard after its park was refused: {mine}"
        assert c.ownership.table.held == {}  # D holds it, live: C's lock round took nothing
    finally:
        await bus.aclose()


@pytest.mark.single_node("one shard; the interleaving is the same")
async def test_a_custom_profile_with_eventbus_locks_parks_fenced(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """review32 F6: a profile of its own (here eventbus's, renamed) keeps its shard locks in
    eventbus's lock hash, so its parks are fenced like eventbus's. `Failures` decided by the
    profile's identity (``is EVENTBUS``) and sent a plain HSETNX: x was parked by a consumer
    whose lock had moved on."""
    s = settings(shards=1, lock_interval_ms=60_000)
    bus = _failing_bus(s, profile=replace(EVENTBUS, name="mine"))
    try:
        await _park_after_the_lock_moved_on(bus, s, r)
        parked = await r.hget(bus.keys.parked("t", "g"), "x")
        assert parked is None, f"parked, unfenced, after the lock moved on: {parked!r}"
    finally:
        await bus.aclose()


async def test_park_is_refused_for_a_profile_whose_locks_cannot_fence(
    settings: Callable[..., Settings],
) -> None:
    """review32 F6: a profile with eventbus's entries and Verse's shard locks (no lock hash that
    ``fenced_hash.lua`` can check) would park and unpark unfenced: its consumer refuses
    ``on_failure="park"`` with a `ConfigError` naming what is missing (it used to start, its
    writes silently unfenced)."""
    s = settings(shards=1)
    bus = _failing_bus(s, profile=replace(EVENTBUS, name="mixed", lock_client=VERSE.lock_client))
    try:
        with pytest.raises(ConfigError, match=r"on_failure='park'.*mixed profile's lock client"):
            await _driven(bus, s, "consumer-c")
    finally:
        await bus.aclose()
