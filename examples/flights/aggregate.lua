-- aggregate.lua: add handled flights to the per-carrier aggregates, once per event.
--
-- KEYS[1]  seen        bitmap: bit <publish position> = 1 once that event was handled
-- KEYS[2]  aggregates  hash: <carrier>:flights, <carrier>:delay_sum (min), <carrier>:delay_n
-- KEYS[3]  counters    hash: handled (distinct events), duplicates
-- ARGV[1]  JSON array of [position, carrier, dep_delay (null when unknown)], one per event
--
-- Returns one code per event: 0 applied, 1 duplicate (handled before, not applied again).

local seen = KEYS[1]
local aggregates = KEYS[2]
local counters = KEYS[3]
local events = cjson.decode(ARGV[1])

local codes, new, dups = {}, 0, 0
for _, event in ipairs(events) do
  local position, carrier, delay = event[1], event[2], event[3]
  if redis.call('SETBIT', seen, position, 1) == 1 then
    dups = dups + 1
    codes[#codes + 1] = 1
  else
    new = new + 1
    redis.call('HINCRBY', aggregates, carrier .. ':flights', 1)
    if delay ~= cjson.null then
      redis.call('HINCRBY', aggregates, carrier .. ':delay_sum', delay)
      redis.call('HINCRBY', aggregates, carrier .. ':delay_n', 1)
    end
    codes[#codes + 1] = 0
  end
end
if new > 0 then redis.call('HINCRBY', counters, 'handled', new) end
if dups > 0 then redis.call('HINCRBY', counters, 'duplicates', dups) end
return codes
