"""`Ownership`'s lock rounds: how long a consumer's round waits (`poll_ms`) and when its next lock
round is due (`lock_due`) while it is owed shards (a consumer joining a group polls for the
shards of its fair share four times a `lock_interval_ms`, not at the read loop's doubling BLOCK,
up to `block_max_ms`); a holder releases its drained surplus in the lock round that finds it;
a poll renews no lease."""

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


def consumer(redis: object = None, **settings: int) -> Consumer:
    bus = EventBus(Settings(redis_url="redis://in-memory", shards=16, **settings))

    @bus.subscriber("orders", group="billing")
    async def handle(event: dict) -> None:  # type: ignore[type-arg]
        pass

    redis = redis or memory_redis()
    [c] = make_consumers(
        bus.subscriptions, redis, bus.keys, bus.settings, TopicRegistry(redis, bus.keys)
    )
    assert isinstance(c, Consumer)
    return c


def test_a_consumer_owed_shards_polls_four_times_a_lock_interval() -> None:
    c = consumer(lock_interval_ms=100, block_max_ms=1000)
    assert c.ownership.poll_ms(1000) == 1000  # before any lock round: no share known
    c.ownership.share = 2  # a lock round gave it a share of 2 and no lock (others hold them all)
    assert c.ownership.poll_ms(1000) == 1000  # ... but longer ago than the window of a join
    c.ownership.owed_until = time.monotonic() + 60  # it joined (or was granted a shard) just now
    assert c.ownership.poll_ms(1000) == 25
    assert c.ownership.poll_ms(10) == 10  # the BLOCK still starts short
    table = c.ownership.table
    table.held[3] = HeldShard(3, table.streams[3], 1, 1)  # some of its share held: still owed
    assert c.ownership.poll_ms(1000) == 25
    table.held[4] = HeldShard(4, table.streams[4], 1, 1)  # its whole share: the BLOCK again
    assert c.ownership.poll_ms(1000) == 1000


def test_a_consumer_owed_shards_locks_a_quarter_interval_after_its_last_lock_round() -> None:
    c = consumer(lock_interval_ms=100)
    own, table = c.ownership, c.ownership.table
    table.held[3] = HeldShard(3, table.streams[3], 1, 1)
    own.lease.renew(time.monotonic())
    own.share = 1  # holding its share: the next lock round a whole interval after the last
    own._next_lock = time.monotonic() + 0.1 - 0.03  # the last one 30 ms ago
    assert not own.lock_due()
    own.share = 2  # owed one shard, but longer ago than the window after it joined
    assert not own.lock_due()
    own.owed_until = time.monotonic() + 60  # owed, within the window: 25 ms after the last
    assert own.lock_due()
    own._next_lock = time.monotonic() + 0.1 - 0.01  # the last one 10 ms ago
    assert not own.lock_due()


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


async def _member(c: Consumer) -> None:
    """`c` with a lock client that runs no random full round (a poll is a poll)."""
    own = c.ownership
    member = Member(
        own.redis, own.keys, own.settings, own.topic.name, own.group, own.consumer_id, EVENTBUS
    )
    own.locks = LockClient(member, shards=16, full_rounds=0)
    await c.reader.ensure_groups()


@pytest.mark.anyio
async def test_a_joiner_holds_its_share_at_its_first_lock_round_after_the_holders() -> None:
    """Rounds counted, not timed: the holder's first lock round after the join releases its
    idle surplus (it used to keep it, marked draining, until after its next read, which blocks
    up to `block_max_ms` on an idle topic), and the joiner's next lock round takes it."""
    redis = memory_redis()
    first, second = consumer(redis), consumer(redis)
    for c in (first, second):
        await _member(c)
    await first.ownership.lock_round(first.pipeline)
    assert len(first.ownership.table.held) == 16

    await second.ownership.lock_round(second.pipeline)  # joins: a share of 8, every lock held
    assert second.ownership.share == 8 and not second.ownership.table.held

    await first.ownership.lock_round(first.pipeline)  # sees the new epoch: its share is 8
    assert first.ownership.share == 8 and len(first.ownership.table.held) == 8
    await second.ownership.lock_round(second.pipeline)
    assert len(second.ownership.table.held) == 8
    owners = await redis.hgetall(first.ownership.keys.locks("orders", "billing"))
    ids = [owners[str(s).encode()].decode() for s in range(16)]
    assert sorted(set(ids)) == sorted({first.consumer_id, second.consumer_id})
