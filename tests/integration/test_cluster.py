"""The whole path on a 3-node Redis Cluster: publish, lock scripts, ordered consumption by two
consumers, acks. (The lock scripts' cases also run on the cluster: test_lock_scripts_redis.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from redis.asyncio.cluster import RedisCluster as ClusterClient
from support import Recorder, Tick, running, wait_until

from eventbus import Context, EventBus, Settings, ShardCountMismatch, shard_of
from eventbus.app import connect
from localredis.cluster import ReplicatedCluster

pytestmark = pytest.mark.anyio

TOPIC, GROUP, SHARDS = "flights", "ordered", 6


@pytest.fixture
async def cluster_settings(redis_cluster: ReplicatedCluster) -> AsyncIterator[Settings]:
    client = ClusterClient.from_url(redis_cluster.url)
    await client.flushall()
    await client.aclose()
    yield Settings(
        redis_url=redis_cluster.url,
        cluster=True,
        shards=SHARDS,
        block_max_ms=50,
        retry_base_s=0.01,
        retry_max_s=0.05,
    )


async def _pending(client: Any, bus: EventBus) -> int:
    total = 0
    for s in range(SHARDS):
        total += int((await client.xpending(bus.keys.stream(TOPIC, s), GROUP))["pending"])
    return total


async def test_publish_and_ordered_consume_on_a_cluster(cluster_settings: Settings) -> None:
    client = connect(cluster_settings)
    assert isinstance(client, ClusterClient)
    publisher = EventBus(cluster_settings)
    consumers = [EventBus(cluster_settings) for _ in range(2)]
    rec = Recorder()
    for bus in consumers:

        @bus.subscriber(TOPIC, group=GROUP)
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

    resources, per_resource = 12, 15
    events = [
        (f"plane-{i}", Tick(resource=f"plane-{i}", seq=seq))
        for seq in range(per_resource)
        for i in range(resources)
    ]
    try:
        first_ids = await publisher.publish_many(TOPIC, events[:60])
        async with publisher, running(*consumers) as runs:
            for rid, event in events[60:]:  # one by one, through the coalescing flusher
                await publisher.publish(TOPIC, event, resource_id=rid)
            await rec.wait_for(len(events), within_s=30)
            await wait_until(lambda: _no_pending(client, publisher))
            members = publisher.keys.members(TOPIC, GROUP)
            assert set(await client.zrange(members, 0, -1)) == {
                r.consumer_ids[0].encode() for r in runs
            }
        assert len(first_ids) == 60

        assert rec.by_resource() == {
            f"plane-{i}": list(range(per_resource)) for i in range(resources)
        }
        # shard streams spread over the nodes; coordination keys share one slot
        slots = {await client.cluster_keyslot(publisher.keys.stream(TOPIC, s)) for s in range(6)}
        nodes = {client.get_node_from_key(publisher.keys.stream(TOPIC, s)).name for s in range(6)}
        assert len(slots) == 6 and len(nodes) >= 2
        coord = [publisher.keys.locks(TOPIC, GROUP), members, publisher.keys.topics()]
        assert len({await client.cluster_keyslot(k) for k in coord}) == 1

        # the shard count check works on a cluster too
        other = EventBus(cluster_settings.model_copy(update={"shards": 3}))
        with pytest.raises(ShardCountMismatch):
            await other.publish(TOPIC, Tick(resource="x", seq=0), resource_id="x")
        await other.aclose()
    finally:
        await publisher.aclose()
        await client.aclose()


async def _no_pending(client: Any, bus: EventBus) -> bool:
    return await _pending(client, bus) == 0


async def test_dead_letter_and_takeover_on_a_cluster(cluster_settings: Settings) -> None:
    """A garbage entry is dead-lettered; a stopped consumer's unfinished entries are recovered,
    in order, by the next one (XAUTOCLAIM through the cluster client)."""
    client = connect(cluster_settings)
    first, second = EventBus(cluster_settings), EventBus(cluster_settings)
    rec = Recorder()
    gate = anyio.Event()
    started: list[int] = []

    @first.subscriber(TOPIC, group=GROUP)
    async def failing(event: Tick, ctx: Context) -> None:
        started.append(event.seq)
        await gate.wait()
        raise RuntimeError("not today")

    @second.subscriber(TOPIC, group=GROUP)
    async def fine(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    try:
        await first.publish_many(TOPIC, [("r", Tick(resource="r", seq=i)) for i in range(4)])
        await client.xadd(first.keys.stream(TOPIC, shard_of("r", SHARDS)), {b"junk": b"1"})
        async with running(first) as [run]:
            await wait_until(lambda: started == [0])
            run.stop()
            gate.set()  # seq 0 fails while stopping: not retried, not dead-lettered, pending
        assert started == [0]
        async with running(second):
            await rec.wait_for(4)
            dlq = second.keys.dead_letter(TOPIC, GROUP)
            await wait_until(lambda: _xlen_is(client, dlq, 1))
            await wait_until(lambda: _no_pending(client, second))
        assert rec.by_resource() == {"r": [0, 1, 2, 3]}
        [(_, letter)] = await client.xrange(dlq)
        assert letter[b"error_type"] == b"DecodeError"
    finally:
        await client.aclose()


async def _xlen_is(client: Any, key: str, n: int) -> bool:
    return await client.xlen(key) == n


async def test_an_idle_consumer_blocks_instead_of_polling(cluster_settings: Settings) -> None:
    """No polling on a cluster: an idle consumer's reads block (few XREADGROUP calls on the
    nodes, none of them spinning), and an event published after an idle spell longer than
    `block_max_ms` reaches the handler at once, not after the block time."""
    import time

    import redis as sync_redis

    settings = cluster_settings.model_copy(update={"block_min_ms": 10, "block_max_ms": 1000})
    bus, publisher = EventBus(settings), EventBus(settings)
    seen: list[float] = []

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Tick, ctx: Context) -> None:
        seen.append(time.monotonic())

    async with publisher, running(bus):
        await publisher.publish(TOPIC, Tick(resource="a", seq=0), resource_id="a")
        await wait_until(lambda: len(seen) == 1)
        await anyio.sleep(1.5)  # the block time has grown to block_max_ms
        nodes = [sync_redis.Redis(port=p) for p in _ports(settings)]
        for n in nodes:
            n.config_resetstat()
        await anyio.sleep(1.0)  # a measurement window, not a synchronisation
        reads = sum(
            int(n.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)) for n in nodes
        )
        for n in nodes:
            n.close()
        # a round per second: at most 2 reads (non-blocking, blocking) per shard per round
        assert reads <= 2 * SHARDS * 3, reads
        for i in range(2):
            sent = time.monotonic()
            await publisher.publish(TOPIC, Tick(resource="a", seq=i + 1), resource_id="a")
            await wait_until(lambda i=i: len(seen) == i + 2)
            assert seen[-1] - sent < 0.25, seen[-1] - sent  # a poller would sleep up to 1 s
            await anyio.sleep(1.2)


def _ports(settings: Settings) -> list[int]:
    import redis as sync_redis

    with sync_redis.RedisCluster.from_url(settings.redis_url) as c:
        return [n.port for n in c.get_primaries()]


async def test_a_connection_closed_under_a_caller_fails_as_a_connection_error(
    cluster_settings: Settings,
) -> None:
    """When a Cluster's topology changes, redis-py disconnects every connection of a node it
    drops, also one a task is writing on. redis-py's own send (``asyncio.wait_for`` runs the
    write as a task of its own; still the path of a send that connects first) can find the
    writer gone between its connected check and its write. The write must fail as a lost
    connection (which callers handle), not with AttributeError (which killed a consumer's ack
    loop in the failover test). (`timed_send` writes a connected send with no await between
    the check and the write.)"""
    from redis.exceptions import ConnectionError as RedisConnectionError

    client = connect(cluster_settings)
    try:
        await client.initialize()
        conn = client.get_random_node().acquire_connection()
        await conn.connect()
        await conn.disconnect(nowait=True)  # as the NodesManager does, after the caller's check
        with pytest.raises(RedisConnectionError):
            await conn._send_packed_command(conn.pack_command("PING"))  # the write step
    finally:
        await client.aclose()


async def test_an_unreachable_cluster_is_a_connection_error() -> None:
    """redis-py raises `RedisClusterException` (not a `RedisError`) when no node answers while it
    learns the topology; the loops that retry Redis errors (heartbeats, reads) died of it. The
    client `connect` makes raises `ConnectionError` instead."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from localredis.server import free_port

    client = connect(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", cluster=True))
    try:
        with pytest.raises(RedisConnectionError, match="topology unknown"):
            await client.ping()
    finally:
        await client.aclose()


async def _on_other_nodes(client: Any, keys: Any, candidates: list[str]) -> tuple[str, str]:
    """Two of `candidates` whose per-topic coordination lives on different primaries."""
    await client.initialize()
    seen: dict[str, str] = {}
    for topic in candidates:
        node = client.get_node_from_key(keys.locks(topic, GROUP)).name
        if seen and node not in seen:
            return next(iter(seen.values())), topic
        seen.setdefault(node, topic)
    raise AssertionError(f"{candidates} all on {list(seen)}")


async def test_per_topic_coordination_slots_spread_over_the_nodes_and_keep_order_and_fencing(
    cluster_settings: Settings, tmp_path: Any
) -> None:
    """With ``coordination_slots="topic"`` two topics' locks, liveness and epochs live on
    different primaries, each topic's keys (the parked, control and checkpoint hashes its fenced
    scripts touch with its locks) in one slot apart from the registry's; two consumers of a
    group consume both in order per resource, park and requeue a resource through the fenced
    writes, hand their shards over with tokens that only grow, and the offloader checkpoints
    under its per-topic locks."""
    from eventbus.dlq import DeadLetters
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store

    settings = cluster_settings.model_copy(update={"coordination_slots": "topic"})
    client = connect(settings)
    publisher = EventBus(settings)
    keys = publisher.keys
    first, second = await _on_other_nodes(client, keys, ["flights", "orders", "carts", "users"])
    failing = {"bad"}
    rec = {first: Recorder(), second: Recorder()}

    def subscribe(bus: EventBus) -> EventBus:
        for topic in (first, second):
            bus.subscriber(topic, group=GROUP, max_attempts=1, on_failure="park")(handler(topic))
        return bus

    def handler(topic: str) -> Any:
        async def handle(event: Tick, ctx: Context) -> None:
            if event.resource in failing:
                raise RuntimeError("parked until requeued")
            rec[topic].add(event, ctx)

        return handle

    consumers = [subscribe(EventBus(settings)) for _ in range(2)]

    async def publish(seqs: range) -> None:
        for seq in seqs:
            for topic in (first, second):
                for rid in ("a", "b", "c", "d"):
                    await publisher.publish(topic, Tick(resource=rid, seq=seq), resource_id=rid)

    async def tokens(topic: str) -> dict[bytes, int]:
        raw = await client.hgetall(keys.locks(topic, GROUP))
        return {k: int(v) for k, v in raw.items() if k.endswith(b":token")}

    try:
        async with publisher:
            await publish(range(5))
            await publisher.publish(first, Tick(resource="bad", seq=0), resource_id="bad")
            async with running(*consumers):
                for topic in (first, second):
                    await rec[topic].wait_for(20)
                letters = DeadLetters(client, keys, publisher.topic(first), GROUP)
                await wait_until(lambda: _is_parked(letters))
                failing.clear()
                await letters.requeue_resource("bad")  # a control entry, executed fenced
                await rec[first].wait_for(21)
            before = {t: await tokens(t) for t in (first, second)}
            await publish(range(5, 10))
            async with running(subscribe(EventBus(settings))):  # new owner: new tokens
                for topic in (first, second):
                    await rec[topic].wait_for(41 if topic == first else 40)
            after = {t: await tokens(t) for t in (first, second)}
        for topic in (first, second):
            assert set(after[topic]) == set(before[topic]) and len(after[topic]) == SHARDS
            assert all(after[topic][s] > before[topic][s] for s in before[topic])
        expected = {rid: list(range(10)) for rid in ("a", "b", "c", "d")}
        assert rec[second].by_resource() == expected
        assert rec[first].by_resource() == {**expected, "bad": [0]}

        stats = await offload_until_caught_up(
            client,
            open_store(f"file://{tmp_path}"),
            settings=settings,
            tier=TierSettings(hot_window_s=0),
            timeout_s=60,
        )
        assert stats.entries == 82  # 80, "bad" and its requeued copy
        assert await client.hlen(keys.checkpoints(first)) > 0

        def slot_keys(topic: str) -> list[str]:
            return [
                keys.locks(topic, GROUP),
                keys.members(topic, GROUP),
                keys.lock_epoch(topic, GROUP),
                keys.parked(topic, GROUP),
                keys.control(topic, GROUP),
                keys.locks(topic, "_offloader"),
                keys.checkpoints(topic),
            ]

        slots = {t: {await client.cluster_keyslot(k) for k in slot_keys(t)} for t in rec}
        assert all(len(s) == 1 for s in slots.values()) and slots[first] != slots[second]
        assert await client.cluster_keyslot(keys.topics()) not in slots[first] | slots[second]
        nodes = {client.get_node_from_key(keys.locks(t, GROUP)).name for t in rec}
        assert len(nodes) == 2
        assert await client.exists(keys.locks(first, GROUP)) == 1  # the keys really live there

        # `eventbus stats` shows which primary holds each topic's tag, and the registry's
        import io

        from rich.console import Console

        from eventbus.cli.placement import placement_table

        console = Console(width=200, record=True, file=io.StringIO())
        console.print(await placement_table(client, keys, {first: SHARDS, second: SHARDS}))
        text = console.export_text()
        rows = text.splitlines()
        for topic in rec:
            node = client.get_node_from_key(keys.locks(topic, GROUP)).name
            assert any(node in row and f"{{eventbus:{topic}}}" in row for row in rows), rows
        assert "{eventbus}" in text
    finally:
        await client.aclose()


async def _is_parked(letters: Any) -> bool:
    return "bad" in await letters.parked()
