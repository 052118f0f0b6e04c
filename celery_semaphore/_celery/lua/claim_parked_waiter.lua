-- claim_parked_waiter: take the parked-task record of one waiter, now, whatever its due time:
-- the waiter was offered a slot and its wake copy is to be sent (by the process that made the
-- offer, or the parked task's own, _parking.wake_offered). One taker. The record is leased, not
-- dropped: due again after the lease, its copy marked as woken, so that a sweep sends the copy
-- again should the one sent now be lost in flight before its run is granted.
--   KEYS[1] due     ZSET  (see park.lua)
--   KEYS[2] copies  HASH
--   KEYS[3] waiters HASH
--   ARGV[1] "<deadlines key>\n<waiter>"
--   ARGV[2] lease_ms
-- Returns {record, copy}, or an empty list when the waiter has no record (not a parked task, or
-- somebody took it first).

local record = redis.call('HGET', KEYS[3], ARGV[1])
if not record then
  return {}
end
redis.call('HDEL', KEYS[3], ARGV[1])
local copy = redis.call('HGET', KEYS[2], record)
if not redis.call('ZSCORE', KEYS[1], record) or not copy then
  redis.call('ZREM', KEYS[1], record)
  redis.call('HDEL', KEYS[2], record)
  return {}
end
local lease_ms = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms() + lease_ms, record)
local marked = string.sub(copy, 1, #WOKEN_COPY_MARK) == WOKEN_COPY_MARK
if marked then
  copy = string.sub(copy, #WOKEN_COPY_MARK + 1)
else
  redis.call('HSET', KEYS[2], record, WOKEN_COPY_MARK .. copy)
end
extend_exactly(KEYS[1], lease_ms + SWEEP_GRACE_MS)
extend_exactly(KEYS[2], lease_ms + SWEEP_GRACE_MS)
return {record, copy}
