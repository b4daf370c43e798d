"""Redis Sentinel against a real topology on loopback: a primary, two replicas and
three sentinels (`localredis.sentinel.RedisSentinel`, ``redis-server --sentinel``).

Publishing and consuming go through the Sentinel-managed client of
`eventbus.client.connection.connect`; the primary is SIGKILLed under load, a replica is promoted,
and publishers and consumers carry on with it. With ``publish_replicas=1`` no acknowledged publish
is lost; without it the loss is measured (reported, not asserted: it depends on replication lag at
the moment of the kill).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio
from pydantic import ValidationError
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedConnection
from support import Recorder, Tick, running, wait_until

from eventbus import Context, EventBus, PublishError, Settings, shard_of
from eventbus.client.connection import connect
from eventbus.protocol.keys import Keys
from localredis.sentinel import RedisSentinel

pytestmark = pytest.mark.anyio

SHARDS = 4


@pytest.fixture(scope="module")
def topology() -> Iterator[RedisSentinel]:
    """Primary + 2 replicas + 3 sentinels (about 2.5 s to settle), shared by this module. A test
    that kills the primary restarts it as a replica before the next test (`_heal`)."""
    with RedisSentinel(replicas=2, sentinels=3, down_after_ms=500) as top:
        yield top


@pytest.fixture
def sentinel(topology: RedisSentinel) -> Iterator[RedisSentinel]:
    """The topology, settled, with the current primary's data flushed; healed afterwards."""
    topology.wait_settled()
    with redis.Redis(port=topology.primary_port) as r:
        r.flushall()
        r.wait(2, 5000)
    yield topology
    _heal(topology)


def _heal(top: RedisSentinel) -> None:
    for node in top.nodes:
        if node.proc is None:
            top.restart(node.port)
    top.wait_settled()


def _settings(top: RedisSentinel, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "sentinels": top.sentinel_addresses,
        "sentinel_service": top.service,
        "shards": SHARDS,
        "block_max_ms": 100,
        "retry_base_s": 0.01,
        "retry_max_s": 0.05,
        "liveness_ttl_s": 3.0,
        "redis_connect_timeout_s": 1.0,
        "redis_timeout_margin_s": 2.0,
    }
    return Settings(**(values | overrides))


# -- settings -------------------------------------------------------------------------------------
def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENTBUS_SENTINELS", "10.0.0.1:26379, s2.example:26380,[::1]:26381")
    monkeypatch.setenv("EVENTBUS_SENTINEL_SERVICE", "orders")
    monkeypatch.setenv("EVENTBUS_SENTINEL_PASSWORD", "s3cret")
    s = Settings()
    assert s.sentinel_addresses == [("10.0.0.1", 26379), ("s2.example", 26380), ("::1", 26381)]
    assert s.sentinel_service == "orders"
    assert "s3cret" not in repr(s)
    client = connect(s)
    assert isinstance(client.connection_pool, SentinelConnectionPool)
    assert client.connection_pool.connection_kwargs["retry"].get_retries() == 0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sentinels": "a:1"}, "go together"),
        ({"sentinel_service": "m"}, "go together"),
        ({"sentinels": "a", "sentinel_service": "m"}, "has no port"),
        ({"sentinels": "a:0", "sentinel_service": "m"}, "1-65535"),
        ({"sentinels": "a:x", "sentinel_service": "m"}, "1-65535"),
        ({"sentinels": "a:1", "sentinel_service": "m", "cluster": True}, "exclude each other"),
        ({"sentinels": "a:1", "sentinel_service": "m", "redis_url": "unix:///s"}, "rediss://"),
    ],
)
def test_invalid_sentinel_settings_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**values)


def test_connect_takes_credentials_database_and_tls_from_the_url() -> None:
    s = Settings(
        sentinels=[("127.0.0.1", 1), "127.0.0.1:2"],
        sentinel_service="m",
        redis_url="rediss://u:pr1mary%40pass@ignored:9/3",
        sentinel_password="sentinel-pass",
    )
    client = connect(s)
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    credentials = kwargs["credential_provider"].get_credentials()
    assert (credentials, kwargs["db"]) == (("u", "pr1mary@pass"), 3)
    assert "host" not in kwargs and issubclass(pool.connection_class, SSLConnection)
    assert kwargs["socket_timeout"] == s.redis_read_timeout_s
    sentinel_client = pool.sentinel_manager.sentinels[0]
    sentinel = sentinel_client.connection_pool.connection_kwargs
    assert sentinel["credential_provider"].get_credentials() == ("sentinel-pass",)
    assert sentinel["retry"].get_retries() == 0
    # no repr shows a password (they are CredentialProviders, not keywords)
    shown = [client, pool, kwargs, pool.sentinel_manager, sentinel_client, sentinel]
    for text in map(repr, shown):
        assert "pr1mary" not in text and "sentinel-pass" not in text, text


