"""A bus in the Verse wire profile (``EventBus(profile="verse")``), as test cases run on
fakeredis (`tests/unit/test_verse_profile_memory.py`) and on redis-server
(`tests/integration/test_verse_profile_redis.py`): what its publisher writes, as Verse reads it
(`cases.verse_peer.VerseMessage.unpack`, Verse's own unpacking), and what its consumer makes of
the entries Verse's publishers write (`cases.verse_peer.publish_resource_event`). The mixed
fleet, a Verse consumer beside ours, is `tests/integration/test_verse_fleet.py` (Verse's lock
script needs Lua's ``bit`` library, which fakeredis lacks).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import anyio.lowlevel
import pytest
from cases.backends import Backend
from cases.verse_peer import VerseMessage, find_partition, pack, publish_resource_event
from pydantic import BaseModel
from support import running, wait_until

from eventbus import Context, EventBus
from eventbus.protocol.keys import Keys
from eventbus.protocol.verse import VerseKeys

TOPIC = "orders"  # a Verse resource type
GROUP = "billing"  # a Verse service name
CHANNEL = VerseKeys().channel(TOPIC)


class Placed(BaseModel):
    __event_type__ = "placed"
    order_id: str
    seq: int


def verse_bus(backend: Backend, **overrides: Any) -> EventBus:
    """A bus of the Verse profile on `backend` (16 shards, as Verse's default partitions)."""
    settings = backend.settings(**{"shards": 16, **overrides})
    return EventBus(settings, redis=backend.redis if backend.url is None else None, profile="verse")


async def create_groups(redis: Any, group: str = GROUP, shards: int = 16) -> None:
    """What Verse's subscriber does at start (``XGROUP CREATE ... $ MKSTREAM``), so that Verse's
    publishers, which never create a stream, have somewhere to write."""
    for s in range(shards):
        await redis.xgroup_create(f"{CHANNEL}${s}", group, id="$", mkstream=True)


class VerseProfileCases:
    """The Verse profile's publisher and consumer on the `backend` a subclass provides."""

    pytestmark = pytest.mark.anyio

    async def test_publish_writes_what_verse_reads_where_verse_reads_it(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        bus = verse_bus(backend)
        keys = ["1", "123", "abc", "user-42", "550e8400-e29b-41d4-a716-446655440000"]
        for i, rid in enumerate(keys):
            await bus.publish(TOPIC, Placed(order_id=rid, seq=i), resource_id=rid)
        await bus.aclose()

        got = {}
        for s in range(16):
            for entry_id, fields in await r.xrange(f"{CHANNEL}${s}"):
                assert set(fields) == {b"msg"}  # Verse's entry: one field
                m = VerseMessage.unpack(
                    fields[b"msg"], channel=CHANNEL, stream=f"{CHANNEL}${s}", entry_id=entry_id
                )
                got[m.content["order_id"]] = (s, m)
        # the vectors at 16 shards, by Verse's own find_partition
        assert {rid: s for rid, (s, _) in got.items()} == {
            "1": 6,
            "123": 3,
            "abc": 3,
            "user-42": 13,
            "550e8400-e29b-41d4-a716-446655440000": 9,
        }
        assert all(find_partition(rid) == s for rid, (s, _) in got.items())
        m = got["user-42"][1]
        assert m.content == {"order_id": "user-42", "seq": 3}
        assert list(m.headers) == ["event", "resource_id"]  # event first, as Verse's
        assert m.headers == {"event": "placed", "resource_id": "user-42"}
        assert m.reply_to is None and int(m.id, 36) < 2**128
        assert await r.keys(f"{Keys().prefix}:stream:*") == []  # nothing in eventbus's streams

    async def test_a_shards_entries_run_one_at_a_time_in_entry_order(
        self, backend: Backend
    ) -> None:
        """Entries of one resource, some from Verse's publishers (no resource ID sent), some
        from ours (resource ID in a header), run in entry order: a shard's entries run one at
        a time, as Verse's consumers run them, although 64 workers could run them at once."""
        r = backend.redis
        await create_groups(r)
        bus = verse_bus(backend)
        entry_ids: dict[int, bytes] = {}
        for seq in range(36):  # 6 resources, each with events from both publishers
            rid = f"order-{seq % 6}"
            if (seq // 6) % 2:  # each resource's events alternate between the publishers
                entry_id = await publish_resource_event(
                    r, TOPIC, rid, "placed", {"order_id": rid, "seq": seq}, headers={"n": "v"}
                )
            else:
                entry_id = await bus.publish(TOPIC, Placed(order_id=rid, seq=seq), resource_id=rid)
            assert entry_id is not None
            entry_ids[seq] = entry_id.encode() if isinstance(entry_id, str) else entry_id

        running_now: dict[int, int] = defaultdict(int)
        overlaps: list[int] = []
        log: list[tuple[Placed, Context]] = []

        @bus.subscriber(TOPIC, group=GROUP)
        async def handle(event: Placed, ctx: Context) -> None:
            running_now[ctx.shard] += 1
            if running_now[ctx.shard] > 1:
                overlaps.append(ctx.shard)
            for _ in range(5):  # let other workers run meanwhile
                await anyio.lowlevel.checkpoint()
            running_now[ctx.shard] -= 1
            log.append((event, ctx))

        async with running(bus):
            await wait_until(lambda: len(log) == 36)
        assert overlaps == []
        by_shard: dict[int, list[str]] = defaultdict(list)
        by_resource: dict[str, list[int]] = defaultdict(list)
        for e, c in log:
            assert c.shard == find_partition(e.order_id) and c.event_type == "placed"
            assert c.entry_id == entry_ids[e.seq].decode()
            by_shard[c.shard].append(c.entry_id)
            by_resource[e.order_id].append(e.seq)
            if (e.seq // 6) % 2:  # Verse's: no resource ID, no time (the entry ID's)
                assert c.resource_id == "" and c.headers == {"n": "v"}
                assert c.published_at_ms == int(c.entry_id.partition("-")[0])
            else:
                assert c.resource_id == e.order_id and c.headers == {}
        assert all(ids == sorted(ids, key=_id_key) for ids in by_shard.values())
        assert all(seqs == sorted(seqs) for seqs in by_resource.values())
        assert sorted(e.seq for e, _ in log) == list(range(36))

    async def test_an_undecodable_entry_is_dead_lettered_with_its_msg(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        await create_groups(r)
        bus = verse_bus(backend)
        stream = f"{CHANNEL}${find_partition('o-1')}"
        await r.xadd(stream, {"msg": b"not zlib"})
        await r.xadd(stream, {"msg": pack([1, 2], {"event": "placed"})})  # no map payload
        await publish_resource_event(r, TOPIC, "o-1", "placed", {"order_id": "o-1", "seq": 1})
        log: list[Placed] = []

        @bus.subscriber(TOPIC, group=GROUP)
        async def handle(event: Placed) -> None:
            log.append(event)

        async with running(bus):
            await wait_until(lambda: len(log) == 1)
            dlq = bus.keys.dead_letter(TOPIC, GROUP)
            await wait_until(lambda: _xlen_is(r, dlq, 2))
        letters = [f for _, f in await r.xrange(dlq)]
        assert [f[b"reason"] for f in letters] == [b"undecodable", b"undecodable"]
        assert letters[0][b"orig_msg"] == b"not zlib"
        assert b"zlib" in letters[0][b"error"]
        assert b"orig_msg" in letters[1] and b"Placed" in letters[1][b"error"]
        assert log == [Placed(order_id="o-1", seq=1)]

    async def test_our_consumer_holds_verses_shard_locks(self, backend: Backend) -> None:
        r = backend.redis
        bus = verse_bus(backend)
        seen: list[Placed] = []

        @bus.subscriber(TOPIC, group=GROUP)
        async def handle(event: Placed) -> None:
            seen.append(event)

        lock_keys = [VerseKeys().lock(CHANNEL, s, GROUP) for s in range(16)]
        async with running(bus) as [run]:
            await bus.publish(TOPIC, Placed(order_id="x", seq=1), resource_id="x")
            await wait_until(lambda: len(seen) == 1)
            me = run.consumer_ids[0].encode()
            assert [await r.get(k) for k in lock_keys] == [me] * 16  # alone: every shard
            assert await r.exists(VerseKeys().liveness(me.decode())) == 1
            assert await r.exists(bus.keys.locks(TOPIC, GROUP)) == 0  # not eventbus's locks
        assert [await r.get(k) for k in lock_keys] == [None] * 16  # released on leaving
        assert await r.exists(VerseKeys().liveness(me.decode())) == 0

    async def test_batch_and_broadcast_subscribers_read_verses_entries(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        await create_groups(r)
        bus = verse_bus(backend)
        batches: list[list[int]] = []
        broadcast: list[int] = []

        @bus.subscriber(TOPIC, group=GROUP, batch=True)
        async def handle(events: list[Placed], ctxs: list[Context]) -> None:
            assert {c.shard for c in ctxs} == {find_partition("o-1")}
            batches.append([e.seq for e in events])

        @bus.subscriber(TOPIC, broadcast=True)
        async def each(event: Placed) -> None:
            broadcast.append(event.seq)

        async with running(bus) as [run]:
            await run.drain()  # the broadcast reader starts at the streams' ends
            for seq in range(10):
                payload = {"order_id": "o-1", "seq": seq}
                await publish_resource_event(r, TOPIC, "o-1", "placed", payload)
            await wait_until(lambda: sum(map(len, batches)) == 10 and len(broadcast) == 10)
        assert [seq for batch in batches for seq in batch] == list(range(10))
        assert broadcast == list(range(10))


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


async def _xlen_is(r: Any, key: str, n: int) -> bool:
    return bool(await r.xlen(key) == n)
