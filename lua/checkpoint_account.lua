-- checkpoint_account.lua: add entries recorded as lost (in a gap record) to a shard's count
-- (fenced).
--
-- KEYS[1]  locks        offloader lock hash: "<shard>" -> owner, "<shard>:token" -> fencing token
-- KEYS[2]  checkpoints  hash: "<shard>:count" -> entries accounted for
-- ARGV[1]  shard
-- ARGV[2]  offloader ID of the caller
-- ARGV[3]  the caller's fencing token
-- ARGV[4]  entries lost
--
-- Returns 1, or 0 when the caller does not hold the lock with this token (fenced off).

local locks = KEYS[1]
local cps = KEYS[2]
local shard = ARGV[1]
local me = ARGV[2]
local token = ARGV[3]
local lost = tonumber(ARGV[4])

if redis.call('HGET', locks, shard) ~= me
    or redis.call('HGET', locks, shard .. ':token') ~= token then
  return 0
end
redis.call('HINCRBY', cps, shard .. ':count', lost)
return 1
