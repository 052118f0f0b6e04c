-- claim_parked_waiter: take the parked-task record of one waiter, now, whatever its due time:
-- the waiter was offered a slot and nobody heard its wake-up (its process is gone), so the
-- process that made the offer sends its wake copy instead (_parking.wake_offered). One taker.
--   KEYS[1] due     ZSET  (see park.lua)
--   KEYS[2] copies  HASH
--   KEYS[3] waiters HASH
--   ARGV[1] "<deadlines key>\n<waiter>"
-- Returns {record, copy}, or an empty list when the waiter has no record (not a parked task, or
-- somebody took it first).

local record = redis.call('HGET', KEYS[3], ARGV[1])
if not record then
  return {}
end
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('ZREM', KEYS[1], record) == 0 then
  return {}
end
local copy = redis.call('HGET', KEYS[2], record) or ''
redis.call('HDEL', KEYS[2], record)
return {record, copy}
