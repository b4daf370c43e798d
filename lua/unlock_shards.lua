-- unlock_shards.lua: release shard locks the caller holds, and optionally leave the group.
--
-- KEYS[1]  members  sorted set: consumer ID -> liveness deadline (server time, ms)
-- KEYS[2]  locks    hash: "<shard>" -> owner consumer ID, "<shard>:token" -> fencing token
-- ARGV[1]  consumer ID of the caller
-- ARGV[2]  "1" to also remove the caller from the live members (graceful shutdown), else "0"
-- ARGV[3..] shards to release
--
-- A lock held by another consumer is left alone. Fencing tokens are kept, so they only grow.
-- Returns the list of shards released.

local members = KEYS[1]
local locks = KEYS[2]
local me = ARGV[1]
local leave = ARGV[2] == '1'

local released = {}
for i = 3, #ARGV do
  local shard = ARGV[i]
  if redis.call('HGET', locks, shard) == me then
    redis.call('HDEL', locks, shard)
    released[#released + 1] = tonumber(shard)
  end
end
if leave then
  redis.call('ZREM', members, me)
end
return released
