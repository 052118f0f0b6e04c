-- park: keep a parked Celery task's wake copy in Redis, so that a sweep in any worker process
-- can send it again when no copy of its wait asked in time: its backstop copy was lost with the
-- worker that parked it (see _celery/parking.py). One record per wait; parking again moves it on.
--   KEYS[1] due      ZSET  record -> when a sweep looks at it (server ms)
--   KEYS[2] copies   HASH  record -> the wake copy, serialized as the task's messages are
--   KEYS[3] waiters  HASH  "<deadlines key>\n<waiter>" -> record: how a process that offered
--                          the waiter a slot nobody heard finds its copy (claim_parked_waiter)
--   KEYS[4] lines    ZSET  "[<line base>, <limit>]" -> until when it has parked waiters: the
--                          lines a tick looks at (tick.lua), since no script may run on a line
--                          whose waiters are all parked
--   ARGV[1] record  the wait, as _celery/parking.py names it: JSON [deadlines key, runs key, waiter,
--                   run, name]
--   ARGV[2] look_in_ms
--   ARGV[3] copy    "" to forget the record (the wait was given up)
--   ARGV[4] mode    "" (or left out): keep the record, moved on if it exists; "nx": keep it only
--                   if it does not exist (a sweep putting back a record it took, due later,
--                   never overwrites the newer copy of a task that parked again meanwhile)
--   ARGV[5] line    "" (or left out) or the line's member of KEYS[4]
-- Returns 1, or 0 when "nx" found the record there. The keys expire once the last record is due
-- (plus a grace), unless swept before.

local record, copy = ARGV[1], ARGV[3]
local ok, fields = pcall(cjson.decode, record)
local by_waiter = ok and type(fields) == 'table' and fields[1] and fields[3]
  and (fields[1] .. RECORD_SEPARATOR .. fields[3])
if copy == '' then
  redis.call('ZREM', KEYS[1], record)
  redis.call('HDEL', KEYS[2], record)
  if by_waiter and redis.call('HGET', KEYS[3], by_waiter) == record then
    redis.call('HDEL', KEYS[3], by_waiter)
  end
  return 1
end
local now = now_ms()
local due_at = now + tonumber(ARGV[2])
local ttl_ms = tonumber(ARGV[2]) + SWEEP_GRACE_MS
if ARGV[4] == 'nx' then
  if redis.call('ZADD', KEYS[1], 'NX', due_at, record) == 0 then
    return 0
  end
else
  redis.call('ZADD', KEYS[1], due_at, record)
end
redis.call('HSET', KEYS[2], record, copy)
if by_waiter then
  redis.call('HSET', KEYS[3], by_waiter, record)
end
extend_exactly(KEYS[1], ttl_ms)
extend_exactly(KEYS[2], ttl_ms)
extend_exactly(KEYS[3], ttl_ms)
local line = ARGV[5] or ''
if line ~= '' then
  redis.call('ZADD', KEYS[4], 'GT', due_at, line)  -- GT still adds a new member
  extend_exactly(KEYS[4], ttl_ms)
end
return 1
