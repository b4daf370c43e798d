"""The lock scripts and `LockClient` on a real redis-server and on a 3-node Redis Cluster; see
`tests/unit/lock_script_cases.py` for the cases."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as ClusterClient
from unit.lock_script_cases import LockClientCases, LockScriptCases

from eventbus.locking.scripts import Scripts
from localredis.cluster import ReplicatedCluster
from localredis.server import RedisServer

pytestmark = pytest.mark.anyio


class TestLockScriptsOnRedis(LockScriptCases):
    @pytest.fixture
    def client(self, r: redis.asyncio.Redis) -> Any:
        return r


class TestLockScriptsOnCluster(LockScriptCases):
    @pytest.fixture
    async def client(self, redis_cluster: ReplicatedCluster) -> AsyncIterator[Any]:
        client = ClusterClient.from_url(redis_cluster.url)
        await client.flushall()
        yield client
        await client.aclose()


class TestLockClientOnRedis(LockClientCases):
    @pytest.fixture
    def client(self, r: redis.asyncio.Redis) -> Any:
        return r


class TestLockClientOnCluster(LockClientCases):
    @pytest.fixture
    async def client(self, redis_cluster: ReplicatedCluster) -> AsyncIterator[Any]:
        client = ClusterClient.from_url(redis_cluster.url)
        await client.flushall()
        yield client
        await client.aclose()


# the lock selector of docs/security.md's consumer role, with and without ZRANGE
_LOCK_RULES = (
    "~eventbus:{eventbus}:members:* ~eventbus:{eventbus}:locks:* +evalsha +zadd +zcard"
    " +zrem +zremrangebyscore +zscore +hget +hset +hincrby +hdel"
)


@pytest.mark.parametrize(("zrange", "share"), [(True, 1), (False, 2)])
async def test_a_role_without_zrange_gets_the_ceiling_share_instead_of_failing(
    r: redis.asyncio.Redis, redis_db: str, zrange: bool, share: int
) -> None:
    # 3 shards, members "a" and "b": with ZRANGE b's share is floor (a, first by ID, has the
    # one left over); a role made before the script ranked members cannot ZRANGE: the script
    # falls back to every member's ceiling instead of failing the lock round with NOPERM
    await r.execute_command("SCRIPT", "FLUSH")
    rules = _LOCK_RULES + (" +zrange" if zrange else "")
    await r.execute_command(
        "ACL",
        "SETUSER",
        "locker",
        "on",
        ">pw",
        "resetkeys",
        "-@all",
        "+ping",
        "+time",
        "+script|load",
        f"({rules})",
    )
    user = redis.asyncio.Redis.from_url(redis_db, username="locker", password="pw")
    try:
        scripts = Scripts.register(user)
        assert (await LockScriptCases.lock(scripts, "a", 3, [])).locks == {}
        got = await LockScriptCases.lock(scripts, "b", 3)
        assert (got.share, len(got.locks)) == (share, share)
    finally:
        await user.aclose()
        await r.execute_command("ACL", "DELUSER", "locker")


async def _calls(r: redis.asyncio.Redis, command: str) -> int:
    return int((await r.info("commandstats")).get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture
async def private_r() -> AsyncIterator[tuple[redis.asyncio.Redis, str]]:
    """A client of a redis-server of the test's own: its ``INFO commandstats`` counts only
    what the test sends (the worker's shared server also serves what earlier tests left)."""
    with RedisServer() as server:
        client = redis.asyncio.Redis.from_url(server.url)
        yield client, server.url
        await client.aclose()


@pytest.mark.parametrize("hmget", [True, False])
async def test_lock_rounds_read_the_lock_hash_in_one_hmget_or_one_by_one_without_it(
    private_r: tuple[redis.asyncio.Redis, str], hmget: bool
) -> None:
    # a scan reads every candidate's owner, a steady round the listed shards' owners and
    # tokens: with HMGET a command per 1,000 fields instead of one per field; a role made
    # before the scripts used HMGET reads them one by one, with the same grants
    r, redis_db = private_r
    rules = _LOCK_RULES + " +zrange" + (" +hmget" if hmget else "")
    await r.execute_command(
        "ACL", "SETUSER", "locker", "on", ">pw", "resetkeys", "-@all", "+ping", "+time",
        "+script|load", f"({rules})",
    )  # fmt: skip
    user = redis.asyncio.Redis.from_url(redis_db, username="locker", password="pw")
    try:
        scripts = Scripts.register(user)
        hmgets, hgets = await _calls(r, "hmget"), await _calls(r, "hget")
        scanned = await LockScriptCases.lock(scripts, "a", 2_500)  # 3 chunks of candidates
        epoch = await LockScriptCases.epoch(r)
        _, steady = await LockScriptCases.round_at(scripts, "a", 2_500, epoch, list(range(2_500)))
        hmgets, hgets = await _calls(r, "hmget") - hmgets, await _calls(r, "hget") - hgets
    finally:
        await user.aclose()
        await r.execute_command("ACL", "DELUSER", "locker")

    assert scanned.locks == {s: (1, 1) for s in range(2_500)}
    assert steady.locks == {s: (1, 0) for s in range(2_500)}
    # HGETs besides: the epoch's n and since (2 rounds and `epoch`), the round's count of the
    # caller's locks (held:a)
    if hmget:  # the scan: 3 owners + 0 tokens (none held); the round: 3 owners + 3 tokens
        assert (hmgets, hgets) == (9, 7)
    else:
        assert hmgets == 0 and hgets == 2_500 + 2 * 2_500 + 7


async def test_a_role_without_hmget_polls_through_the_lock_round(
    private_r: tuple[redis.asyncio.Redis, str], caplog: pytest.LogCaptureFixture
) -> None:
    # a role made before HMGET was granted: the steady poll's plain HMGET is refused; the
    # member runs the lock script instead (its reads fall back to HGET) and keeps its locks
    r, redis_db = private_r
    await r.execute_command(
        "ACL", "SETUSER", "locker", "on", ">pw", "resetkeys", "-@all", "+ping", "+time",
        "+script|load", f"({_LOCK_RULES} +zrange)",
    )  # fmt: skip
    user = redis.asyncio.Redis.from_url(redis_db, username="locker", password="pw")
    try:
        a = LockClientCases.member(user, "a")
        scanned = await a.acquire(range(4))
        evalshas = await _calls(r, "evalsha")
        with caplog.at_level("WARNING", logger="eventbus.locking"):
            polled = [await a.poll(range(4)) for _ in range(2)]
        evalshas = await _calls(r, "evalsha") - evalshas
    finally:
        await user.aclose()
        await r.execute_command("ACL", "DELUSER", "locker")

    assert [p.refreshed for p in polled] == [True, True]
    assert evalshas == 2  # each poll as a lock round
    assert all(set(p.grants) == set(scanned.grants) == {0, 1, 2, 3} for p in polled)
    warned = [r.getMessage() for r in caplog.records if r.name == "eventbus.locking"]
    assert len(warned) == 1 and "grant +hmget" in warned[0]  # once, not per round


async def test_at_a_new_epoch_only_a_member_owed_shards_scans(
    private_r: tuple[redis.asyncio.Redis, str],
) -> None:
    # 2,500 shards over 10 members, 250 each; an 11th joins. a holds more than its new share
    # and owns nothing it did not list: its round reads its 250 owners and tokens (2 HMGETs)
    # instead of every shard's owner (3 HMGETs of 1,000 fields, then the tokens); the joiner,
    # owed 227, scans. The replies are what scans would give.
    r, _ = private_r
    scripts = Scripts.register(r)
    for name in "bcdefghij":
        await LockScriptCases.lock(scripts, name, 2_500, [])
    for name in "abcdefghij":
        await LockScriptCases.lock(scripts, name, 2_500)
    epoch = await LockScriptCases.epoch(r)
    a = sorted(s for s, owner in (await LockScriptCases.owners(r)).items() if owner == "a")
    assert len(a) == 250
    await LockScriptCases.lock(scripts, "z", 2_500, [])  # z joins: a new epoch

    hmgets = await _calls(r, "hmget")
    now, round_a = await LockScriptCases.round_at(scripts, "a", 2_500, epoch, a)
    hmgets_a = await _calls(r, "hmget") - hmgets
    _, round_z = await LockScriptCases.round_at(scripts, "z", 2_500, epoch, [])
    hmgets_z = await _calls(r, "hmget") - hmgets - hmgets_a

    assert now != epoch
    assert round_a.share == 228  # floor(2,500 / 11) = 227, a first by ID of the 3 left over
    assert round_a.locks == {s: (1, 0) for s in a}  # its 250, kept until it releases 22
    assert hmgets_a == 2
    assert (round_z.share, round_z.locks) == (227, {})  # every shard is held: nothing yet
    assert hmgets_z == 3  # a scan: every shard's owner
