-- verse_lock_shards.lua: take shard locks of one (Verse channel, group) under Verse's lock keys.
--
-- KEYS[1]  liveness   string "{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:<caller>" (Verse's)
-- KEYS[2]  members    sorted set of the group's live eventbus consumers (deadline, server ms)
-- KEYS[3]  tokens     hash: shard -> fencing token (eventbus's; Verse has none)
-- KEYS[4..] locks     string "{VERSE:STREAM:SHARDLOCK}:<channel>:<shard>:<group>" per candidate
-- ARGV[1]  caller's consumer ID (Verse's service ID)
-- ARGV[2]  liveness TTL (ms)
-- ARGV[3]  lock TTL (s): Verse sets its locks with EX 3200
-- ARGV[4]  shard count of the topic (for the fair share among eventbus consumers)
-- ARGV[5..] candidate shards, in the caller's order of preference, one per lock key
--
-- A lock is taken, as Verse's own lock script takes it, when its key is absent or its owner has
-- no liveness key; eventbus also keeps the locks it already holds (Verse's script does not: its
-- consumer releases every lock at the end of each iteration). The caller takes at most
-- ceil(shards / live eventbus consumers) locks (Verse's consumers do not count: Verse has no
-- member list), sets its lock keys EX <lock TTL>, and sets its liveness key PX <liveness TTL>
-- so that Verse's consumers see it as alive. Each lock taken increments the shard's token.
--
-- It also reads the liveness key of each lock's owner, which is not in KEYS (its name comes from
-- the lock's value, as in Verse's script): it shares the hashtag, so the slot, of KEYS[1].
--
-- Returns {fair_share, {shard, token, state}, ...} like lock_shards.lua: state 0 = already
-- held, 1 = the lock was free, 2 = its owner had no liveness key; and {shard, 0, 3, error} for
-- a lock key that cannot be read as a string (WRONGTYPE: a hash written there by hand), which
-- is neither taken nor held: one bad key stops its shard only, not the round. Plain Lua 5.1
-- (no bit library).

local liveness = KEYS[1]
local members = KEYS[2]
local tokens = KEYS[3]
local me = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local lock_ttl_s = tonumber(ARGV[3])
local shard_count = tonumber(ARGV[4])
local tag = '{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:'

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('ZREMRANGEBYSCORE', members, '-inf', '(' .. now_ms)
redis.call('ZADD', members, now_ms + ttl_ms, me)
redis.call('SET', liveness, '1', 'PX', ttl_ms)
-- the fair share as lock_shards.lua counts it: floor(S / N), one more for the first (S mod N)
-- members by consumer ID
local live = redis.call('ZCARD', members)
local share = math.floor(shard_count / live)
if shard_count % live > 0 then
  local ranked = redis.pcall('ZRANGE', members, 0, -1)
  if ranked.err then  -- a role without ZRANGE: every member's share is the ceiling, as it was
    share = share + 1
  else
    local before = 0
    for _, member in ipairs(ranked) do
      if member < me then before = before + 1 end
    end
    if before < shard_count % live then share = share + 1 end
  end
end

local held = {}
local count = 0
local free = {}
local broken = {}
for i = 5, #ARGV do
  local shard = ARGV[i]
  local key = KEYS[i - 1]
  local owner = redis.pcall('GET', key)
  if type(owner) == 'table' and owner.err then
    broken[#broken + 1] = {tonumber(shard), 0, 3, owner.err}
  elseif owner == me then
    redis.call('EXPIRE', key, lock_ttl_s)
    count = count + 1
    held[#held + 1] = {tonumber(shard), tonumber(redis.call('HGET', tokens, shard) or 0), 0}
  elseif not owner then
    free[#free + 1] = {shard, key, 1}
  elseif redis.call('EXISTS', tag .. owner) == 0 then
    free[#free + 1] = {shard, key, 2}
  end
end

for _, f in ipairs(free) do
  if count >= share then break end
  local shard, key, state = f[1], f[2], f[3]
  redis.call('SET', key, me, 'EX', lock_ttl_s)
  local token = redis.call('HINCRBY', tokens, shard, 1)
  count = count + 1
  held[#held + 1] = {tonumber(shard), token, state}
end

local result = {share}
for _, h in ipairs(held) do result[#result + 1] = h end
for _, b in ipairs(broken) do result[#result + 1] = b end
return result
