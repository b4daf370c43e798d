"""The lock client of the Verse profile: shard locks under Verse's own lock keys.

Verse's consumers (verse-redis ``Subscriber::Stream``) lock a shard by setting
``{VERSE:STREAM:SHARDLOCK}:<channel>:<shard>:<group>`` to their service ID when the key is absent
or its owner's liveness key ``{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:<owner>`` is gone; they
keep their liveness key alive (``EX 30`` every 15 s) and release every lock at the end of each
read iteration. `VerseLockClient` takes and keeps locks by the same rule, with the interface of
`eventbus.locking.locks.LockClient` (`acquire` -> `LockRound`, `release`, `heartbeat`), so a
consumer of the Verse profile excludes, and is excluded by, Verse's consumers of the same group.

What Verse lacks, eventbus keeps beside its keys (under the same hashtag; Verse never reads
them): the live eventbus members of a group, for the fair share among eventbus consumers, and a
fencing token per shard, incremented whenever an eventbus consumer takes the lock. Verse's
consumers are not fenced: docs/verse.md says what follows for a mixed fleet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from eventbus.locking.locks import LockRound
from eventbus.locking.scripts import Scripts

if TYPE_CHECKING:
    from eventbus.protocol.verse.keys import VerseKeys

VERSE_LOCK_TTL_S = 3200
"""The TTL Verse gives its lock keys (seconds); eventbus sets its own the same, and renews it."""


class VerseLockClient:
    """Shard locks of one consumer (`member_id`) of `group` on Verse channel `channel`.

    :param redis: the client (`redis.asyncio.Redis` or `RedisCluster`: every key shares Verse's
        hashtag, so each script runs on one node)
    :param keys: the profile's key builder
    :param shards: the topic's shard count (Verse's ``partitions``)
    :param liveness_ttl_s: seconds the member counts as live after a refresh, for eventbus's
        members and Verse's liveness key alike (Verse's own consumers use 30)
    """

    def __init__(
        self,
        redis: Any,
        *,
        keys: VerseKeys,
        channel: str,
        group: str,
        member_id: str,
        shards: int,
        liveness_ttl_s: float,
        scripts: Scripts | None = None,
    ) -> None:
        self.fences_writes = False  # Verse's lock keys, not eventbus's lock hash
        self.member_id = member_id
        self.shards = shards
        self._ttl_ms = int(liveness_ttl_s * 1000)
        self._scripts = scripts or Scripts.register(redis, prefix="verse_")
        self._liveness = keys.liveness(member_id)
        self._members = keys.members(channel, group)
        self._tokens = keys.tokens(channel, group)
        self._locks = [keys.lock(channel, s, group) for s in range(shards)]
        self._acquiring = 0

    @property
    def acquiring(self) -> bool:
        """Whether an `acquire` is awaiting its reply (as `LockClient.acquiring`)."""
        return self._acquiring > 0

    async def acquire(self, candidates: Sequence[int]) -> LockRound:
        """Refresh liveness and take free locks, or locks whose owner has no liveness key,
        among `candidates` (in order of preference) up to the fair share among eventbus
        consumers; report every lock held after the call (token: eventbus's fencing token),
        and the candidates whose lock key is of another type (`LockRound.unusable`: key and
        error; the others are taken as usual). Raises what the Redis client raises."""
        sent_at = time.monotonic()
        self._acquiring += 1
        try:
            reply = await self._scripts.lock_shards(
                keys=[
                    self._liveness,
                    self._members,
                    self._tokens,
                    *(self._locks[s] for s in candidates),
                ],
                args=[self.member_id, self._ttl_ms, VERSE_LOCK_TTL_S, self.shards, *candidates],
            )
        finally:
            self._acquiring -= 1
        got = LockRound.parse(reply, sent_at)
        for s, why in got.unusable.items():  # name the key: it is the operator's to repair
            got.unusable[s] = f"{self._locks[s]}: {why}"
        return got

    async def poll(self, candidates: Sequence[int]) -> LockRound:
        """`acquire` (Verse's lock keys have no epoch to poll: every round runs the script)."""
        return await self.acquire(candidates)

    async def release(self, shards: Iterable[int], *, leave: bool = False) -> list[int]:
        """Release the locks of `shards` this member holds (others' are left alone); with
        `leave`, also drop out of the members and delete the liveness key. Returns the shards
        released."""
        shards = list(shards)
        released = await self._scripts.unlock_shards(
            keys=[self._liveness, self._members, *(self._locks[s] for s in shards)],
            args=[self.member_id, int(leave), *shards],
        )
        return [int(s) for s in released]

    async def heartbeat(self) -> bool:
        """Refresh liveness (and the TTL of the locks held) if the member is still live; False
        means its liveness had lapsed and its locks may be others' now (as
        `LockClient.heartbeat`)."""
        return bool(
            await self._scripts.heartbeat(
                keys=[self._liveness, self._members, *self._locks],
                args=[self.member_id, self._ttl_ms, VERSE_LOCK_TTL_S],
            )
        )
