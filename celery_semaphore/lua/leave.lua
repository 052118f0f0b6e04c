-- leave: a waiter gives up its place in line (timeout, max wait, revoke), so it never blocks
-- the waiters behind it.
--   KEYS    the six semaphore keys (see _lib.lua)
--   ARGV[1] wake-up channel
--   ARGV[2] waiter id
-- Returns 1 if the waiter was in line, 0 if not. Safe to repeat.

local now = now_ms()
local dropped = purge(now)
local left = redis.call('ZREM', K_QUEUE, ARGV[2])
redis.call('ZREM', K_SEEN, ARGV[2])
redis.call('HDEL', K_SINCE, 'w:' .. ARGV[2])
if left + dropped > 0 then
  wake()
end
touch()
return left
