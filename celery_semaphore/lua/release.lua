-- release: give a slot back.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] wake-up channel
--   ARGV[2] token
-- Returns 1 if token held a slot and now does not; 0 if its lease was already gone (expired,
-- released before, or never granted). Safe to repeat.
-- A release also folds the holder's hold time into a moving average (KEYS[6] field "hold",
-- ms), which acquire reports so that waiters can judge how soon a slot is likely to free.

local now = now_ms()
local dropped = purge(now)
local released = redis.call('ZREM', K_HOLDERS, ARGV[2])
if released == 1 then
  local since = redis.call('HGET', K_SINCE, 'h:' .. ARGV[2])
  local granted = since and tonumber(string.match(since, '^(%d+)'))
  if granted then
    local held = now - granted
    local average = tonumber(redis.call('HGET', K_SINCE, 'hold'))
    if average then
      held = math.floor(average * 0.8 + held * 0.2)
    end
    redis.call('HSET', K_SINCE, 'hold', held)
  end
  redis.call('HDEL', K_SINCE, 'h:' .. ARGV[2])
end
if released + dropped > 0 then
  wake()
end
touch()
return released
