"""Retention "acked": Redis keeps a topic's entries until every consumer group acked them; consumers
trim to that point, and the offloader never trims past it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio
from support import Recorder, Tick, running, wait_until

from eventbus import EventBus, Settings
from eventbus.protocol.codec import decode_entry
from eventbus.protocol.ids import parse_id
from eventbus.protocol.retention import acked_point, trim_held_to_acked
from eventbus.tier import OFFLOADER_GROUP, TierSettings, offload_until_caught_up, open_store

pytestmark = pytest.mark.anyio

RETAIN = {"retention": "acked", "retention_trim_exact": True, "trim_check_s": 0.05}


async def test_entries_stay_until_every_group_acked_them(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    fast, slow = Recorder(), Recorder()
    a = EventBus(settings(shards=1, **RETAIN))
    a.subscriber("t", group="fast")(fast.add)
    b = EventBus(settings(shards=1, **RETAIN))
    b.subscriber("t", group="slow")(slow.add)
    stream = a.keys.stream("t", 0)
    # both groups exist before the first event: a group created later starts after what was
    # trimmed by then (the slow group's consumer may trim 0..9 before it stops)
    async with running(a, b):  # the slow group reads 10 events, then stops
        for i in range(10):
            await b.publish("t", Tick(resource="x", seq=i), resource_id="x")
        await slow.wait_for(10)
        await fast.wait_for(10)
    async with running(a):
        for i in range(10, 40):
            await a.publish("t", Tick(resource="x", seq=i), resource_id="x")
        await fast.wait_for(40)
        # the fast group acked all 40; the slow one needs 10.. : entries 0..9 go, 10..39 stay
        await wait_until(lambda: _length_is(r, stream, 30))
        [(first_id, first)] = await r.xrange(stream, count=1)
        assert decode_entry(first).payload["seq"] == 10  # what the slow group needs next
        assert await acked_point(r, stream) <= parse_id(first_id)
    async with running(b):
        await slow.wait_for(40)
        await wait_until(lambda: _length_is(r, stream, 0))
    assert [h.seq for h in slow.log] == list(range(40))


async def test_maxlen_retention_keeps_its_default_behaviour(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    rec = Recorder()
    bus = EventBus(settings(shards=1, trim_check_s=0.05))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        for i in range(20):
            await bus.publish("t", Tick(resource="x", seq=i), resource_id="x")
        await rec.wait_for(20)
    assert await r.xlen(bus.keys.stream("t", 0)) == 20  # acked entries are not trimmed
    assert not await r.hexists(bus.keys.retention(), "t")


async def _length_is(r: redis.asyncio.Redis, stream: str, n: int) -> bool:
    return int(await r.xlen(stream)) == n


async def test_the_offloader_does_not_trim_what_a_group_still_needs(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """With the durable tier, retention "acked" also bounds the offloader's trim: it archives
    everything, and trims only what every group acked."""
    rec = Recorder()
    store = open_store(f"file://{tmp_path}")
    # the bus knows the topic is archived: its consumer trims nothing the offloader has not
    # archived (without `archive` it may trim 0..9, acked by the only group, before it stops)
    bus = EventBus(settings(shards=1, **RETAIN), archive=store)
    bus.subscriber("t", group="g")(rec.add)
    stream = bus.keys.stream("t", 0)
    async with running(bus):
        for i in range(10):
            await bus.publish("t", Tick(resource="x", seq=i), resource_id="x")
        await rec.wait_for(10)
    async with bus:  # more events, unread by the group (its consumers are down)
        for i in range(10, 30):
            await bus.publish("t", Tick(resource="x", seq=i), resource_id="x")
    tier = TierSettings(hot_window_s=0, trim_exact=True, segment_max_entries=5)
    stats = await offload_until_caught_up(r, store, settings=bus.settings, tier=tier, timeout_s=60)
    assert stats.entries == 30  # everything archived...
    [(_, first)] = await r.xrange(stream, count=1)
    assert decode_entry(first).payload["seq"] == 10  # ...but 10.. stay for the group
    assert await r.xlen(stream) == 20


async def test_a_shard_an_offloader_has_locked_keeps_what_it_has_not_archived(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """An offloader that ran while the topic was empty recorded no checkpoint, so consumers
    whose bus has no archive trimmed what they acked before its next round, and it recorded a
    gap (walked: ``eventbus offload --once``, then ``eventbus run``, 4 events published and
    acked: "2 gaps (4 entries lost)"). Its shard locks (tokens are never deleted) say that it
    archives the topic: the consumers' acked trim, as the consumer runs it, keeps the entries."""
    rec = Recorder()
    store = open_store(f"file://{tmp_path}")
    bus = EventBus(settings(shards=1, **RETAIN))  # no archive
    bus.subscriber("t", group="g")(rec.add)
    stream, checkpoints = bus.keys.stream("t", 0), bus.keys.checkpoints("t")
    async with running(bus):  # the topic and its group exist, empty
        pass
    tier = TierSettings(hot_window_s=0, trim_exact=True)
    stats = await offload_until_caught_up(r, store, settings=bus.settings, tier=tier, timeout_s=60)
    assert stats.entries == 0 and not await r.hgetall(checkpoints)
    offloader_locks = bus.keys.locks("t", OFFLOADER_GROUP)
    assert await r.hget(offloader_locks, "0:token") is not None
    async with bus:
        for i in range(10):
            await bus.publish("t", Tick(resource="x", seq=i), resource_id="x")
    async with running(bus):
        await rec.wait_for(10)
    await wait_until(lambda: _acked_all(r, stream))
    assert await r.xlen(stream) == 10  # the consumer's own trims (trim_check_s) kept them too
    await trim_held_to_acked(
        r, checkpoints, {0: stream}, exact=True, offloader_locks=offloader_locks
    )
    assert await r.xlen(stream) == 10  # kept for the offloader
    stats = await offload_until_caught_up(r, store, settings=bus.settings, tier=tier, timeout_s=60)
    assert (stats.entries, stats.gaps, stats.lost) == (10, 0, 0)
    await trim_held_to_acked(
        r, checkpoints, {0: stream}, exact=True, offloader_locks=offloader_locks
    )
    assert await r.xlen(stream) == 0  # archived and acked: now it goes


async def _acked_all(r: redis.asyncio.Redis, stream: str) -> bool:
    return (
        await acked_point(r, stream) == parse_id((await r.xrevrange(stream, count=1))[0][0]).next()
    )
