-- leave_many: an acquire_many waiter steps out of every line it stands in, so it never blocks
-- the waiters behind it.
--   KEYS    8 per semaphore (see acquire_many)
--   ARGV[1] waiter id
--   ARGV[2] n       the number of semaphores
--   ARGV[3..2+n]    each semaphore's limit when no runtime override is stored (for the hand-off)
-- Returns 1 if the waiter stood in some line, 0 if not. Safe to repeat.

local waiter = ARGV[1]
local n = tonumber(ARGV[2])
local was_in_line = 0
local now = nil
for i = 1, n do
  use_semaphore(i)
  if drop_waiter(waiter) == 1 then
    was_in_line = 1
  end
  -- it may have headed this line, holding back those behind it
  if redis.call('ZCARD', K_PRESENT) > 0 then
    now = now or now_ms()
    hand_off(now, current_limit(tonumber(ARGV[2 + i])), nil)
  end
end
return was_in_line
