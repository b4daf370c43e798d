-- lock_shards.lua: refresh the caller's liveness and take shard locks of one consumer group.
--
-- KEYS[1]  members  sorted set: consumer ID -> liveness deadline (server time, ms)
-- KEYS[2]  locks    hash: "<shard>" -> owner consumer ID, "<shard>:token" -> fencing token
-- ARGV[1]  consumer ID of the caller
-- ARGV[2]  liveness TTL (ms)
-- ARGV[3]  shard count of the topic (for the fair share)
-- ARGV[4..] candidate shards, in the caller's order of preference
--
-- A lock is taken when it is free, or held by a consumer whose liveness has expired, or already
-- held by the caller. The caller holds at most ceil(shards / live consumers) locks after the call
-- (the fair share); locks it already holds are kept even above that (the caller releases its
-- surplus once the shard is idle). Every change of owner increments the lock's fencing token.
--
-- Returns {fair_share, {shard, token, state}, ...}: one triple per lock the caller now holds,
-- state 0 = it already held the lock, 1 = it has just taken a free lock, 2 = it has just taken
-- the lock from a consumer whose liveness expired. On 1 and 2 the caller is the new owner and
-- must recover the shard's pending entries before reading new ones.
-- Uses only plain Lua 5.1 (no bit library), so fakeredis runs it too.

local members = KEYS[1]
local locks = KEYS[2]
local me = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local shard_count = tonumber(ARGV[3])

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('ZREMRANGEBYSCORE', members, '-inf', '(' .. now_ms)
redis.call('ZADD', members, now_ms + ttl_ms, me)
local live = redis.call('ZCARD', members)
local share = math.ceil(shard_count / live)

local held = {}
local count = 0
local free = {}
for i = 4, #ARGV do
  local shard = ARGV[i]
  local owner = redis.call('HGET', locks, shard)
  if owner == me then
    count = count + 1
    held[#held + 1] = {tonumber(shard), tonumber(redis.call('HGET', locks, shard .. ':token') or 0), 0}
  elseif not owner then
    free[#free + 1] = {shard, 1}
  elseif not redis.call('ZSCORE', members, owner) then  -- expired members were removed above
    free[#free + 1] = {shard, 2}
  end
end

for _, f in ipairs(free) do
  if count >= share then break end
  local shard, state = f[1], f[2]
  redis.call('HSET', locks, shard, me)
  local token = redis.call('HINCRBY', locks, shard .. ':token', 1)
  count = count + 1
  held[#held + 1] = {tonumber(shard), token, state}
end

local result = {share}
for _, h in ipairs(held) do result[#result + 1] = h end
return result
