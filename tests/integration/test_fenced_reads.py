"""Fenced delivery (issue 9 item 1) and redelivery counts (item 3) against a real redis-server.

A stale consumer's ``XREADGROUP`` that lands late (a process paused between its lease check and
the send, ``CLIENT PAUSE``, a request delayed in the network past the TTL) delivers entries into
*its* pending entries list although another consumer holds the shard now. Reproduced
deterministically: ``MULTI; XADD e2; XREADGROUP ... stale >; EXEC`` hands e2 to a consumer name
that holds no lock before the shard's owner can read it. The owner must handle e2 before the
resource's later e3, not leave it stranded and run e3 first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Recorder, Tick, on_cluster, running, wait_until

from eventbus import EventBus, Settings
from eventbus.locking.scripts import register

pytestmark = pytest.mark.anyio


async def _stale_read(r: Any, bus: EventBus, event: Tick) -> bytes:
    """Publish `event` and, atomically with it, read it as consumer "stale" of group "g"."""
    stream, fields = bus.publisher.prepare(bus.topic("t"), event, event.resource)
    if on_cluster():
        await r.initialize()
    node = r.get_node_from_key(stream) if on_cluster() else None
    direct = redis.asyncio.Redis(host=node.host, port=node.port) if node else r
    async with direct.pipeline(transaction=True) as tx:  # on a cluster: on the stream's node
        tx.xadd(stream, fields)
        tx.xreadgroup("g", "stale", {stream: ">"}, count=10)
        entry_id, reply = await tx.execute()
    if node:
        await direct.aclose()
    assert reply and reply[0][1][0][0] == entry_id  # the stale consumer got it
    return bytes(entry_id)


async def test_a_stale_consumers_late_read_is_claimed_and_handled_in_order(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    rec = Recorder()
    bus = EventBus(settings(shards=1))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        await bus.publish("t", Tick(resource="x", seq=1), resource_id="x")
        await rec.wait_for(1)
        await _stale_read(r, bus, Tick(resource="x", seq=2))
        await bus.publish("t", Tick(resource="x", seq=3), resource_id="x")
        await rec.wait_for(3)
        stream = bus.keys.stream("t", 0)
        await wait_until(lambda: _pel_empty(r, stream))
    assert rec.by_resource() == {"x": [1, 2, 3]}
    redelivered = rec.log[1].ctx
    assert redelivered.delivery_count == 2 and redelivered.redelivered
    assert rec.log[0].ctx.delivery_count == 1 and not rec.log[0].ctx.redelivered


async def test_a_late_read_with_nothing_after_it_is_not_stranded(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """No later entry of the resource arrives: the stale read's entry is still handled (it is
    claimed at the owner's next read, not left pending until the next takeover)."""
    rec = Recorder()
    bus = EventBus(settings(shards=1, block_max_ms=50))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        await bus.publish("t", Tick(resource="y", seq=1), resource_id="y")
        await rec.wait_for(1)
        await _stale_read(r, bus, Tick(resource="y", seq=2))
        with anyio.fail_after(20):
            await rec.wait_for(2)
    assert rec.by_resource() == {"y": [1, 2]}


async def _pel_empty(r: redis.asyncio.Redis, stream: str) -> bool:
    summary = await r.xpending(stream, "g")
    return not summary["pending"]


@pytest.mark.single_node("a Cluster sends XPENDING per stream (cluster_reads), no script")
async def test_a_late_read_is_claimed_after_the_script_cache_was_flushed(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Issue 18: the read round's ``lua/strays.lua`` (the XPENDING summaries, server-side) is
    answered NOSCRIPT after ``SCRIPT FLUSH`` (as after a restart or a failover): the consumer
    loads and runs it then, after the read, keeps the read's entries, and still claims the
    stale read's entry before the resource's later one."""
    rec = Recorder()
    bus = EventBus(settings(shards=1, block_max_ms=50))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        await bus.publish("t", Tick(resource="x", seq=1), resource_id="x")
        await rec.wait_for(1)
        before = await _noscript_errors(r)
        await r.script_flush()
        await _stale_read(r, bus, Tick(resource="x", seq=2))
        await bus.publish("t", Tick(resource="x", seq=3), resource_id="x")
        await rec.wait_for(3)
        await wait_until(lambda: _pel_empty(r, bus.keys.stream("t", 0)))
        assert await _noscript_errors(r) > before  # the flushed script was met
        strays = register(r, "strays")
        assert await r.script_exists(strays.sha) == [True]  # and loaded again by the round
    assert rec.by_resource() == {"x": [1, 2, 3]}
    assert rec.log[1].ctx.delivery_count == 2


async def _noscript_errors(r: redis.asyncio.Redis) -> int:
    stats = await r.info("errorstats")
    return int(stats.get("errorstat_NOSCRIPT", {}).get("count", 0))


@pytest.mark.single_node("the script's keys span slots: a single node's read round only")
async def test_the_strays_script_names_only_other_consumers_with_pending_entries(
    r: redis.asyncio.Redis,
) -> None:
    """``lua/strays.lua`` on a real redis-server: for each stream (1-based index in KEYS) where
    a consumer other than the caller has entries pending, the index and those consumers'
    names; nothing for streams where only the caller has (or nobody has) entries pending."""
    streams = [f"strays-test:{i}" for i in range(4)]
    for stream in streams:
        await r.xgroup_create(stream, "g", id="0", mkstream=True)
        await r.xadd(stream, {"f": "1"})
        await r.xadd(stream, {"f": "2"})
    await r.xreadgroup("g", "me", {streams[0]: ">"}, count=2)  # the caller's own: not stray
    await r.xreadgroup("g", "me", {streams[1]: ">"}, count=1)
    await r.xreadgroup("g", "stale", {streams[1]: ">"}, count=1)
    await r.xreadgroup("g", "old", {streams[3]: ">"}, count=1)
    await r.xreadgroup("g", "stale", {streams[3]: ">"}, count=1)
    await r.xreadgroup("g", "acked", {streams[2]: ">"}, count=1)  # acked: nothing pending
    [(_, [(entry_id, _)])] = await r.xreadgroup("g", "acked", {streams[2]: ">"}, count=1)
    await r.xack(streams[2], "g", entry_id)
    await r.xack(streams[2], "g", (await r.xrange(streams[2], count=1))[0][0])
    strays = register(r, "strays")
    assert await strays(keys=streams, args=["g", "me"]) == [2, [b"stale"], 4, [b"old", b"stale"]]
    assert await strays(keys=streams[:1], args=["g", "me"]) == []
    assert await strays(keys=streams[:1], args=["g", "other"]) == [1, [b"me"]]
