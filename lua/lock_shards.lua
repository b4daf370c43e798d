-- lock_shards.lua: refresh the caller's liveness and take shard locks of one consumer group.
--
-- KEYS[1]  members  sorted set: consumer ID -> liveness deadline (server time, ms)
-- KEYS[2]  locks    hash: "<shard>" -> owner consumer ID, "<shard>:token" -> fencing token
-- KEYS[3]  epoch    hash: "n" -> the group's coordination epoch (an integer), "since" -> the
--                   server time (ms) the key was made: the epoch is "<since>:<n>";
--                   "held:<member>" -> how many locks that member owns (absent: none)
-- ARGV[1]  consumer ID of the caller
-- ARGV[2]  liveness TTL (ms)
-- ARGV[3]  shard count of the topic (for the fair share)
-- ARGV[4]  the epoch at which the caller last scanned every shard, or "" (scan now)
-- ARGV[5]  H: how many of the following shards are the ones the caller holds
-- ARGV[6..5+H]  the shards the caller holds (read when ARGV[4] is not "")
-- ARGV[6+H]     S: "" when the candidates follow; else a shard, and the candidates are every
--               shard in the order S, S+1, ..., shard count - 1, 0, ..., S-1 (none follow)
-- ARGV[7+H..]   candidate shards, in the caller's order of preference
--
-- A lock is taken when it is free, or held by a consumer whose liveness has expired, or already
-- held by the caller. The caller takes locks up to its fair share: with S shards and N live
-- members, floor(S / N), plus one for the (S mod N) members first by consumer ID (the shares
-- add up to S, so a member that joins is owed floor(S / N) even when ceil(S / N) does not
-- change; Kafka's range assignor splits partitions alike). Locks it already holds are kept even
-- above that (the caller releases its surplus once the shard is idle). Every change of owner
-- increments the lock's fencing token.
--
-- The epoch grows whenever a lock may have become takeable or the share may have changed: a
-- member joined or was dropped (here), or locks were released or a member left
-- (unlock_shards.lua). Between two such changes no lock becomes free and no member dies, so a
-- caller that scanned every shard at the current epoch cannot take anything: the call then only
-- reads the shards the caller says it holds (O(held), not O(shards)), and its count of locks:
-- a caller that owns a lock it did not list (its release was lost with a failover that rolled
-- back the release's epoch too) scans, so it finds that lock. At a later epoch than
-- the caller's scan, a caller that still holds at least its (new) share and owns no lock it did
-- not list ("held:<me>" counts its locks: every change of owner keeps it, every scan of all
-- shards sets it) cannot take anything either, and a scan would report just the listed locks it
-- owns: it gets those, with its new share, without a scan. So after a membership change only
-- the members owed shards scan (O(what changed), not O(members x shards)). A stale or wrong
-- epoch from the caller only makes it scan, or miss takeable locks until the next change; it
-- never gives it a lock another member holds.
--
-- Returns {fair_share, epoch, {shard, token, state}, ...}: fair_share is -1 when the caller's
-- epoch was current (membership unchanged since its scan, so its share is the one that scan
-- returned); one triple per lock the caller now
-- holds, state 0 = it already held the lock, 1 = it has just taken a free lock, 2 = it has just
-- taken the lock from a consumer whose liveness expired. On 1 and 2 the caller is the new owner
-- and must recover the shard's pending entries before reading new ones.
-- Uses only plain Lua 5.1 (no bit library), so fakeredis runs it too.

local members = KEYS[1]
local locks = KEYS[2]
local epoch_key = KEYS[3]
local me = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local shard_count = tonumber(ARGV[3])
local known_epoch = ARGV[4]
local n_held = tonumber(ARGV[5])

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local dropped = redis.call('ZREMRANGEBYSCORE', members, '-inf', '(' .. now_ms)
local joined = redis.call('ZADD', members, now_ms + ttl_ms, me)
local n = redis.call('HGET', epoch_key, 'n')  -- (2 HGETs: roles from before +hmget lack HMGET)
local since = redis.call('HGET', epoch_key, 'since')
if dropped > 0 or joined > 0 then
  n = redis.call('HINCRBY', epoch_key, 'n', 1)
end
if not since then  -- a new epoch key (first use, or the data was lost): a new era of epochs
  since = tostring(now_ms)
  redis.call('HSET', epoch_key, 'since', since)
end
-- "<since>:<n>": after a FLUSHALL the counter starts again, the era does not come back
local epoch = since .. ':' .. tostring(n or 0)

-- HMGET of `fields` of the lock hash in chunks (Lua's unpack has a limit): their values, false
-- where absent. A role without HMGET (docs/security.md before it was added) reads them one by
-- one: the same values, one command each.
local CHUNK = 1000
local function hget_many(fields)
  local values = {}
  for from = 1, #fields, CHUNK do
    local to = math.min(from + CHUNK - 1, #fields)
    local got = redis.pcall('HMGET', locks, unpack(fields, from, to))
    if got.err then
      for j = from, to do values[j] = redis.call('HGET', locks, fields[j]) end
    else
      for j = 1, #got do values[from + j - 1] = got[j] end
    end
  end
  return values
end

-- {shard, token, 0} for each of `shards` (strings) whose lock the caller holds, in their order
local function held_of(shards, owners)
  local mine = {}
  for j, shard in ipairs(shards) do
    if owners[j] == me then mine[#mine + 1] = shard end
  end
  local token_fields = {}
  for j, shard in ipairs(mine) do token_fields[j] = shard .. ':token' end
  local tokens = hget_many(token_fields)
  local out = {}
  for j, shard in ipairs(mine) do out[j] = {tonumber(shard), tonumber(tokens[j] or 0), 0} end
  return out
end

-- How many locks a member owns, kept in the epoch hash ("held:<member>") by every change of a
-- lock's owner (takes here, releases in unlock_shards.lua) and set by every scan of all shards:
-- a member whose listed locks are all its own and as many as this owns no other.
local function add_held(member, by)
  if by ~= 0 and redis.call('HINCRBY', epoch_key, 'held:' .. member, by) <= 0 then
    redis.call('HDEL', epoch_key, 'held:' .. member)
  end
end

-- How many distinct `listed` shards the caller owns, by their `owners`
local function mine_of(listed, owners)
  local mine, counted = 0, {}
  for j = 1, #listed do
    if owners[j] == me and not counted[listed[j]] then
      counted[listed[j]] = true
      mine = mine + 1
    end
  end
  return mine
end

local function owned_count()
  return tonumber(redis.call('HGET', epoch_key, 'held:' .. me) or '0')
end

-- The candidates: every shard from S, or the ones given, each once; a candidate that is not
-- the decimal form of a shard of the topic is an error (it would name a foreign field).
local function candidates_of(start)
  local candidates = {}
  if start ~= '' then
    start = tonumber(start)
    for i = 0, shard_count - 1 do candidates[#candidates + 1] = tostring((start + i) % shard_count) end
    return candidates, true
  end
  local seen = {}
  for i = 7 + n_held, #ARGV do
    local c = ARGV[i]
    local k = tonumber(c)
    if not k or tostring(k) ~= c or k < 0 or k >= shard_count then
      return redis.error_reply('ERR lock_shards: candidate "' .. c .. '" is not a shard of 0..' .. (shard_count - 1))
    end
    if not seen[c] then
      seen[c] = true
      candidates[#candidates + 1] = c
    end
  end
  return candidates, #candidates == shard_count
end

local listed = {}
for i = 6, 5 + n_held do listed[#listed + 1] = ARGV[i] end
local held = {}
local share = -1
local current = known_epoch == epoch
if current then
  local owners = hget_many(listed)
  if mine_of(listed, owners) == owned_count() then
    held = held_of(listed, owners)
  else
    current = false  -- it owns a lock it did not list: a scan finds it
  end
end
if not current then
  local live = redis.call('ZCARD', members)
  share = math.floor(shard_count / live)
  if shard_count % live > 0 then  -- the first (S mod N) members by ID hold one more
    local ranked = redis.pcall('ZRANGE', members, 0, -1)
    if ranked.err then  -- a role without ZRANGE (docs/security.md before it was added): ceil
      share = share + 1
    else
      local before = 0
      for _, member in ipairs(ranked) do
        if member < me then before = before + 1 end
      end
      if before < shard_count % live then share = share + 1 end
    end
  end
  -- A caller that scanned at an earlier epoch, holds at least its share now and owns no lock
  -- it did not list has nothing to take and nothing more to report: a scan would find the
  -- same (docs/protocol.md, "A round at a new epoch"). Only members owed shards scan.
  local scan = true
  if known_epoch ~= '' then
    local owners = hget_many(listed)
    local mine = mine_of(listed, owners)
    if mine >= share and mine == owned_count() then
      held = held_of(listed, owners)
      scan = false
    end
  end
  if scan then
    local candidates, every = candidates_of(ARGV[6 + n_held])  -- every: each shard once
    if every == nil then return candidates end  -- the error reply
    local owners = hget_many(candidates)
    held = held_of(candidates, owners)
    local count = #held
    local free = {}
    local live_owner = {}  -- owner -> whether it is a live member (ZSCORE once per owner)
    for j, shard in ipairs(candidates) do
      local owner = owners[j]
      if not owner then
        free[#free + 1] = {shard, 1}
      elseif owner ~= me then
        local is_live = live_owner[owner]
        if is_live == nil then
          is_live = redis.call('ZSCORE', members, owner) ~= false  -- expired ones were removed above
          live_owner[owner] = is_live
        end
        if not is_live then free[#free + 1] = {shard, 2, owner} end
      end
    end

    local had = count
    for _, f in ipairs(free) do
      if count >= share then break end
      local shard, state = f[1], f[2]
      redis.call('HSET', locks, shard, me)
      local token = redis.call('HINCRBY', locks, shard .. ':token', 1)
      if state == 2 then add_held(f[3], -1) end
      count = count + 1
      held[#held + 1] = {tonumber(shard), token, state}
    end
    if every then  -- every lock the caller owns is in `held`: its count is known exactly
      if count > 0 then
        redis.call('HSET', epoch_key, 'held:' .. me, count)
      else
        redis.call('HDEL', epoch_key, 'held:' .. me)
      end
    else
      add_held(me, count - had)
    end
  end
end

local result = {share, epoch}
for _, h in ipairs(held) do result[#result + 1] = h end
return result
