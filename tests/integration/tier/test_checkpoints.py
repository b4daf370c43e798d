"""The offloader's checkpoint writes (`eventbus.tier.checkpoint`, ``lua/checkpoint.lua``) on
redis-server: each operation's effect and reply, and fencing: a caller without the shard's lock
and token changes nothing."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError
from support import async_client

from eventbus.locking.locks import Fenced
from eventbus.protocol.ids import parse_id
from eventbus.protocol.keys import Keys
from eventbus.tier.checkpoint import Checkpoints, Intent, ShardCheckpoint
from eventbus.tier.settings import OFFLOADER_GROUP

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def test_intent_commit_and_count_under_the_lock(redis_db: str) -> None:
    keys = Keys()
    async with async_client(redis_db) as redis:
        cps = Checkpoints(redis, keys, "orders")
        await redis.hset(keys.locks("orders", OFFLOADER_GROUP), mapping={"3": "a", "3:token": 7})
        seg = Intent(parse_id("10-0"), parse_id("19-5"), 12)

        assert await cps.begin(3, "a", 7, seg)
        assert await cps.read(3) == ShardCheckpoint(None, seg, 0)
        # a second intent waits for the pending one
        assert not await cps.begin(3, "a", 7, Intent(parse_id("20-0"), parse_id("21-0"), 2))
        await cps.commit(3, "a", 7, seg.last, 12)
        assert await cps.read(3) == ShardCheckpoint(parse_id("19-5"), None, 12)
        # a replayed commit, or one behind the checkpoint, neither moves it back nor counts
        await cps.commit(3, "a", 7, parse_id("19-5"), 12)
        await cps.commit(3, "a", 7, parse_id("9-0"), 5)
        assert await cps.read(3) == ShardCheckpoint(parse_id("19-5"), None, 12)
        # a stale buffer: a segment that does not start after the checkpoint is refused
        assert not await cps.begin(3, "a", 7, Intent(parse_id("19-5"), parse_id("30-0"), 3))
        # IDs compare as integer pairs: 100-0 is after 19-5 although "100" < "19" as text
        assert await cps.begin(3, "a", 7, Intent(parse_id("100-0"), parse_id("100-2"), 3))
        await cps.commit(3, "a", 7, parse_id("100-2"), 3)
        assert await cps.read(3) == ShardCheckpoint(parse_id("100-2"), None, 15)


async def test_a_gap_is_accounted_from_the_current_checkpoint_then_recorded(
    redis_db: str,
) -> None:
    """``gap`` adds the lost entries and keeps the record as the unrecorded gap, only from the
    checkpoint and count it was detected from and while no other gap is unrecorded;
    ``recorded`` clears that gap only."""
    keys = Keys()
    async with async_client(redis_db) as redis:
        cps = Checkpoints(redis, keys, "orders")
        await redis.hset(keys.locks("orders", OFFLOADER_GROUP), mapping={"3": "a", "3:token": 7})
        # nothing archived yet: the detection saw no checkpoint and a count of 0
        assert await cps.account_gap(3, "a", 7, (None, 0), 4, '{"first": 1}')
        assert await cps.read(3) == ShardCheckpoint(None, None, 4, '{"first": 1}')
        # another gap waits until that one is recorded
        assert not await cps.account_gap(3, "a", 7, (None, 4), 2, '{"second": 2}')
        await cps.gap_recorded(3, "a", 7, '{"other": 0}')  # not the unrecorded one: kept
        assert (await cps.read(3)).gap == '{"first": 1}'
        await cps.gap_recorded(3, "a", 7, '{"first": 1}')
        assert await cps.read(3) == ShardCheckpoint(None, None, 4)
        await cps.commit(3, "a", 7, parse_id("100-2"), 3)
        # a detection from a stale count or checkpoint changes nothing
        for stale in [(parse_id("100-2"), 4), (None, 7), (parse_id("100-1"), 7)]:
            assert not await cps.account_gap(3, "a", 7, stale, 5, '{"stale": 1}')
        assert await cps.read(3) == ShardCheckpoint(parse_id("100-2"), None, 7)
        # IDs compare as integer pairs, not as text
        assert await cps.account_gap(3, "a", 7, (parse_id("00100-2"), 7), 5, '{"ok": 1}')
        assert await cps.read(3) == ShardCheckpoint(parse_id("100-2"), None, 12, '{"ok": 1}')


async def test_a_commit_with_a_gap_accounts_it_in_the_same_step(redis_db: str) -> None:
    keys = Keys()
    async with async_client(redis_db) as redis:
        cps = Checkpoints(redis, keys, "orders")
        await redis.hset(keys.locks("orders", OFFLOADER_GROUP), mapping={"0": "a", "0:token": 7})
        seg = Intent(parse_id("10-0"), parse_id("19-0"), 10)
        assert await cps.begin(0, "a", 7, seg)
        # 10 entries of the intent, 4 of them lost: the commit counts all 10, keeps the gap
        assert await cps.commit(0, "a", 7, seg.last, 10, gap='{"lost": 4}')
        assert await cps.read(0) == ShardCheckpoint(parse_id("19-0"), None, 10, '{"lost": 4}')
        # while it is unrecorded, another commit with a gap changes nothing
        assert await cps.begin(0, "a", 7, Intent(parse_id("20-0"), parse_id("29-0"), 10))
        before = await redis.hgetall(keys.checkpoints("orders"))
        assert not await cps.commit(0, "a", 7, parse_id("29-0"), 10, gap='{"lost": 1}')
        assert await redis.hgetall(keys.checkpoints("orders")) == before
        await cps.gap_recorded(0, "a", 7, '{"lost": 4}')
        # a commit with a gap behind the checkpoint neither counts nor keeps the gap
        await cps.commit(0, "a", 7, parse_id("29-0"), 10)
        assert await cps.commit(0, "a", 7, parse_id("19-0"), 10, gap='{"late": 1}')
        assert await cps.read(0) == ShardCheckpoint(parse_id("29-0"), None, 20)


@pytest.mark.parametrize("who", [("b", 7), ("a", 6)], ids=["other owner", "stale token"])
async def test_a_caller_without_the_lock_and_token_changes_nothing(
    redis_db: str, who: tuple[str, int]
) -> None:
    keys = Keys()
    me, token = who
    async with async_client(redis_db) as redis:
        cps = Checkpoints(redis, keys, "orders")
        await redis.hset(keys.locks("orders", OFFLOADER_GROUP), mapping={"0": "a", "0:token": 7})
        seg = Intent(parse_id("1-0"), parse_id("2-0"), 2)
        assert await cps.begin(0, "a", 7, seg)
        before = await redis.hgetall(keys.checkpoints("orders"))
        with pytest.raises(Fenced):
            await cps.begin(0, me, token, Intent(parse_id("3-0"), parse_id("4-0"), 2))
        with pytest.raises(Fenced):
            await cps.commit(0, me, token, seg.last, 2)
        with pytest.raises(Fenced):
            await cps.account_gap(0, me, token, (None, 0), 9, '{"gap": 1}')
        with pytest.raises(Fenced):
            await cps.commit(0, me, token, seg.last, 2, gap='{"gap": 1}')
        await cps.commit(0, "a", 7, seg.last, 2, gap='{"gap": 1}')
        before = await redis.hgetall(keys.checkpoints("orders"))
        with pytest.raises(Fenced):
            await cps.gap_recorded(0, me, token, '{"gap": 1}')
        assert await redis.hgetall(keys.checkpoints("orders")) == before


async def test_an_unknown_operation_is_an_error_reply(redis_db: str) -> None:
    keys = Keys()
    async with async_client(redis_db) as redis:
        cps = Checkpoints(redis, keys, "orders")
        await redis.hset(keys.locks("orders", OFFLOADER_GROUP), mapping={"0": "a", "0:token": 7})
        with pytest.raises(ResponseError, match="unknown operation rewind"):
            await cps._call(0, "a", 7, "rewind")
