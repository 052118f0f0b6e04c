-- leave: a waiter steps out of line, so it never blocks the waiters behind it.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] wake-up channel
--   ARGV[2] waiter id
--   ARGV[3] away_ms  "" to give up the place (timeout, max wait, revoke); or how long the
--                    waiter will be away (a Celery countdown): it keeps its place and shows in
--                    status, but slots pass it by until it asks again, within away_ms
-- Returns 1 if the waiter was in line, 0 if not. Safe to repeat.

local now = now_ms()
local dropped = purge(now)
local left
local away_ms = tonumber(ARGV[3])
if away_ms and redis.call('ZSCORE', K_QUEUE, ARGV[2]) then
  left = redis.call('ZREM', K_PRESENT, ARGV[2])
  redis.call('ZADD', K_SEEN, now + away_ms, ARGV[2])
else
  left = drop_waiter(ARGV[2])
end
if left + dropped > 0 then
  wake()
end
touch()
return left