# -- a real topology ------------------------------------------------------------------------------
async def test_publish_and_consume_through_sentinel(sentinel: RedisSentinel) -> None:
    bus = EventBus(_settings(sentinel))
    rec = Recorder()

    @bus.subscriber("t", group="g")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    async with running(bus):
        assert type(bus.redis) is redis.asyncio.Redis
        assert issubclass(bus.redis.connection_pool.connection_class, SentinelManagedConnection)
        assert bus.publisher.sender._packed  # hiredis-packed pipelines on the Sentinel connection
        for seq in range(50):
            await bus.publish("t", Tick(resource=f"r{seq % 5}", seq=seq), resource_id=f"r{seq % 5}")
        await rec.wait_for(50)
    assert {r: s == sorted(s) for r, s in rec.by_resource().items()} == {
        f"r{i}": True for i in range(5)
    }
    with redis.Redis(port=sentinel.primary_port) as r:
        assert sum(r.xlen(Keys().stream("t", s)) for s in range(SHARDS)) == 50


async def test_credentials_reach_the_primary_and_the_sentinels(sentinel: RedisSentinel) -> None:
    """The primary's user and password (from redis_url) and the sentinels' own,
    passed as redis-py CredentialProviders instead of keywords, still authenticate: the bus
    talks to the primary as its ACL user and to the sentinels as theirs."""
    for node in sentinel.nodes:  # ACL users are not replicated: each node gets its own
        with redis.Redis(port=node.port) as r:
            r.acl_setuser("svc", enabled=True, passwords=["+pr1mary"], keys=["*"],
                          channels=["*"], commands=["+@all"])  # fmt: skip
    for node in sentinel.sentinels:
        with redis.Redis(port=node.port) as r:
            r.acl_setuser("watcher", enabled=True, passwords=["+sentinel-pass"], commands=["+@all"])
    settings = _settings(
        sentinel,
        redis_url="redis://svc:pr1mary@ignored:1/0",
        sentinel_username="watcher",
        sentinel_password="sentinel-pass",
    )
    bus = EventBus(settings)
    try:
        async with bus:
            await bus.publish("t", Tick(resource="r", seq=0), resource_id="r")
            assert await bus.redis.acl_whoami() == "svc"
            users = set()  # the users of the connections each sentinel has open (bus's too)
            for node in sentinel.sentinels:
                with redis.Redis(port=node.port) as r:
                    users |= {c["user"] for c in r.client_list()}
            assert "watcher" in users  # the bus asked a sentinel for the primary as "watcher"
            for text in (repr(bus.redis), repr(bus.redis.connection_pool.connection_kwargs)):
                assert "pr1mary" not in text and "sentinel-pass" not in text
    finally:
        await bus.aclose()
        for node in sentinel.nodes:
            with redis.Redis(port=node.port) as r:
                r.acl_deluser("svc")
        for node in sentinel.sentinels:
            with redis.Redis(port=node.port) as r:
                r.acl_deluser("watcher")


async def test_sender_reconnects_to_the_promoted_replica(sentinel: RedisSentinel) -> None:
    """The publisher's pooled connection (hiredis-packed pipelines) follows a failover: after
    the primary is killed, publishes go on, to the promoted replica, over the same fast path."""
    bus = EventBus(_settings(sentinel, publish_timeout_s=20))
    async with bus:
        assert bus.publisher.sender._packed
        first = await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
        old = sentinel.primary_port
        new = await anyio.to_thread.run_sync(sentinel.failover)
        second = await bus.publish("t", Tick(resource="a", seq=2), resource_id="a")
        assert second > first
        conns = {(c.host, c.port) for c in bus.redis.connection_pool._in_use_connections}
        conns |= {(c.host, c.port) for c in bus.redis.connection_pool._available_connections}
        assert ("127.0.0.1", new) in conns and new != old
    with redis.Redis(port=new) as r:
        stream = Keys().stream("t", shard_of("a", SHARDS))
        assert r.xrange(stream)[-1][0].decode() == second


