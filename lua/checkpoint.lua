-- checkpoint.lua: the offloader's fenced writes to a shard's checkpoint (docs/tier.md).
--
-- KEYS[1]  locks        offloader lock hash: "<shard>" -> owner, "<shard>:token" -> fencing token
-- KEYS[2]  checkpoints  hash: "<shard>" -> last archived ID, "<shard>:pending" -> intent,
--                       "<shard>:count" -> entries accounted for, "<shard>:gap" -> a gap
--                       accounted for whose record is not yet stored (its JSON)
-- ARGV[1]  shard
-- ARGV[2]  offloader ID of the caller
-- ARGV[3]  the caller's fencing token
-- ARGV[4]  the operation, with its further arguments:
--   "begin"    ARGV[5] first entry ID of the segment, ARGV[6] its last, ARGV[7] its entries:
--              record the intent "<first> <last> <entries>". Returns 1, {2, pending} when
--              another intent is pending (finish that one first), or {3, checkpoint} when
--              first is not after the checkpoint (a stale buffer).
--   "commit"   ARGV[5] last entry ID of a stored segment (or of a gap), ARGV[6] the entries
--              it accounts for (archived rows, or lost entries of a gap): clear the intent,
--              set the checkpoint to ARGV[5], add ARGV[6] to the count. Never moves the
--              checkpoint backwards: returns 1 (advanced) or 2 (already at or past it).
--              With ARGV[7], the gap record of entries of the range that were lost (ARGV[6]
--              counts them too), it also keeps ARGV[7] as "<shard>:gap" when it advances,
--              and returns {2, gap}, changing nothing, while another gap is pending.
--   "gap"      ARGV[5] the count and ARGV[6] the checkpoint ("" for none) the caller detected
--              the gap from, ARGV[7] entries lost, ARGV[8] the gap record (JSON): add ARGV[7]
--              to the count and keep ARGV[8] as "<shard>:gap" (accounted, to be recorded).
--              Returns 1; {2, gap} while another gap is pending; {3, count, checkpoint} when
--              the count or checkpoint is not the caller's (a stale detection). Changes
--              nothing unless it returns 1.
--   "recorded" ARGV[5] a gap record now stored: clear "<shard>:gap" if it is this one.
--              Returns 1.
--
-- Every operation returns 0 and changes nothing when the caller does not hold the shard's lock
-- with this token (fenced off). Entry IDs are compared exactly as integer pairs, never as Lua
-- (floating-point) numbers.

local locks = KEYS[1]
local cps = KEYS[2]
local shard = ARGV[1]
local me = ARGV[2]
local token = ARGV[3]
local op = ARGV[4]

-- digit strings compared by length, then text
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

if redis.call('HGET', locks, shard) ~= me
    or redis.call('HGET', locks, shard .. ':token') ~= token then
  return 0
end

if op == 'begin' then
  local first, last, entries = ARGV[5], ARGV[6], ARGV[7]
  local pending = redis.call('HGET', cps, shard .. ':pending')
  if pending then return {2, pending} end
  local cp = redis.call('HGET', cps, shard)
  if cp and cmp_id(first, cp) <= 0 then return {3, cp} end
  redis.call('HSET', cps, shard .. ':pending', first .. ' ' .. last .. ' ' .. entries)
  return 1
elseif op == 'commit' then
  local last, entries, gap = ARGV[5], ARGV[6], ARGV[7]
  local pending_gap = redis.call('HGET', cps, shard .. ':gap')
  if gap and pending_gap then return {2, pending_gap} end
  redis.call('HDEL', cps, shard .. ':pending')
  local cp = redis.call('HGET', cps, shard)
  if cp and cmp_id(last, cp) <= 0 then return 2 end
  redis.call('HSET', cps, shard, last)
  redis.call('HINCRBY', cps, shard .. ':count', entries)
  if gap then redis.call('HSET', cps, shard .. ':gap', gap) end
  return 1
elseif op == 'gap' then
  local seen_count, seen_cp, lost, gap = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
  local pending_gap = redis.call('HGET', cps, shard .. ':gap')
  if pending_gap then return {2, pending_gap} end
  local count = redis.call('HGET', cps, shard .. ':count') or '0'
  local cp = redis.call('HGET', cps, shard) or ''
  local moved = (cp == '') ~= (seen_cp == '') or (cp ~= '' and cmp_id(cp, seen_cp) ~= 0)
  if moved or cmp_num(count, seen_count) ~= 0 then return {3, count, cp} end
  redis.call('HINCRBY', cps, shard .. ':count', lost)
  redis.call('HSET', cps, shard .. ':gap', gap)
  return 1
elseif op == 'recorded' then
  if redis.call('HGET', cps, shard .. ':gap') == ARGV[5] then
    redis.call('HDEL', cps, shard .. ':gap')
  end
  return 1
end
return redis.error_reply('checkpoint.lua: unknown operation ' .. tostring(op))
