"""`eventbus.locking.verse.VerseLockClient` against Verse's lock protocol, as test cases run on
two backends: `tests/unit/test_verse_locks_fake.py` (fakeredis) and
`tests/integration/test_verse_locks_redis.py` (redis-server and a 3-primary Cluster). A
subclass provides the `client` fixture (an asyncio client on an empty database).

The Verse side is `cases.verse_peer.VersePeer`'s lock calls: a re-implementation of Verse's
lock scripts with the same arguments, keys and replies (checked against Verse's own scripts on
redis-server when written: the same replies and lock values for every call of these cases).
"""

from __future__ import annotations

from typing import Any

from cases.verse_peer import LIVENESS, VersePeer

from eventbus.locking.locks import LockState
from eventbus.locking.verse import VERSE_LOCK_TTL_S, VerseLockClient
from eventbus.protocol.verse import VerseKeys

KEYS = VerseKeys()
CHANNEL = KEYS.channel("orders")
GROUP = "billing"
ALL = list(range(16))


def ours(client: Any, member_id: str = "py-1", ttl_s: float = 10.0) -> VerseLockClient:
    return VerseLockClient(
        client,
        keys=KEYS,
        channel=CHANNEL,
        group=GROUP,
        member_id=member_id,
        shards=16,
        liveness_ttl_s=ttl_s,
    )


def peer(client: Any, service_id: str = "rb-1") -> VersePeer:
    return VersePeer(client, GROUP, service_id, [CHANNEL], handle=lambda m: None)


async def lock_values(client: Any) -> list[str | None]:
    values = [await client.get(KEYS.lock(CHANNEL, s, GROUP)) for s in ALL]
    return [v.decode() if v else None for v in values]


