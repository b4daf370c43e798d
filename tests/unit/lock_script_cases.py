"""The lock scripts' contract and their one client (`eventbus.locking.locks.LockClient`), as test
cases run on two backends.

`tests/unit/test_lock_scripts_fake.py` runs them on fakeredis (fast, checks the Lua logic);
`tests/integration/test_lock_scripts_redis.py` on a real redis-server and a Redis Cluster. A
subclass provides the `client` fixture (an asyncio redis client on an empty database).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from eventbus.config import Settings
from eventbus.locking.locks import Grant, LockClient, LockState
from eventbus.locking.member import Member
from eventbus.locking.scripts import Scripts
from eventbus.profiles import EVENTBUS
from eventbus.protocol.keys import Keys

KEYS = Keys()
MEMBERS = KEYS.members("orders", "billing")
LOCKS = KEYS.locks("orders", "billing")
EPOCH = KEYS.lock_epoch("orders", "billing")
LONG_TTL_MS = 60_000

# lock states in the reply of lock_shards.lua
HELD, TAKEN_FREE, TAKEN_FROM_DEAD = 0, 1, 2


@dataclass
class Reply:
    share: int
    locks: dict[int, tuple[int, int]]  # shard -> (token, state)

    @property
    def shards(self) -> set[int]:
        return set(self.locks)

    def states(self) -> set[int]:
        return {state for _, state in self.locks.values()}


async def expire_now(client: Any, consumer: str) -> None:
    """Let `consumer`'s liveness run out for real: wait until the server clock passes its
    deadline (it was registered with a TTL of a few ms)."""
    deadline = float(await client.zscore(MEMBERS, consumer))
    with anyio.fail_after(5):
        while True:
            sec, usec = await client.time()
            if sec * 1000 + usec // 1000 > deadline:
                return
            await anyio.sleep(0.002)


class LockScriptCases:
    """Test cases of lua/lock_shards.lua, lua/unlock_shards.lua and lua/heartbeat.lua."""

    @pytest.fixture
    def scripts(self, client: Any) -> Scripts:
        return Scripts.register(client)

    @staticmethod
    async def lock(
        scripts: Scripts,
        me: str,
        shard_count: int,
        candidates: list[int] | None = None,
        ttl_ms: int = LONG_TTL_MS,
    ) -> Reply:
        if candidates is None:
            candidates = list(range(shard_count))
        raw = await scripts.lock_shards(
            keys=[MEMBERS, LOCKS, EPOCH], args=[me, ttl_ms, shard_count, "", 0, "", *candidates]
        )
        locks = {}
        for shard, token, state in raw[2:]:
            assert int(shard) not in locks, f"shard {shard} reported twice"
            locks[int(shard)] = (int(token), int(state))
        return Reply(int(raw[0]), locks)

    @staticmethod
    async def unlock(scripts: Scripts, me: str, shards: list[int], leave: bool = False) -> set[int]:
        raw = await scripts.unlock_shards(
            keys=[MEMBERS, LOCKS, EPOCH], args=[me, int(leave), *shards]
        )
        return {int(s) for s in raw}

    @staticmethod
    async def owners(client: Any) -> dict[int, str]:
        raw = await client.hgetall(LOCKS)
        return {int(k): v.decode() for k, v in raw.items() if b":" not in k}

    @staticmethod
    async def expire_now(client: Any, consumer: str) -> None:
        await expire_now(client, consumer)

    # -- lock_shards -------------------------------------------------------------------------------
    @pytest.mark.anyio
    async def test_free_locks_are_taken_with_token_1(self, client: Any, scripts: Scripts) -> None:
        reply = await self.lock(scripts, "a", 4)

        assert reply.share == 4
        assert reply.locks == {s: (1, TAKEN_FREE) for s in range(4)}
        assert await self.owners(client) == {s: "a" for s in range(4)}
        assert await client.zscore(MEMBERS, "a") is not None

    @pytest.mark.anyio
    async def test_lock_held_by_live_consumer_is_not_taken(
        self, client: Any, scripts: Scripts
    ) -> None:
        await self.lock(scripts, "a", 4)
        reply = await self.lock(scripts, "b", 4)

        assert reply.share == 2  # two live consumers
        assert reply.locks == {}
        assert await self.owners(client) == {s: "a" for s in range(4)}
        assert await client.hget(LOCKS, "0:token") == b"1"

    @pytest.mark.anyio
    async def test_lock_of_dead_consumer_is_taken_with_new_token(
        self, client: Any, scripts: Scripts
    ) -> None:
        await self.lock(scripts, "a", 2, ttl_ms=5)
        await self.expire_now(client, "a")

        reply = await self.lock(scripts, "b", 2)

        assert reply.share == 2  # "a" no longer counts as live
        assert reply.locks == {0: (2, TAKEN_FROM_DEAD), 1: (2, TAKEN_FROM_DEAD)}
        assert await self.owners(client) == {0: "b", 1: "b"}
        assert await client.zscore(MEMBERS, "a") is None

    @pytest.mark.anyio
    async def test_mixed_free_dead_and_live_owners(self, client: Any, scripts: Scripts) -> None:
        await self.lock(scripts, "live", 4, [0])
        await self.lock(scripts, "dead", 4, [1], ttl_ms=5)
        await self.expire_now(client, "dead")

        reply = await self.lock(scripts, "me", 4, [0, 1, 2, 3])

        assert reply.share == 2  # "live" and "me"
        assert reply.locks == {1: (2, TAKEN_FROM_DEAD), 2: (1, TAKEN_FREE)}
        assert await self.owners(client) == {0: "live", 1: "me", 2: "me"}

    @pytest.mark.anyio
    async def test_reentrant_lock_keeps_its_token(self, client: Any, scripts: Scripts) -> None:
        first = await self.lock(scripts, "a", 4, [2, 3])
        again = await self.lock(scripts, "a", 4, [2, 3])

        assert first.locks == {2: (1, TAKEN_FREE), 3: (1, TAKEN_FREE)}
        assert again.locks == {2: (1, HELD), 3: (1, HELD)}

    @pytest.mark.anyio
    async def test_refresh_keeps_the_caller_live(self, client: Any, scripts: Scripts) -> None:
        await self.lock(scripts, "a", 1, ttl_ms=LONG_TTL_MS)
        sec, usec = await client.time()
        deadline = float(await client.zscore(MEMBERS, "a"))
        assert deadline > sec * 1000 + usec // 1000 + LONG_TTL_MS / 2

    @pytest.mark.anyio
    async def test_token_grows_on_every_change_of_owner(
        self, client: Any, scripts: Scripts
    ) -> None:
        assert (await self.lock(scripts, "a", 1)).locks == {0: (1, TAKEN_FREE)}
        assert await self.unlock(scripts, "a", [0], leave=True) == {0}
        assert (await self.lock(scripts, "b", 1, ttl_ms=5)).locks == {0: (2, TAKEN_FREE)}
        await self.expire_now(client, "b")
        assert (await self.lock(scripts, "a", 1)).locks == {0: (3, TAKEN_FROM_DEAD)}
        assert (await self.lock(scripts, "a", 1)).locks == {0: (3, HELD)}

    @pytest.mark.anyio
    @pytest.mark.parametrize(("shard_count", "live"), [(10, 3), (16, 5), (4, 4), (3, 7)])
    async def test_the_first_member_by_id_has_the_ceiling_share(
        self, client: Any, scripts: Scripts, shard_count: int, live: int
    ) -> None:
        for i in range(live - 1):  # register the others ("other0", ...: after "me") untaken
            assert (await self.lock(scripts, f"other{i}", shard_count, [])).locks == {}
        preference = list(reversed(range(shard_count)))

        reply = await self.lock(scripts, "me", shard_count, preference)

        share = math.ceil(shard_count / live)
        assert reply.share == share
        # the first `share` shards in the caller's order of preference
        assert reply.shards == set(preference[:share])

    @pytest.mark.anyio
    async def test_shares_add_up_to_every_shard(self, client: Any, scripts: Scripts) -> None:
        names = ["a", "b", "c"]
        for name in names:
            await self.lock(scripts, name, 10, [])
        got = {name: (await self.lock(scripts, name, 10)).shards for name in names}

        # floor(10 / 3) each, and the one left over to the first member by consumer ID
        assert [len(got[n]) for n in names] == [4, 3, 3]
        assert set().union(*got.values()) == set(range(10))

    @pytest.mark.anyio
    async def test_the_extra_shards_go_to_the_first_members_by_consumer_id(
        self, client: Any, scripts: Scripts
    ) -> None:
        for name in ["c", "a", "d", "b"]:  # joined in another order than their IDs'
            await self.lock(scripts, name, 6, [])
        shares = {name: (await self.lock(scripts, name, 6, [])).share for name in "abcd"}
        assert shares == {"a": 2, "b": 2, "c": 1, "d": 1}

    @pytest.mark.anyio
    async def test_a_member_that_joins_is_owed_shards_when_the_ceiling_share_stays(
        self, client: Any, scripts: Scripts
    ) -> None:
        # 5 shards over a, b, c: 2, 2, 1. With d, ceil(5 / 4) is still 2, but the shares are
        # 2, 1, 1, 1: b gives one up (once drained, as a consumer does) and d takes it
        for name in "abc":
            await self.lock(scripts, name, 5, [])
        held = {name: (await self.lock(scripts, name, 5)).shards for name in "abc"}
        assert [len(held[n]) for n in "abc"] == [2, 2, 1]

        joined = await self.lock(scripts, "d", 5)
        assert (joined.share, joined.locks) == (1, {})  # every shard is held
        b = await self.lock(scripts, "b", 5)
        assert b.share == 1 and b.shards == held["b"]  # held above the share until released
        surplus = sorted(held["b"])[0]
        assert await self.unlock(scripts, "b", [surplus]) == {surplus}

        got = await self.lock(scripts, "d", 5)
        assert got.shards == {surplus}
        assert (await self.lock(scripts, "b", 5)).shards == held["b"] - {surplus}

    @pytest.mark.anyio
    async def test_locks_above_the_share_are_kept(self, client: Any, scripts: Scripts) -> None:
        await self.lock(scripts, "a", 4)
        await self.lock(scripts, "b", 4, [])

        reply = await self.lock(scripts, "a", 4)

        assert reply.share == 2
        assert reply.locks == {s: (1, HELD) for s in range(4)}

    @pytest.mark.anyio
    async def test_more_than_32_shards(self, client: Any, scripts: Scripts) -> None:
        reply = await self.lock(scripts, "a", 64)
        assert reply.share == 64
        assert reply.shards == set(range(64))
        assert reply.states() == {TAKEN_FREE}

        # a second consumer joins: "a" releases the upper half, "b" takes exactly that
        assert await self.unlock(scripts, "a", list(range(32, 64))) == set(range(32, 64))
        reply_b = await self.lock(scripts, "b", 64)
        assert reply_b.share == 32
        assert reply_b.locks == {s: (2, TAKEN_FREE) for s in range(32, 64)}
        owners = await self.owners(client)
        assert {s for s, o in owners.items() if o == "a"} == set(range(32))
        assert {s for s, o in owners.items() if o == "b"} == set(range(32, 64))

    # -- the epoch: a round at an unchanged epoch reads only the held shards ---------------------
    @staticmethod
    async def epoch(client: Any, behind: int = 0) -> str:
        """The group's epoch (``<since>:<n>``), or the one `behind` changes before it."""
        since, n = await client.hget(EPOCH, "since"), await client.hget(EPOCH, "n")
        return f"{since.decode()}:{int(n) - behind}"

    @staticmethod
    async def round_at(
        scripts: Scripts, me: str, shard_count: int, epoch: str, held: list[int]
    ) -> tuple[str, Reply]:
        """A lock round that says the caller scanned every shard at `epoch` and holds `held`
        (candidates: every shard from 0, the compact form): the group's epoch and the reply."""
        raw = await scripts.lock_shards(
            keys=[MEMBERS, LOCKS, EPOCH],
            args=[me, LONG_TTL_MS, shard_count, epoch, len(held), *held, 0],
        )
        locks = {int(s): (int(token), int(state)) for s, token, state in raw[2:]}
        return raw[1].decode(), Reply(int(raw[0]), locks)

    @pytest.mark.anyio
    async def test_joins_drops_releases_and_leaves_advance_the_epoch(
        self, client: Any, scripts: Scripts
    ) -> None:
        async def epoch() -> int:
            return int(await client.hget(EPOCH, "n") or 0)

        await self.lock(scripts, "a", 4, candidates=[0, 1])  # a joins
        assert await epoch() == 1
        await self.lock(scripts, "b", 4)  # b joins
        await self.lock(scripts, "b", 4)  # b's refresh: nothing changed
        assert await epoch() == 2
        await self.lock(scripts, "c", 4, candidates=[], ttl_ms=5)  # c joins
        assert await epoch() == 3
        await self.expire_now(client, "c")
        await self.lock(scripts, "b", 4)  # c is dropped
        assert await epoch() == 4
        assert await self.unlock(scripts, "b", [2]) == {2}  # a lock released
        assert await epoch() == 5
        assert await self.unlock(scripts, "b", [2]) == set()  # nothing released: no change
        assert await epoch() == 5
        await self.unlock(scripts, "b", [], leave=True)  # b leaves
        assert await epoch() == 6

    @pytest.mark.anyio
    async def test_an_epoch_from_before_the_data_was_lost_is_never_current(
        self, client: Any, scripts: Scripts
    ) -> None:
        """The counter starts again after a FLUSHALL; the epoch's era (the server time its key
        was made) does not, so a member's epoch from before cannot match by chance and make it
        skip the scan (it would report locks it no longer holds... were they not checked)."""
        await self.lock(scripts, "a", 4, candidates=[0, 1])
        before = await self.epoch(client)
        await client.delete(MEMBERS, LOCKS, EPOCH)
        with anyio.fail_after(5):  # past the millisecond the first era began
            while True:
                sec, usec = await client.time()
                if sec * 1000 + usec // 1000 > int(before.split(":")[0]):
                    break
                await anyio.sleep(0.001)

        now, reply = await self.round_at(scripts, "a", 4, before, [0, 1])

        assert now != before and now.endswith(":1")  # a new era, the counter at 1 again
        assert reply.shards == {0, 1, 2, 3}  # scanned: every free lock taken again (state 1)
        assert reply.states() == {TAKEN_FREE}

    @pytest.mark.anyio
    async def test_a_start_shard_stands_for_every_shard_in_order_from_it(
        self, client: Any, scripts: Scripts
    ) -> None:
        await self.lock(scripts, "other", 4, candidates=[])  # share 2

        raw = await scripts.lock_shards(
            keys=[MEMBERS, LOCKS, EPOCH], args=["me", LONG_TTL_MS, 4, "", 0, 3]
        )

        assert [int(s) for s, _, _ in raw[2:]] == [3, 0]

    @pytest.mark.anyio
    async def test_at_the_current_epoch_only_the_listed_shards_are_read(
        self, client: Any, scripts: Scripts
    ) -> None:
        """The steady round is O(held): nothing else is read, so nothing else is taken, even
        a free lock (which cannot exist at an unchanged epoch unless the caller lies)."""
        await self.lock(scripts, "a", 4, candidates=[0, 1])

        _, reply = await self.round_at(scripts, "a", 4, await self.epoch(client), [1, 0])

        assert reply.locks == {1: (1, HELD), 0: (1, HELD)}  # 2, 3 free: not taken
        assert await self.owners(client) == {0: "a", 1: "a"}

    @pytest.mark.anyio
    async def test_at_the_current_epoch_a_member_owning_a_lock_it_did_not_list_scans(
        self, client: Any, scripts: Scripts
    ) -> None:
        # a released 1, then a failover to a replica that lacked the release rolled back the
        # owner, a's count and the epoch together: a's epoch is current again and its list
        # lacks 1. The count of what it owns says so: the round scans and reports 1 (the
        # offloader and roles without HMGET only ever send this round, never a poll)
        await self.lock(scripts, "a", 4)
        epoch = await self.epoch(client)

        now, reply = await self.round_at(scripts, "a", 4, epoch, [0, 2, 3])

        assert now == epoch
        assert reply.share == 4 and reply.locks == {s: (1, HELD) for s in range(4)}
        assert await self.owned(client) == {"a": 4}

    @pytest.mark.anyio
    async def test_candidates_are_each_taken_once_and_must_be_shards_of_the_topic(
        self, client: Any, scripts: Scripts
    ) -> None:
        # a repeated candidate is one candidate: its lock taken once, its token grown once and
        # the counts of locks exact; a candidate that is not a shard's decimal form would name
        # a foreign field of the lock hash: an error, nothing taken
        reply = await self.lock(scripts, "a", 4, candidates=[1, 1, 2])
        assert reply.locks == {1: (1, TAKEN_FREE), 2: (1, TAKEN_FREE)}
        assert await self.owned(client) == {"a": 2}
        for bad in ("03", "1.0", " 1", "0x1", "4", "-1"):
            with pytest.raises(Exception, match="is not a shard of 0..3"):
                await scripts.lock_shards(
                    keys=[MEMBERS, LOCKS, EPOCH], args=["a", LONG_TTL_MS, 4, "", 0, "", bad]
                )
        assert await self.owners(client) == {1: "a", 2: "a"}
        assert await self.owned(client) == {"a": 2}

    @pytest.mark.anyio
    async def test_a_wrong_epoch_or_held_list_never_grants_another_members_lock(
        self, client: Any, scripts: Scripts
    ) -> None:
        await self.lock(scripts, "b", 4, candidates=[2, 3])
        await self.lock(scripts, "a", 4, candidates=[0])
        epoch = await self.epoch(client)

        now, listed = await self.round_at(scripts, "a", 4, epoch, [0, 2, 3])
        also_now, scanned = await self.round_at(
            scripts, "a", 4, await self.epoch(client, behind=1), [2, 3]
        )

        assert now == also_now == epoch
        assert listed.locks == {0: (1, HELD)}  # b's locks listed as a's: left out
        assert scanned.shards == {0, 1} and scanned.share == 2  # a scan: the free lock 1 taken
        assert await self.owners(client) == {0: "a", 1: "a", 2: "b", 3: "b"}

    @staticmethod
    async def owned(client: Any) -> dict[str, int]:
        """The epoch hash's count of locks owned per member (``held:<member>``)."""
        raw = await client.hgetall(EPOCH)
        return {
            k.decode().removeprefix("held:"): int(v)
            for k, v in raw.items()
            if k.startswith(b"held:")
        }

    @pytest.mark.anyio
    async def test_the_epoch_hash_counts_the_locks_each_member_owns(
        self, client: Any, scripts: Scripts
    ) -> None:
        # kept by every change of owner (takes, takes from the dead, releases) and set by a
        # scan of every shard; a member owning none has no field
        await self.lock(scripts, "a", 4, candidates=[0, 1, 2])
        await self.lock(scripts, "b", 4, candidates=[3], ttl_ms=5)
        assert await self.owned(client) == {"a": 3, "b": 1}
        assert await self.unlock(scripts, "a", [2]) == {2}
        assert await self.owned(client) == {"a": 2, "b": 1}
        await self.expire_now(client, "b")

        reply = await self.lock(scripts, "a", 4, candidates=[3, 2])  # not every shard

        assert reply.locks == {3: (2, TAKEN_FROM_DEAD), 2: (2, TAKEN_FREE)}  # (0, 1 unlisted)
        assert await self.owned(client) == {"a": 4}
        await client.hset(EPOCH, "held:a", 9)  # (a wrong count, set right by a scan)
        await self.lock(scripts, "a", 4)
        assert await self.owned(client) == {"a": 4}
        assert await self.unlock(scripts, "a", [0, 1, 2, 3], leave=True) == {0, 1, 2, 3}
        assert await self.owned(client) == {}

    @pytest.mark.anyio
    async def test_at_a_new_epoch_a_member_owning_a_lock_it_did_not_list_scans(
        self, client: Any, scripts: Scripts
    ) -> None:
        # a holds its share and lists only part of it (its release of 1 was lost with a
        # failover, say): the count of what it owns says so, and the round reports 1 again
        await self.lock(scripts, "a", 4)
        epoch = await self.epoch(client)
        await self.lock(scripts, "b", 4, [])  # b joins: a's share is 2

        _, reply = await self.round_at(scripts, "a", 4, epoch, [0, 2, 3])
        _, twice = await self.round_at(scripts, "a", 4, epoch, [0, 0, 2, 3])  # (4 listed)

        assert reply.share == 2 and reply.locks == {s: (1, HELD) for s in range(4)}
        assert twice.locks == reply.locks

    # -- unlock_shards -----------------------------------------------------------------------------
    @pytest.mark.anyio
    async def test_unlock_releases_only_the_callers_locks(
        self, client: Any, scripts: Scripts
    ) -> None:
        await self.lock(scripts, "a", 4, [0, 1])
        await self.lock(scripts, "b", 4, [2])

        assert await self.unlock(scripts, "b", [0, 1, 2, 3]) == {2}
        assert await self.owners(client) == {0: "a", 1: "a"}
        assert await self.unlock(scripts, "a", [1]) == {1}
        assert await self.owners(client) == {0: "a"}
        # tokens are kept, so the next owner's token is larger
        assert await client.hget(LOCKS, "1:token") == b"1"
        # neither call removed anyone from the live members
        assert await client.zscore(MEMBERS, "a") is not None
        assert await client.zscore(MEMBERS, "b") is not None

    @pytest.mark.anyio
    async def test_unlock_with_leave_removes_the_member(
        self, client: Any, scripts: Scripts
    ) -> None:
        await self.lock(scripts, "a", 4, [0])
        await self.lock(scripts, "b", 4, [])

        assert await self.unlock(scripts, "a", [0], leave=True) == {0}

        assert await client.zscore(MEMBERS, "a") is None
        # "b" is alone now: its share is every shard
        reply = await self.lock(scripts, "b", 4)
        assert reply.share == 4
        assert reply.locks == {0: (2, TAKEN_FREE)} | {s: (1, TAKEN_FREE) for s in (1, 2, 3)}

    # -- heartbeat ---------------------------------------------------------------------------------
    @pytest.mark.anyio
    async def test_heartbeat_reports_whether_the_caller_was_live(
        self, client: Any, scripts: Scripts
    ) -> None:
        hb = scripts.heartbeat
        assert await hb(keys=[MEMBERS], args=["a", 5]) == 0  # never seen: not made a member
        assert await client.zscore(MEMBERS, "a") is None
        await self.lock(scripts, "a", 1, ttl_ms=LONG_TTL_MS)  # joins
        assert await hb(keys=[MEMBERS], args=["a", 5]) == 1  # live
        await self.expire_now(client, "a")
        assert await hb(keys=[MEMBERS], args=["a", LONG_TTL_MS]) == 0  # had expired

    @pytest.mark.anyio
    async def test_heartbeat_does_not_revive_an_expired_member(
        self, client: Any, scripts: Scripts
    ) -> None:
        """Only a lock round, whose reply says which locks are still held, makes a member live
        again: otherwise a heartbeat whose 0 was lost with its connection would make the next
        one answer 1 although the member's locks were taken meanwhile."""
        hb = scripts.heartbeat
        await self.lock(scripts, "a", 1, ttl_ms=5)
        await self.expire_now(client, "a")

        assert await hb(keys=[MEMBERS], args=["a", LONG_TTL_MS]) == 0
        assert await hb(keys=[MEMBERS], args=["a", LONG_TTL_MS]) == 0  # still lapsed
        assert (await self.lock(scripts, "b", 1)).locks == {0: (2, TAKEN_FROM_DEAD)}
        assert (await self.lock(scripts, "a", 1)).locks == {}  # live again, the lock is b's
        assert await hb(keys=[MEMBERS], args=["a", LONG_TTL_MS]) == 1

    @pytest.mark.anyio
    async def test_heartbeat_extends_a_live_deadline(self, client: Any, scripts: Scripts) -> None:
        await self.lock(scripts, "a", 1, ttl_ms=LONG_TTL_MS)
        before = float(await client.zscore(MEMBERS, "a"))
        assert await scripts.heartbeat(keys=[MEMBERS], args=["a", 2 * LONG_TTL_MS]) == 1
        assert float(await client.zscore(MEMBERS, "a")) >= before + LONG_TTL_MS

    # -- script cache ------------------------------------------------------------------------------
    @pytest.mark.anyio
    async def test_calls_work_after_script_flush(self, client: Any, scripts: Scripts) -> None:
        assert (await self.lock(scripts, "a", 2)).shards == {0, 1}
        await client.script_flush()
        assert not any(await client.script_exists(scripts.lock_shards.sha))

        assert (await self.lock(scripts, "a", 2)).locks == {0: (1, HELD), 1: (1, HELD)}
        assert await self.unlock(scripts, "a", [0, 1], leave=True) == {0, 1}
        assert await scripts.heartbeat(keys=[MEMBERS], args=["a", 1000]) == 0


