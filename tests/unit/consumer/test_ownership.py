"""How long a consumer's round waits when it has no shard to read (`Ownership.poll_ms`): a
consumer joining a busy group polls for the shards of its fair share at least every
`lock_interval_ms`, not at the read loop's doubling BLOCK (up to `block_max_ms`)."""

from __future__ import annotations

import time

import pytest

from eventbus import EventBus, Settings
from eventbus.consumer import Consumer
from eventbus.consumer.running import make_consumers
from eventbus.consumer.shards import HeldShard
from eventbus.locking.locks import LockClient
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.protocol.topics import TopicRegistry
from eventbus.testing import memory_redis


def consumer(**settings: int) -> Consumer:
    bus = EventBus(Settings(redis_url="redis://in-memory", shards=16, **settings))

    @bus.subscriber("orders", group="billing")
    async def handle(event: dict) -> None:  # type: ignore[type-arg]
        pass

    redis = memory_redis()
    [c] = make_consumers(
        bus.subscriptions, redis, bus.keys, bus.settings, TopicRegistry(redis, bus.keys)
    )
    assert isinstance(c, Consumer)
    return c


def test_a_consumer_owed_shards_it_does_not_hold_polls_every_lock_interval() -> None:
    c = consumer(lock_interval_ms=100, block_max_ms=1000)
    assert c.ownership.poll_ms(1000) == 1000  # before any lock round: no share known
    c.ownership.share = 8  # a lock round gave it a share of 8 and no lock (others hold them all)
    assert c.ownership.poll_ms(1000) == 1000  # ... but longer ago than the window of a join
    c.ownership.owed_until = time.monotonic() + 60  # it joined (or was granted a shard) just now
    assert c.ownership.poll_ms(1000) == 100
    assert c.ownership.poll_ms(40) == 40  # the BLOCK still starts short
    table = c.ownership.table
    table.held[3] = HeldShard(3, table.streams[3], 1, 1)  # some of its share held
    c.ownership.table.held[3].draining = True
    assert c.ownership.poll_ms(1000) == 1000  # nothing readable, but its own shards: backs off


def test_with_lock_rounds_before_every_read_the_poll_is_the_block() -> None:
    c = consumer(lock_interval_ms=0)
    c.ownership.share = 8
    c.ownership.owed_until = time.monotonic() + 60
    assert c.ownership.poll_ms(640) == 640


@pytest.mark.anyio
async def test_a_round_that_only_checked_the_held_locks_renews_no_lease() -> None:
    # the lease counts from a liveness refresh: a poll (`LockClient.poll`) refreshes none, so
    # it must not extend the lease; once the lease ran out, the round runs the lock script
    c = consumer(lock_interval_ms=100)
    own = c.ownership
    member = Member(
        own.redis, own.keys, own.settings, own.topic.name, own.group, own.consumer_id, EVENTBUS
    )
    own.locks = LockClient(member, shards=16, full_rounds=0)  # no random lock rounds
    for s in range(16):
        await own.redis.xgroup_create(own.keys.stream("orders", s), "billing", mkstream=True)
    await own.lock_round(c.pipeline)  # a scan: every shard taken, a lease from its refresh
    assert len(own.table.held) == 16 and own.lease.ok()
    until = own.lease.until

    await own.lock_round(c.pipeline)  # the epoch unchanged: the held locks checked, no script
    assert own.lease.until == until and len(own.table.held) == 16

    own.lease.until = 0.0  # the lease ran out (heartbeats late)
    await own.lock_round(c.pipeline)
    assert own.lease.until > until and len(own.table.held) == 16
