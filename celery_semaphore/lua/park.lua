-- park: keep a parked Celery task's wake copy in Redis, so that a sweep in any worker process
-- can send it again when no copy of its wait asked in time: its backstop copy was lost with the
-- worker that parked it (see _parking.py). One record per wait; parking again moves it on.
--   KEYS[1] due     ZSET  record -> when a sweep looks at it (server ms)
--   KEYS[2] copies  HASH  record -> the wake copy, serialized as the task's messages are
--   ARGV[1] record  the wait, as _parking.py names it (its line's keys, waiter and run)
--   ARGV[2] look_in_ms
--   ARGV[3] copy    "" to forget the record (the wait was given up)
--   ARGV[4] mode    "" (or left out): keep the record, moved on if it exists; "nx": keep it only
--                   if it does not exist (a sweep putting back a record it took, due later,
--                   never overwrites the newer copy of a task that parked again meanwhile)
-- Returns 1, or 0 when "nx" found the record there. Both keys expire once the last record is due
-- (plus a grace), unless swept before.

local record, copy = ARGV[1], ARGV[3]
if copy == '' then
  redis.call('ZREM', KEYS[1], record)
  redis.call('HDEL', KEYS[2], record)
  return 1
end
local ttl_ms = tonumber(ARGV[2]) + GRACE_MS
if ARGV[4] == 'nx' then
  if redis.call('ZADD', KEYS[1], 'NX', now_ms() + tonumber(ARGV[2]), record) == 0 then
    return 0
  end
else
  redis.call('ZADD', KEYS[1], now_ms() + tonumber(ARGV[2]), record)
end
redis.call('HSET', KEYS[2], record, copy)
extend(KEYS[1], ttl_ms, false)
extend(KEYS[2], ttl_ms, false)
return 1