class LockClientCases:
    """Test cases of `eventbus.locking.locks.LockClient`: the scripts' replies as typed values."""

    @staticmethod
    def member(
        client: Any,
        name: str,
        shards: int = 4,
        ttl_s: float = 60.0,
        scripts: Scripts | None = None,
        full_rounds: float = 0.0,
    ) -> LockClient:
        # below Settings' floor (0.3 s) on purpose: a member that expires at once
        settings = Settings.model_construct(liveness_ttl_s=ttl_s)
        member = Member(client, KEYS, settings, "orders", "billing", name, EVENTBUS)
        return LockClient(member, shards=shards, scripts=scripts, full_rounds=full_rounds)

    @staticmethod
    def counted(client: Any, calls: list[str]) -> Scripts:
        """The lock scripts, each ``lock_shards`` call appended to `calls`."""
        real = Scripts.register(client)

        async def lock_shards(*, keys: Any, args: Any) -> Any:
            calls.append("lock_shards")
            return await real.lock_shards(keys=keys, args=args)

        return Scripts(lock_shards, real.unlock_shards, real.heartbeat)

    async def settled(self, client: Any, calls: list[str]) -> tuple[LockClient, LockClient]:
        """Members a and b of a 4-shard group, two shards each, a's last round a scan at the
        current epoch; `calls` counts a's script calls from then on."""
        a = self.member(client, "a", scripts=self.counted(client, calls))
        b = self.member(client, "b")
        await a.acquire(range(4))
        await b.acquire(range(4))  # b joins: a scans and lets two go
        await a.release(sorted((await a.acquire(range(4))).grants)[2:])
        await b.acquire(range(4))  # b takes them (the release changed the epoch)
        assert set((await a.acquire(range(4))).grants) == {0, 1}  # a's scan at that epoch
        calls.clear()
        return a, b

    @pytest.mark.anyio
    async def test_grants_are_typed_with_share_and_send_time(self, client: Any) -> None:
        a = self.member(client, "a")
        before = time.monotonic()

        got = await a.acquire([0, 1])

        assert got.share == 4
        assert got.grants == {s: Grant(s, 1, LockState.TAKEN_FREE) for s in (0, 1)}
        assert all(type(g.shard) is int and type(g.token) is int for g in got.grants.values())
        assert before <= got.sent_at <= time.monotonic()

    @pytest.mark.anyio
    async def test_a_member_is_owed_while_it_holds_less_than_its_share(self, client: Any) -> None:
        a, b = self.member(client, "a"), self.member(client, "b")
        await a.acquire(range(4))
        assert not a.owed

        await b.acquire(range(4))  # a holds every shard: b's share 2, nothing to take
        assert b.owed
        got = await a.acquire(range(4))
        assert (got.share, len(got.grants), a.owed) == (2, 4, False)  # above its share
        await a.release([2, 3])
        assert set((await b.acquire(range(4))).grants) == {2, 3}
        assert not b.owed

    @pytest.mark.anyio
    async def test_is_new_per_state(self, client: Any) -> None:
        dead = self.member(client, "dead", ttl_s=0.005)
        me = self.member(client, "me")
        await dead.acquire([0])
        await expire_now(client, "dead")

        first = await me.acquire([0, 1])
        again = await me.acquire([0, 1])

        assert first.grants == {
            0: Grant(0, 2, LockState.TAKEN_FROM_DEAD),
            1: Grant(1, 1, LockState.TAKEN_FREE),
        }
        assert [g.is_new for g in first.grants.values()] == [True, True]
        assert again.grants == {0: Grant(0, 2, LockState.HELD), 1: Grant(1, 1, LockState.HELD)}
        assert not any(g.is_new for g in again.grants.values())

    @pytest.mark.anyio
    async def test_a_round_at_an_unchanged_epoch_keeps_the_share_of_the_last_scan(
        self, client: Any
    ) -> None:
        # the script answers -1 for the share when it did not scan; the client keeps its own
        a, b = self.member(client, "a", shards=5), self.member(client, "b", shards=5)
        assert (await a.acquire(range(5))).share == 5
        assert (await b.acquire(range(5))).share == 2  # a joined before: floor 2, the extra a's
        again = await a.acquire(range(5))  # (b's join: a scan)
        assert again.share == 3 and set(again.grants) == set(range(5))
        assert a._epoch  # so the next round is sent at the current epoch, and not scanned
        steady = await a.acquire(range(5))
        assert steady.share == 3 and set(steady.grants) == set(range(5))

    @pytest.mark.anyio
    async def test_fair_share_follows_the_candidates_order(self, client: Any) -> None:
        await self.member(client, "other").acquire([])
        me = self.member(client, "me")

        got = await me.acquire([3, 1, 0, 2])

        assert got.share == 2
        assert set(got.grants) == {3, 1}

    @pytest.mark.anyio
    async def test_release_returns_only_the_callers_shards(self, client: Any) -> None:
        a, b = self.member(client, "a"), self.member(client, "b")
        await a.acquire([0, 1])
        await b.acquire([2])

        assert await b.release([0, 1, 2, 3]) == [2]
        assert sorted(await a.release([1, 2])) == [1]
        assert await a.release([]) == []
        # still live: neither left
        assert (await a.acquire([])).share == 2

    @pytest.mark.anyio
    async def test_release_with_leave_gives_the_others_the_whole_share(self, client: Any) -> None:
        a, b = self.member(client, "a"), self.member(client, "b")
        await a.acquire([0, 1])
        assert (await b.acquire([])).share == 2

        assert sorted(await a.release([0, 1], leave=True)) == [0, 1]

        got = await b.acquire([0, 1, 2, 3])
        assert got.share == 4
        assert got.grants[0] == Grant(0, 2, LockState.TAKEN_FREE)  # the token only grows
        assert set(got.grants) == {0, 1, 2, 3}

    @pytest.mark.anyio
    async def test_heartbeat_after_expiry_reports_false_until_the_next_lock_round(
        self, client: Any
    ) -> None:
        a = self.member(client, "a", ttl_s=0.005)
        await a.acquire([0])
        await expire_now(client, "a")

        assert await a.heartbeat() is False  # its locks may be someone else's now
        b = self.member(client, "b")
        assert (await b.acquire([0])).grants == {0: Grant(0, 2, LockState.TAKEN_FROM_DEAD)}

        live = self.member(client, "a")  # same member ID, a long TTL
        assert await live.heartbeat() is False  # a heartbeat does not make it live again
        assert (await live.acquire([0])).grants == {}  # a lock round does; the lock stays b's
        assert await live.heartbeat() is True

    @pytest.mark.anyio
    async def test_acquiring_while_a_lock_round_is_in_flight(self, client: Any) -> None:
        real = Scripts.register(client)
        seen: list[bool] = []

        async def lock_shards(*, keys: Any, args: Any) -> Any:
            reply = await real.lock_shards(keys=keys, args=args)  # run, reply not returned yet
            seen.append(a.acquiring)
            if len(seen) == 2:
                raise ConnectionError("reply lost")
            return reply

        settings = Settings.model_construct(liveness_ttl_s=60.0)
        member = Member(client, KEYS, settings, "orders", "billing", "a", EVENTBUS)
        scripts = Scripts(lock_shards, real.unlock_shards, real.heartbeat)
        a = LockClient(member, shards=4, scripts=scripts)

        assert not a.acquiring
        await a.acquire([0])
        with pytest.raises(ConnectionError):
            await a.acquire([0])
        assert seen == [True, True] and not a.acquiring

    @pytest.mark.anyio
    async def test_locks_released_by_another_member_are_taken_at_the_next_round(
        self, client: Any
    ) -> None:
        """Each member's rounds read only its own shards while nothing changes (the epoch);
        a release changes the epoch, so the next round scans and takes what was freed."""
        a, b = self.member(client, "a"), self.member(client, "b")
        await a.acquire(range(4))
        await b.acquire(range(4))  # b joins: share 2, a holds all four
        assert sorted(await a.release([2, 3])) == [2, 3]
        assert set((await b.acquire(range(4))).grants) == {2, 3}
        assert set((await a.acquire(range(4))).grants) == {0, 1}  # steady: its own two

        assert sorted(await b.release([2, 3], leave=True)) == [2, 3]
        got = await a.acquire(range(4))

        assert got.share == 4 and set(got.grants) == {0, 1, 2, 3}
        assert got.grants[2] == Grant(2, 3, LockState.TAKEN_FREE)  # a, b, then a again

    @pytest.mark.anyio
    async def test_locks_of_a_member_whose_liveness_expired_are_taken_at_the_next_round(
        self, client: Any
    ) -> None:
        a, dead = self.member(client, "a"), self.member(client, "dead")
        await dead.acquire(range(4))
        await a.acquire(range(4))  # share 2; dead holds all four
        assert (await a.acquire(range(4))).grants == {}  # steady, nothing to take
        await client.zadd(MEMBERS, {"dead": 0})  # its deadline passed (as its TTL running out)

        got = await a.acquire(range(4))

        assert got.share == 4
        assert {s: g.state for s, g in got.grants.items()} == dict.fromkeys(
            range(4), LockState.TAKEN_FROM_DEAD
        )

    # -- the steady round (poll) ---------------------------------------------------------------
    @pytest.mark.anyio
    async def test_a_poll_at_an_unchanged_epoch_checks_the_held_locks_without_the_script(
        self, client: Any
    ) -> None:
        calls: list[str] = []
        a, _ = await self.settled(client, calls)
        deadline = await client.zscore(MEMBERS, "a")
        before = time.monotonic()

        got = await a.poll(range(4))

        assert calls == []  # two plain reads, no script
        assert got.share == 2 and not got.refreshed and before <= got.sent_at
        assert got.grants == {0: Grant(0, 1, LockState.HELD), 1: Grant(1, 1, LockState.HELD)}
        assert await client.zscore(MEMBERS, "a") == deadline  # liveness left to the heartbeat

    @pytest.mark.anyio
    async def test_a_poll_runs_the_lock_round_when_a_member_joined(self, client: Any) -> None:
        calls: list[str] = []
        a, _ = await self.settled(client, calls)
        await self.member(client, "c").acquire([])  # c joins: the epoch changes

        got = await a.poll(range(4))

        assert calls == ["lock_shards"] and got.refreshed
        assert got.share == 2  # 4 shards, 3 members: a is first by ID, one more than floor 1
        assert set(got.grants) == {0, 1}

    @pytest.mark.anyio
    async def test_a_poll_drops_a_lock_that_changed_owner_at_the_same_epoch(
        self, client: Any
    ) -> None:
        # a failover to a replica that lost writes brings epoch numbers back: the epoch matches,
        # yet shard 1 is b's there. The poll must not answer that a still holds it.
        calls: list[str] = []
        a, _ = await self.settled(client, calls)
        await client.hset(LOCKS, mapping={"1": "b", "1:token": 2})

        got = await a.poll(range(4))

        assert calls == ["lock_shards"] and got.refreshed
        assert got.grants == {0: Grant(0, 1, LockState.HELD)}

    @pytest.mark.anyio
    async def test_a_lock_lost_at_the_same_epoch_is_taken_again_by_that_poll(
        self, client: Any
    ) -> None:
        # the owner field gone (a replica that lost the take, an eviction) while the epoch
        # stayed: a scan finds the shard free; a round at the known epoch would read only the
        # held shards and leave it unowned until the membership changed
        calls: list[str] = []
        a, _ = await self.settled(client, calls)
        await client.hdel(LOCKS, "1")

        got = await a.poll(range(4))

        assert calls == ["lock_shards"] and got.refreshed
        assert {s: g.state for s, g in got.grants.items()} == {
            0: LockState.HELD,
            1: LockState.TAKEN_FREE,
        }
        assert await client.hget(LOCKS, "1") in ("a", b"a")

    @pytest.mark.anyio
    async def test_a_lock_owned_but_not_known_at_the_same_epoch_is_found_by_that_poll(
        self, client: Any
    ) -> None:
        # a released shard 1, then a failover to a replica that lacked the release: the lock is
        # a's again there, with the epoch and a's count of locks from before; a's table lacks
        # it, and the owner and token checks of what it holds all pass. The count differs from
        # what a holds, so the poll scans: a reads 1 again (or releases it), not nobody
        calls: list[str] = []
        a, _ = await self.settled(client, calls)
        before = await client.hgetall(EPOCH)
        assert await a.release([1]) == [1]
        await client.hset(LOCKS, "1", "a")
        await client.hset(EPOCH, mapping=before)

        got = await a.poll(range(4))

        assert calls == ["lock_shards"] and got.refreshed
        assert got.grants == {0: Grant(0, 1, LockState.HELD), 1: Grant(1, 1, LockState.HELD)}

    @pytest.mark.parametrize("shards", [1, 2])
    @pytest.mark.anyio
    async def test_a_dead_holder_is_dropped_by_the_random_rounds_of_a_member_owed_its_shards(
        self, client: Any, shards: int
    ) -> None:
        # a (first by consumer ID) joins while b holds every shard; b dies before it lets go.
        # With one shard a's fair share is that shard, as if it were alone: only a lock round
        # (the script) drops b, so a's polls must still make them.
        calls: list[str] = []
        b = self.member(client, "b", shards=shards)
        await b.acquire(range(shards))
        a = self.member(
            client, "a", shards=shards, scripts=self.counted(client, calls), full_rounds=4.0
        )
        assert (await a.acquire(range(shards))).grants == {}  # b is live: nothing to take
        await client.zadd(MEMBERS, {"b": 0})  # its deadline passed (SIGKILL, TTL ran out)

        rounds = [await a.poll(range(shards)) for _ in range(8)]

        taken = {s for r in rounds for s, g in r.grants.items()}
        assert taken == set(range(shards)) and len(calls) >= 2

    @pytest.mark.anyio
    async def test_a_poll_reports_a_new_fencing_token_of_a_held_lock(self, client: Any) -> None:
        calls: list[str] = []
        a, _ = await self.settled(client, calls)
        await client.hset(LOCKS, "0:token", 7)  # a's lock, retaken under another token

        got = await a.poll(range(4))

        assert calls == ["lock_shards"]
        assert got.grants[0] == Grant(0, 7, LockState.HELD)

    @pytest.mark.anyio
    async def test_a_poll_runs_the_lock_round_at_the_full_round_odds(self, client: Any) -> None:
        # odds full_rounds * share / shards: 4 * 2 / 4 here, so every poll is a lock round
        calls: list[str] = []
        a = self.member(client, "a", scripts=self.counted(client, calls), full_rounds=4.0)
        await a.acquire(range(4))
        await self.member(client, "b").acquire([])  # b joins: a's share is 2
        assert (await a.acquire(range(4))).share == 2

        got = await a.poll(range(4))

        assert calls == ["lock_shards"] * 3 and got.refreshed

    @pytest.mark.anyio
    async def test_a_member_alone_polls_without_full_rounds(self, client: Any) -> None:
        # every shard its share: it was alone, nobody to drop; one that joins changes the epoch
        calls: list[str] = []
        a = self.member(client, "a", scripts=self.counted(client, calls), full_rounds=4.0)
        await a.acquire(range(4))

        polled = [await a.poll(range(4)) for _ in range(3)]
        await self.member(client, "b").acquire([])
        joined = await a.poll(range(4))

        assert [p.refreshed for p in polled] == [False] * 3 and joined.refreshed
        assert calls == ["lock_shards", "lock_shards"] and joined.share == 2

    @pytest.mark.anyio
    async def test_a_poll_without_a_scan_at_the_current_epoch_runs_the_lock_round(
        self, client: Any
    ) -> None:
        calls: list[str] = []
        a, _ = await self.settled(client, calls)
        await a.acquire([0, 1])  # not every shard: no scan, the epoch is not known

        assert (await a.poll(range(4))).refreshed  # so the next poll runs the script
        assert not (await a.poll(range(4))).refreshed
        assert calls == ["lock_shards", "lock_shards"]
