-- unlock_shards.lua: release shard locks the caller holds, and optionally leave the group.
--
-- KEYS[1]  members  sorted set: consumer ID -> liveness deadline (server time, ms)
-- KEYS[2]  locks    hash: "<shard>" -> owner consumer ID, "<shard>:token" -> fencing token
-- KEYS[3]  epoch    hash: "n" -> the group's coordination epoch, "since", "held:<member>"
--                   (lock_shards.lua)
-- ARGV[1]  consumer ID of the caller
-- ARGV[2]  "1" to also remove the caller from the live members (graceful shutdown), else "0"
-- ARGV[3..] shards to release
--
-- A lock held by another consumer is left alone. Fencing tokens are kept, so they only grow.
-- When a lock was released or the caller left, the epoch grows (lock_shards.lua): the other
-- members owed shards scan them again at their next lock round; the caller's count of locks
-- owned ("held:<me>") goes down by those released. Returns the list of shards released.

local members = KEYS[1]
local locks = KEYS[2]
local epoch_key = KEYS[3]
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
local left = 0
if leave then
  left = redis.call('ZREM', members, me)
end
if #released > 0 or left > 0 then
  redis.call('HINCRBY', epoch_key, 'n', 1)
end
-- the caller's count of locks owned (lock_shards.lua): the field goes with the last one
if #released > 0 and redis.call('HINCRBY', epoch_key, 'held:' .. me, -#released) <= 0 then
  redis.call('HDEL', epoch_key, 'held:' .. me)
end
return released