class VerseLockCases:
    """The lock client of the Verse profile and a Verse consumer exclude each other."""

    async def test_alone_it_takes_every_shard_under_verses_keys(self, client: Any) -> None:
        held = await ours(client).acquire(ALL)
        assert sorted(held.grants) == ALL
        assert {g.state for g in held.grants.values()} == {LockState.TAKEN_FREE}
        assert await lock_values(client) == ["py-1"] * 16
        assert await client.exists(LIVENESS + "py-1") == 1
        assert 0 < await client.ttl(KEYS.lock(CHANNEL, 0, GROUP)) <= VERSE_LOCK_TTL_S

    async def test_verse_takes_nothing_we_hold_while_we_are_alive(self, client: Any) -> None:
        await ours(client).acquire(ALL)
        verse = peer(client)
        await client.set(LIVENESS + "rb-1", 1, ex=30)
        assert await verse.lock_channel_shards() == []
        await verse.unlock_channel_shards()  # Verse's end of iteration: ours stay ours
        assert await lock_values(client) == ["py-1"] * 16

    async def test_we_take_nothing_a_live_verse_consumer_holds(self, client: Any) -> None:
        verse = peer(client)
        await client.set(LIVENESS + "rb-1", 1, ex=30)
        assert len(await verse.lock_channel_shards()) == 16
        held = await ours(client).acquire(ALL)
        assert held.grants == {}
        await verse.release_locks([CHANNEL, 0b1111])  # Verse unlocks shards 0..3
        held = await ours(client).acquire(ALL)
        assert sorted(held.grants) == [0, 1, 2, 3]

    async def test_a_dead_verse_consumers_locks_are_taken(self, client: Any) -> None:
        verse = peer(client)
        await client.set(LIVENESS + "rb-1", 1, ex=30)
        await verse.lock_channel_shards()
        await client.delete(LIVENESS + "rb-1")  # its liveness key expired
        held = await ours(client).acquire(ALL)
        assert sorted(held.grants) == ALL
        assert {g.state for g in held.grants.values()} == {LockState.TAKEN_FROM_DEAD}

    async def test_verse_takes_our_locks_once_our_liveness_is_gone(self, client: Any) -> None:
        client_ = ours(client)
        await client_.acquire(ALL)
        await client.delete(LIVENESS + "py-1")  # as when its PX ran out (a paused process)
        assert await client_.heartbeat() is False  # lapsed: it is not revived
        assert await client.exists(LIVENESS + "py-1") == 0
        verse = peer(client)
        await client.set(LIVENESS + "rb-1", 1, ex=30)
        assert len(await verse.lock_channel_shards()) == 16

    async def test_leaving_frees_our_locks_for_verse_at_once(self, client: Any) -> None:
        client_ = ours(client)
        await client_.acquire(ALL)
        assert sorted(await client_.release([0, 1], leave=False)) == [0, 1]
        assert await client.exists(LIVENESS + "py-1") == 1
        await client_.release(range(2, 16), leave=True)
        assert await client.exists(LIVENESS + "py-1") == 0
        verse = peer(client)
        await client.set(LIVENESS + "rb-1", 1, ex=30)
        assert len(await verse.lock_channel_shards()) == 16

    async def test_release_leaves_verses_locks_alone(self, client: Any) -> None:
        verse = peer(client)
        await client.set(LIVENESS + "rb-1", 1, ex=30)
        await verse.lock_channel_shards()
        assert await ours(client).release(ALL, leave=True) == []
        assert await lock_values(client) == ["rb-1"] * 16

    async def test_eventbus_consumers_share_fairly_and_are_fenced(self, client: Any) -> None:
        a, b = ours(client, "py-a"), ours(client, "py-b")
        first = await a.acquire(ALL)
        assert len(first.grants) == 16
        second = await b.acquire(ALL)
        assert second.share == 8 and second.grants == {}  # a holds all: b waits for a surplus
        await a.release(list(first.grants)[8:])
        second = await b.acquire(ALL)
        assert len(second.grants) == 8
        tokens = {s: g.token for s, g in second.grants.items()}
        assert set(tokens.values()) == {2}  # every eventbus acquisition increments the token

    async def test_heartbeat_renews_liveness_and_the_locks_ttl(self, client: Any) -> None:
        client_ = ours(client)
        await client_.acquire([0, 1])
        await client.expire(KEYS.lock(CHANNEL, 0, GROUP), 5)
        await client.set(KEYS.lock(CHANNEL, 2, GROUP), "rb-1", ex=5)  # another's: untouched
        assert await client_.heartbeat() is True
        assert await client.ttl(KEYS.lock(CHANNEL, 0, GROUP)) > 5
        assert await client.ttl(KEYS.lock(CHANNEL, 2, GROUP)) <= 5

    async def test_verses_flags_are_signed_32_bit_at_32_shards(self, client: Any) -> None:
        verse = VersePeer(client, GROUP, "rb-1", [CHANNEL], handle=lambda m: None, shards=32)
        await client.set(LIVENESS + "rb-1", 1, ex=30)
        assert await verse.acquire_locks([CHANNEL]) in ([CHANNEL.encode(), -1], [CHANNEL, -1])
        assert len(await verse.lock_channel_shards()) == 0  # held by itself, alive: not again

    async def test_a_lock_key_of_another_type_stops_only_its_shard(self, client: Any) -> None:
        """A hash where Verse's lock key of shard 0 should be a string (written by hand): the
        lock round takes the other shards and names shard 0's key and the server's error; the
        heartbeat and the release still work (they answered WRONGTYPE for every shard)."""
        bad = KEYS.lock(CHANNEL, 0, GROUP)
        await client.hset(bad, "x", "1")
        me = ours(client)
        held = await me.acquire(ALL)
        assert sorted(held.grants) == ALL[1:]
        assert list(held.unusable) == [0]
        assert held.unusable[0].startswith(f"{bad}: WRONGTYPE"), held.unusable
        assert await me.heartbeat() is True
        assert sorted(await me.release(ALL)) == ALL[1:]
        assert await client.type(bad) in (b"hash", "hash")  # left as it was
