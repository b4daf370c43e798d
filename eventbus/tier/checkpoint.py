"""Offloader checkpoints in Redis, changed only under a valid offloader shard lock (fencing).

The checkpoint hash `Keys.checkpoints(topic)` has, per shard:

* ``<shard>``          -> the last archived entry ID (``<ms>-<seq>``); absent: nothing archived;
* ``<shard>:pending``  -> ``"<first> <last> <entries>"``: the segment being written (the *intent*);
* ``<shard>:count``    -> entries accounted for: archived, plus recorded as lost in gap records.

The writes are the operations ``begin``, ``commit`` and ``account`` of the script
``lua/checkpoint.lua``. It takes the offloader lock hash as KEYS[1] and refuses unless the
caller still owns the shard's lock with the fencing token it was given (then `Fenced` is raised):
an offloader that lost its lock (paused, partitioned) can never move a checkpoint. The keys share
the coordination hashtag, so the script is atomic on a Redis Cluster too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eventbus.locking.locks import Fenced
from eventbus.locking.scripts import register
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.protocol.keys import Keys
from eventbus.tier.settings import OFFLOADER_GROUP


@dataclass(frozen=True, slots=True)
class Intent:
    """A pending segment: entries `first`..`last`, `entries` of them when it was read."""

    first: EntryId
    last: EntryId
    entries: int


@dataclass(frozen=True, slots=True)
class ShardCheckpoint:
    """A shard's state: last archived ID (None: nothing yet), pending intent, entries counted."""

    last: EntryId | None
    pending: Intent | None
    count: int


class Checkpoints:
    """Reads and (fenced) writes of one topic's offloader checkpoints."""

    def __init__(self, redis: Any, keys: Keys, topic: str) -> None:
        self.redis = redis
        self.topic = topic
        self.key = keys.checkpoints(topic)
        self.locks = keys.locks(topic, OFFLOADER_GROUP)
        self._script = register(redis, "checkpoint")

    async def read(self, shard: int) -> ShardCheckpoint:
        """The current state of `shard`."""
        last, pending, count = await self.redis.hmget(
            self.key, [str(shard), f"{shard}:pending", f"{shard}:count"]
        )
        return _state(last, pending, count)

    async def read_all(self, shard: int) -> ShardCheckpoint:
        """`read`, with ``HGETALL`` of the topic's hash: the one read of checkpoints that the
        consumer's ACL role has (docs/security.md), for its catch-up."""
        fields = await self.redis.hgetall(self.key)
        names = (str(shard), f"{shard}:pending", f"{shard}:count")
        last, pending, count = (fields.get(name.encode()) for name in names)
        return _state(last, pending, count)

    async def begin(self, shard: int, me: str, token: int, intent: Intent) -> bool:
        """Record `intent` under the lock. Returns False, recording nothing, when another intent
        is pending or the range does not start after the checkpoint (read it and resync).
        Raises `Fenced`."""
        reply = await self._call(
            shard, me, token, "begin", str(intent.first), str(intent.last), intent.entries
        )
        if isinstance(reply, list):  # [2, pending] or [3, checkpoint]
            return False
        return _fenced_unless(reply)

    async def commit(self, shard: int, me: str, token: int, last: EntryId, entries: int) -> None:
        """Advance the checkpoint to `last`, adding `entries` to the count, and clear the intent
        (a checkpoint already at or past `last` stays). Raises `Fenced`."""
        _fenced_unless(await self._call(shard, me, token, "commit", str(last), entries))

    async def account_lost(self, shard: int, me: str, token: int, entries: int) -> None:
        """Add `entries` recorded as lost to the count. Raises `Fenced`."""
        _fenced_unless(await self._call(shard, me, token, "account", entries))

    async def _call(self, shard: int, me: str, token: int, op: str, *args: str | int) -> Any:
        """``lua/checkpoint.lua`` operation `op` on `shard`, as `me` holding `token`."""
        return await self._script(keys=[self.locks, self.key], args=[shard, me, token, op, *args])


def _state(last: bytes | None, pending: bytes | None, count: bytes | None) -> ShardCheckpoint:
    """A shard's `ShardCheckpoint` from its three fields (None: absent)."""
    intent = None
    if pending is not None:
        first, end, n = pending.decode().split()
        intent = Intent(parse_id(first), parse_id(end), int(n))
    return ShardCheckpoint(parse_id(last) if last is not None else None, intent, int(count or 0))


def _fenced_unless(reply: Any) -> bool:
    """The script replies 0 when the caller does not hold the lock with its token."""
    if int(reply) == 0:
        raise Fenced
    return True
