-- fenced_hash.lua: a consumer's write to a group's coordination hash (parked resources, the
-- operator's control requests), made only while it holds the shard lock the write is for.
--
-- KEYS[1]  locks  hash: "<shard>" -> owner consumer ID, "<shard>:token" -> fencing token
-- KEYS[2]  the hash written (parked resources or control requests of the same group)
-- ARGV[1]  shard the write is for (the shard of the entry being handled)
-- ARGV[2]  consumer ID of the caller
-- ARGV[3]  the caller's fencing token for that shard
-- ARGV[4]  "HSETNX", "HSET" or "HDEL"
-- ARGV[5..] the command's field (and value)
--
-- The client's own lease check comes before the write is sent, not when Redis applies it: a
-- process paused (or a request delayed) between the two would write after another consumer
-- took the shard. Checked here, the write and the check are one step (the fencing token as
-- Kleppmann describes it: the resource refuses a superseded token).
-- Returns {1, reply of the command}, or {0} and writes nothing when the caller does not hold the
-- shard's lock with this token (fenced off). Plain Lua 5.1, so fakeredis runs it too.

local shard = ARGV[1]
if redis.call('HGET', KEYS[1], shard) ~= ARGV[2]
    or redis.call('HGET', KEYS[1], shard .. ':token') ~= ARGV[3] then
  return {0}
end
local op = ARGV[4]
if op == 'HSETNX' or op == 'HSET' then
  return {1, redis.call(op, KEYS[2], ARGV[5], ARGV[6])}
elseif op == 'HDEL' then
  return {1, redis.call('HDEL', KEYS[2], ARGV[5])}
end
return redis.error_reply('fenced_hash.lua: unknown operation ' .. tostring(op))
