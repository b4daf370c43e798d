"""Offloader checkpoints in Redis, changed only under a valid offloader shard lock (fencing).

The checkpoint hash `Keys.checkpoints(topic)` has, per shard:

* ``<shard>``          -> the last archived entry ID (``<ms>-<seq>``); absent: nothing archived;
* ``<shard>:pending``  -> ``"<first> <last> <entries>"``: the segment being written (the *intent*);
* ``<shard>:count``    -> entries accounted for: archived, plus recorded as lost in gap records.

Both scripts take the offloader lock hash as KEYS[1] and refuse (return 0) unless the caller
still owns the shard's lock with the fencing token it was given: an offloader that lost its lock
(paused, partitioned) can never move a checkpoint. The keys share the coordination hashtag, so
the scripts are atomic on a Redis Cluster too. Entry IDs are compared exactly as integer pairs
(digit strings compared by length, then text), without Lua's floating-point numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eventbus.keys import Keys
from eventbus.tier.ids import EntryId, parse_id
from eventbus.tier.settings import OFFLOADER_GROUP

_CMP = """
local function cmp_num(a, b)
  if #a ~= #b then return (#a < #b) and -1 or 1 end
  if a == b then return 0 end
  return (a < b) and -1 or 1
end
local function cmp_id(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  local c = cmp_num(am, bm)
  if c ~= 0 then return c end
  return cmp_num(as, bs)
end
local function owns(locks, shard, me, token)
  return redis.call('HGET', locks, shard) == me
     and redis.call('HGET', locks, shard .. ':token') == token
end
"""

BEGIN_LUA = (
    """-- begin_segment: record the intent to write segment first..last of a shard.
--
-- KEYS[1]  locks        offloader lock hash: "<shard>" -> owner, "<shard>:token" -> token
-- KEYS[2]  checkpoints  hash: "<shard>", "<shard>:pending", "<shard>:count"
-- ARGV[1]  shard   ARGV[2] caller's consumer ID   ARGV[3] its fencing token
-- ARGV[4]  first entry ID   ARGV[5] last entry ID   ARGV[6] entries in the segment
--
-- Returns 1 (intent recorded), 0 (caller does not hold the lock: fenced off),
-- or {2, pending} when another intent is pending (finish that one first),
-- or {3, checkpoint} when first is not after the checkpoint.
local locks, cps = KEYS[1], KEYS[2]
local shard, me, token = ARGV[1], ARGV[2], ARGV[3]
local first, last, entries = ARGV[4], ARGV[5], ARGV[6]
"""
    + _CMP
    + """
if not owns(locks, shard, me, token) then return 0 end
local pending = redis.call('HGET', cps, shard .. ':pending')
if pending then return {2, pending} end
local cp = redis.call('HGET', cps, shard)
if cp and cmp_id(first, cp) <= 0 then return {3, cp} end
redis.call('HSET', cps, shard .. ':pending', first .. ' ' .. last .. ' ' .. entries)
return 1
"""
)

COMMIT_LUA = (
    """-- commit_segment: advance a shard's checkpoint to the last ID of a stored segment.
--
-- KEYS[1]  locks        offloader lock hash
-- KEYS[2]  checkpoints  hash
-- ARGV[1]  shard   ARGV[2] caller's consumer ID   ARGV[3] its fencing token
-- ARGV[4]  last entry ID of the stored segment (or of a gap)
-- ARGV[5]  entries accounted for by it (archived rows, or lost entries of a gap)
--
-- Clears the pending intent. Never moves the checkpoint backwards (a replayed commit adds
-- nothing). Returns 1 (advanced), 2 (already at or past it), 0 (fenced off).
local locks, cps = KEYS[1], KEYS[2]
local shard, me, token = ARGV[1], ARGV[2], ARGV[3]
local last, entries = ARGV[4], tonumber(ARGV[5])
"""
    + _CMP
    + """
if not owns(locks, shard, me, token) then return 0 end
redis.call('HDEL', cps, shard .. ':pending')
local cp = redis.call('HGET', cps, shard)
if cp and cmp_id(last, cp) <= 0 then return 2 end
redis.call('HSET', cps, shard, last)
redis.call('HINCRBY', cps, shard .. ':count', entries)
return 1
"""
)

ACCOUNT_LUA = (
    """-- account_lost: add entries recorded as lost (in a gap record) to a shard's count.
--
-- KEYS[1]  locks   KEYS[2] checkpoints
-- ARGV[1]  shard   ARGV[2] caller's consumer ID   ARGV[3] its fencing token   ARGV[4] entries
--
-- Returns 1, or 0 when fenced off.
local locks, cps = KEYS[1], KEYS[2]
local shard, me, token = ARGV[1], ARGV[2], ARGV[3]
"""
    + _CMP
    + """
if not owns(locks, shard, me, token) then return 0 end
redis.call('HINCRBY', cps, shard .. ':count', tonumber(ARGV[4]))
return 1
"""
)


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
        self._begin = redis.register_script(BEGIN_LUA)
        self._commit = redis.register_script(COMMIT_LUA)
        self._account = redis.register_script(ACCOUNT_LUA)

    async def read(self, shard: int) -> ShardCheckpoint:
        """The current state of `shard`."""
        last, pending, count = await self.redis.hmget(
            self.key, [str(shard), f"{shard}:pending", f"{shard}:count"]
        )
        intent = None
        if pending is not None:
            first, end, n = pending.decode().split()
            intent = Intent(parse_id(first), parse_id(end), int(n))
        return ShardCheckpoint(
            parse_id(last) if last is not None else None, intent, int(count or 0)
        )

    async def all(self) -> dict[int, EntryId]:
        """Every shard's last archived ID."""
        raw = await self.redis.hgetall(self.key)
        return {int(k): parse_id(v) for k, v in raw.items() if k.isdigit()}

    async def begin(self, shard: int, me: str, token: int, intent: Intent) -> bool | Any:
        """Record `intent` under the lock. Returns True, False (fenced off), or the script's
        ``[code, value]`` reply when another intent is pending (2) or the range is stale (3)."""
        reply = await self._begin(
            keys=[self.locks, self.key],
            args=[shard, me, token, str(intent.first), str(intent.last), intent.entries],
        )
        if isinstance(reply, list):
            return reply
        return bool(reply)

    async def commit(self, shard: int, me: str, token: int, last: EntryId, entries: int) -> bool:
        """Advance the checkpoint to `last`, adding `entries` to the count, and clear the intent.
        Returns False when fenced off (the caller no longer holds the lock)."""
        reply = await self._commit(
            keys=[self.locks, self.key], args=[shard, me, token, str(last), entries]
        )
        return int(reply) != 0

    async def account_lost(self, shard: int, me: str, token: int, entries: int) -> bool:
        """Add `entries` recorded as lost to the count. False when fenced off."""
        reply = await self._account(keys=[self.locks, self.key], args=[shard, me, token, entries])
        return int(reply) != 0
