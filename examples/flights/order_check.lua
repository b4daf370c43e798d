-- order_check.lua: record handled flights of the order-checking group, once per event.
--
-- KEYS[1]  last_seq  hash: plane -> highest seq handled so far
-- KEYS[2]  seen      bitmap: bit <publish position> = 1 once that event was handled
-- KEYS[3]  counters  hash: handled (distinct events), duplicates, violations
-- ARGV[1]  JSON array of [plane, seq, position], one per event, in the order the handlers called
--
-- Returns one code per event: 0 in order, 1 duplicate (handled before, not applied again),
-- 2 out of order (a later flight of the plane was handled first).

local last_seq = KEYS[1]
local seen = KEYS[2]
local counters = KEYS[3]
local events = cjson.decode(ARGV[1])

local codes, new, dups, bad = {}, 0, 0, 0
for _, event in ipairs(events) do
  local plane, seq, position = event[1], event[2], event[3]
  if redis.call('SETBIT', seen, position, 1) == 1 then
    dups = dups + 1
    codes[#codes + 1] = 1
  else
    new = new + 1
    local last = tonumber(redis.call('HGET', last_seq, plane) or 0)
    if seq <= last then
      bad = bad + 1
      codes[#codes + 1] = 2
    else
      redis.call('HSET', last_seq, plane, seq)
      codes[#codes + 1] = 0
    end
  end
end
if new > 0 then redis.call('HINCRBY', counters, 'handled', new) end
if dups > 0 then redis.call('HINCRBY', counters, 'duplicates', dups) end
if bad > 0 then redis.call('HINCRBY', counters, 'violations', bad) end
return codes
