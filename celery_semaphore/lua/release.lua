-- release: give a slot back.
--   KEYS    the six semaphore keys (see _lib.lua)
--   ARGV[1] wake-up channel
--   ARGV[2] token
-- Returns 1 if token held a slot and now does not; 0 if its lease was already gone (expired,
-- released before, or never granted). Safe to repeat.

local now = now_ms()
local dropped = purge(now)
local released = redis.call('ZREM', K_HOLDERS, ARGV[2])
if released == 1 then
  redis.call('HDEL', K_SINCE, 'h:' .. ARGV[2])
end
if released + dropped > 0 then
  wake()
end
touch()
return released
