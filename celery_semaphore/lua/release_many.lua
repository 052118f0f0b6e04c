-- release_many: give back the slots of one acquire_many grant, on every semaphore, and hand
-- them on to the oldest present waiters.
--   KEYS    8 per semaphore (see acquire_many)
--   ARGV[1] token   as granted (its weight is written in it, see slot_members)
--   ARGV[2] n       the number of semaphores
--   ARGV[3..2+n]    each semaphore's limit when no runtime override is stored (for the hand-off)
-- Returns 1 if the token held slots of some semaphore and now holds none; 0 if they were
-- already gone everywhere. Safe to repeat.

local token = ARGV[1]
local n = tonumber(ARGV[2])
local members = slot_members(token)
local released = 0
local now = nil
for i = 1, n do
  use_semaphore(i)
  if redis.call('ZREM', K_HOLDERS, unpack(members)) > 0 then
    released = 1
  end
  redis.call('HDEL', K_HOLDER_INFO, 'h:' .. token)
  if redis.call('ZCARD', K_QUEUE) == 0 then
    forget_line_if_empty()
  else
    now = now or now_ms()
    settle(now, current_limit(tonumber(ARGV[2 + i])))
  end
end
return released