# -- failover under load --------------------------------------------------------------------------
@dataclass
class Load:
    """Publishers (one task per resource, each publish awaited before the next) and what they
    and the handlers saw."""

    acked: dict[tuple[str, int], str] = field(default_factory=dict)
    failed: set[tuple[str, int]] = field(default_factory=set)
    handled: list[tuple[str, int, int, str]] = field(default_factory=list)  # r, seq, token, id
    changed: anyio.Event = field(default_factory=anyio.Event)

    def note(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    async def until(self, count: int, within_s: float) -> None:
        with anyio.fail_after(within_s):
            while len(self.acked) < count:
                await self.changed.wait()

    def order_violations(self) -> int:
        """First handling of each seq, in handling order, must be increasing per resource;
        seqs whose publish raised (may land late) are left out."""
        top: dict[str, int] = defaultdict(int)
        seen: set[tuple[str, int]] = set()
        bad = 0
        for r, seq, _token, _id in self.handled:
            if (r, seq) in seen or (r, seq) in self.failed:
                seen.add((r, seq))
                continue
            seen.add((r, seq))
            bad += seq < top[r]
            top[r] = max(top[r], seq)
        return bad

    def lost(self) -> list[tuple[str, int]]:
        done = {(r, s) for r, s, _, _ in self.handled}
        return sorted(k for k in self.acked if k not in done)


async def _remaining(top: RedisSentinel, bus: EventBus) -> int:
    """Entries of the current primary's shard streams that group "g" has not acked."""
    client = redis.asyncio.Redis(port=top.primary_port, socket_timeout=2)
    try:
        total = 0
        for s in range(SHARDS):
            stream = bus.keys.stream("load", s)
            if not await client.exists(stream):
                continue
            info = await client.xinfo_stream(stream)
            for g in await client.xinfo_groups(stream):
                if g["name"] == b"g":
                    unread = g["last-delivered-id"] != info["last-generated-id"]
                    total += int(g["pending"]) + (1 if unread else 0)
        return total
    except (redis.ConnectionError, redis.TimeoutError):
        return -1
    finally:
        await client.aclose()


async def _drained_failover(top: RedisSentinel, replicas: int) -> Load:
    """A failover under load, then wait until the consumers acked everything on the promoted
    primary."""
    settings = _settings(top, publish_replicas=replicas, publish_timeout_s=15)
    load = Load()
    consumers = [EventBus(settings) for _ in range(2)]
    for bus in consumers:

        @bus.subscriber("load", group="g")
        async def handle(event: Tick, ctx: Context) -> None:
            load.handled.append((event.resource, event.seq, ctx.fencing_token, ctx.entry_id))

    publisher = EventBus(settings)
    stop = anyio.Event()

    async def publish(rid: str) -> None:
        for seq in itertools.count(1):
            if stop.is_set():
                return
            try:
                entry = await publisher.publish(
                    "load", Tick(resource=rid, seq=seq), resource_id=rid
                )
            except PublishError:
                load.failed.add((rid, seq))
            else:
                load.acked[(rid, seq)] = entry
            load.note()

    with anyio.fail_after(50):
        async with running(*consumers):
            async with publisher, anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(publish, f"r{i}")
                await load.until(1500, within_s=15)
                await anyio.to_thread.run_sync(top.failover)
                await load.until(len(load.acked) + 1500, within_s=20)  # publishers carry on
                stop.set()
            await wait_until(lambda: _remaining_is_zero(top, consumers[0]), within_s=20)
    return load


async def _remaining_is_zero(top: RedisSentinel, bus: EventBus) -> bool:
    return await _remaining(top, bus) == 0


async def test_failover_under_load_loses_no_acknowledged_publish_with_wait(
    sentinel: RedisSentinel,
) -> None:
    load = await _drained_failover(sentinel, replicas=1)
    assert load.order_violations() == 0
    assert load.lost() == []
    assert len(load.acked) >= 3000


async def test_failover_under_load_without_wait_keeps_order(
    sentinel: RedisSentinel, record_property: Any
) -> None:
    """Without ``publish_replicas`` the acknowledged publishes the replica had not received
    when the primary died are gone: counted (``lost``), not asserted. Order still holds among
    what was handled."""
    load = await _drained_failover(sentinel, replicas=0)
    lost = load.lost()
    record_property("lost_acknowledged_publishes", len(lost))
    print(f"failover without WAIT: {len(load.acked)} acknowledged, {len(lost)} lost")
    assert load.order_violations() == 0
    assert len(load.acked) >= 3000
