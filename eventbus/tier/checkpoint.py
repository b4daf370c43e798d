"""Offloader checkpoints in Redis, changed only under a valid offloader shard lock (fencing).

The checkpoint hash `Keys.checkpoints(topic)` has, per shard:

* ``<shard>``          -> the last archived entry ID (``<ms>-<seq>``); absent: nothing archived;
* ``<shard>:pending``  -> ``"<first> <last> <entries>"``: the segment being written (the *intent*);
* ``<shard>:count``    -> entries accounted for: archived, plus recorded as lost in gap records;
* ``<shard>:gap``      -> a gap accounted for in the count whose record is not stored yet (the
  record's JSON): stored, then cleared, by this owner or by the next one's recovery.

The writes are the operations ``begin``, ``commit``, ``gap`` and ``recorded`` of the script
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
from eventbus.tier.errors import CorruptCheckpoint
from eventbus.tier.settings import OFFLOADER_GROUP


@dataclass(frozen=True, slots=True)
class Intent:
    """A pending segment: entries `first`..`last`, `entries` of them when it was read."""

    first: EntryId
    last: EntryId
    entries: int


@dataclass(frozen=True, slots=True)
class ShardCheckpoint:
    """A shard's state: last archived ID (None: nothing yet), pending intent, entries counted,
    and the gap accounted for but not yet recorded (its record's JSON), if any."""

    last: EntryId | None
    pending: Intent | None
    count: int
    gap: str | None = None


class Checkpoints:
    """Reads and (fenced) writes of one topic's offloader checkpoints."""

    def __init__(self, redis: Any, keys: Keys, topic: str) -> None:
        self.redis = redis
        self.topic = topic
        self.key = keys.checkpoints(topic)
        self.locks = keys.locks(topic, OFFLOADER_GROUP)
        self._script = register(redis, "checkpoint")

    async def read(self, shard: int) -> ShardCheckpoint:
        """The current state of `shard`. Raises `CorruptCheckpoint` for fields that are not
        what the offloader writes."""
        return checkpoint_state(
            f"{self.key} shard {shard}", *await self.redis.hmget(self.key, _fields(shard))
        )

    async def read_all(self, shard: int) -> ShardCheckpoint:
        """`read`, with ``HGETALL`` of the topic's hash: the one read of checkpoints that the
        consumer's ACL role has (docs/security.md), for its catch-up."""
        fields = await self.redis.hgetall(self.key)
        return checkpoint_state(
            f"{self.key} shard {shard}", *(fields.get(name.encode()) for name in _fields(shard))
        )

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

    async def commit(
        self, shard: int, me: str, token: int, last: EntryId, entries: int, gap: str | None = None
    ) -> bool:
        """Advance the checkpoint to `last`, adding `entries` to the count, and clear the intent
        (a checkpoint already at or past `last` stays). With `gap` (the JSON of a gap record of
        entries of the range that were lost, which `entries` counts too), also keep it as the
        shard's unrecorded gap when the checkpoint advances. Returns False, changing nothing,
        when another gap is unrecorded (only with `gap`: record that one first). Raises
        `Fenced`."""
        extra = () if gap is None else (gap,)
        reply = await self._call(shard, me, token, "commit", str(last), entries, *extra)
        if isinstance(reply, list):  # [2, unrecorded gap]
            return False
        return _fenced_unless(reply)

    async def account_gap(
        self,
        shard: int,
        me: str,
        token: int,
        seen: tuple[EntryId | None, int],
        lost: int,
        gap: str,
    ) -> bool:
        """Add `lost` entries to the count and keep `gap` (a gap record's JSON) as the shard's
        unrecorded gap, in one fenced step, if the checkpoint and count are still `seen` (last
        archived ID or None, entries accounted: what the gap was detected from). Returns False,
        changing nothing, when they moved or another gap is unrecorded (read the state, record
        that one, resync). Raises `Fenced`: an offloader that lost the shard never accounts, so
        never records, a gap."""
        last, count = seen
        reply = await self._call(shard, me, token, "gap", count, str(last or ""), lost, gap)
        if isinstance(reply, list):  # [2, unrecorded gap] or [3, count, checkpoint]
            return False
        return _fenced_unless(reply)

    async def gap_recorded(self, shard: int, me: str, token: int, gap: str) -> None:
        """Clear the shard's unrecorded gap if it is `gap` (its record is now stored). Raises
        `Fenced` (the next owner then stores the record again: create-only, no duplicate)."""
        _fenced_unless(await self._call(shard, me, token, "recorded", gap))

    async def _call(self, shard: int, me: str, token: int, op: str, *args: str | int) -> Any:
        """``lua/checkpoint.lua`` operation `op` on `shard`, as `me` holding `token`."""
        return await self._script(keys=[self.locks, self.key], args=[shard, me, token, op, *args])


def _fields(shard: int) -> list[str]:
    """The checkpoint hash fields of `shard`, in `_state`'s order."""
    return [str(shard), f"{shard}:pending", f"{shard}:count", f"{shard}:gap"]


def checkpoint_state(
    where: str,
    last: bytes | None,
    pending: bytes | None,
    count: bytes | None,
    gap: bytes | None,
) -> ShardCheckpoint:
    """A shard's `ShardCheckpoint` from its four fields (None: absent), in `_fields`'s order.
    Raises `CorruptCheckpoint` naming `where` (the hash and shard) for a field that is not what
    ``lua/checkpoint.lua`` writes (whoever may write the hash can write anything)."""
    try:
        intent = None
        if pending is not None:
            first, end, n = pending.decode().split()
            intent = Intent(parse_id(first), parse_id(end), int(n))
            if intent.entries < 0 or intent.first > intent.last:
                raise ValueError(f"pending {pending.decode()!r} is no range of entries")
        counted = int(count or 0)
        if counted < 0:  # a count the offloader never writes; catch-up would trust it
            raise ValueError(f"count {counted} is negative")
        return ShardCheckpoint(
            parse_id(last) if last is not None else None,
            intent,
            counted,
            None if gap is None else gap.decode(),
        )
    except Exception as exc:  # ValueError, UnicodeDecodeError, ConfigError of parse_id
        raise CorruptCheckpoint(where, f"{type(exc).__name__}: {exc}") from None


def _fenced_unless(reply: Any) -> bool:
    """The script replies 0 when the caller does not hold the lock with its token."""
    if int(reply) == 0:
        raise Fenced
    return True
