-- acquire: one try for a slot, fair by ticket order.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] wake-up channel
--   ARGV[2] token     the holder token this try would hold the slot under
--   ARGV[3] waiter    the waiter id that keeps its place in line across tries (a task id)
--   ARGV[4] limit     the limit to apply when no runtime override is stored
--   ARGV[5] lease_ms  lease length for a granted slot
--   ARGV[6] patience_ms  how long a refused waiter keeps its place without asking again
--   ARGV[7] enqueue   "1": a new waiter takes a ticket; "0": a one-shot try that never queues
--                     and is granted only if it would not pass any present waiter
--   ARGV[8] label     free text shown by status for this holder (host, pid, task id)
--   ARGV[9] ticket    "" for a new waiter; or the ticket it was given before, so a waiter that
--                     left the line while away (a Celery countdown) comes back to its old place
-- Tickets are server time (ms) * 1024 plus a counter (mod 1024) for ties: ordered by first ask,
-- and still ordered after the counter key expired with an idle semaphore. A float holds them
-- exactly (below 2^53).
-- Returns {granted, position, free, limit, hold, ticket, turn}:
--   granted  1 = the slot is held under token (also when token already held it: idempotent,
--            so a resend by redis-py after a connection error is harmless); 0 = wait
--   position the waiter's 0-based place in line, away waiters included (0 when granted);
--            slots go by place among present waiters, so an away waiter ahead delays nobody
--   free     free slots after this call
--   limit    the limit in force (override or ARGV[4])
--   hold     moving average of recent hold times in ms, or -1 while none is known
--   ticket   the waiter's ticket (as a string; "" when granted without queueing)
--   turn     the waiter's 0-based place among present waiters: slots go by this

local token, waiter = ARGV[2], ARGV[3]
local lease_ms, patience_ms = tonumber(ARGV[5]), tonumber(ARGV[6])

local now = now_ms()
local dropped = purge(now)
local limit = current_limit(tonumber(ARGV[4]))
local hold = tonumber(redis.call('HGET', K_SINCE, 'hold')) or -1

if redis.call('ZSCORE', K_HOLDERS, token) then
  redis.call('ZADD', K_HOLDERS, 'GT', now + lease_ms, token)
  touch()
  return {1, 0, limit - redis.call('ZCARD', K_HOLDERS), limit, hold, '', 0}
end

local free = limit - redis.call('ZCARD', K_HOLDERS)
local rank = redis.call('ZRANK', K_QUEUE, waiter)
local queued = rank ~= false
if not queued and ARGV[7] == '1' then
  local ticket = tonumber(ARGV[9])
  if not ticket then
    ticket = now * 1024 + redis.call('INCR', K_TICKET) % 1024
  end
  redis.call('ZADD', K_QUEUE, ticket, waiter)
  redis.call('HSET', K_SINCE, 'w:' .. waiter, now)
  queued = true
end
local turn
if queued then
  redis.call('ZADD', K_PRESENT, redis.call('ZSCORE', K_QUEUE, waiter), waiter)
  rank = redis.call('ZRANK', K_QUEUE, waiter)
  turn = redis.call('ZRANK', K_PRESENT, waiter)
else
  rank = redis.call('ZCARD', K_QUEUE)
  turn = redis.call('ZCARD', K_PRESENT)
end

if turn < free then
  redis.call('ZADD', K_HOLDERS, now + lease_ms, token)
  redis.call('HSET', K_SINCE, 'h:' .. token, now .. '|' .. ARGV[8])
  if queued then
    drop_waiter(waiter)
  end
  if dropped > 0 then
    wake()
  end
  touch()
  return {1, 0, free - 1, limit, hold, '', 0}
end

local ticket = ''
if queued then
  redis.call('ZADD', K_SEEN, now + patience_ms, waiter)
  ticket = redis.call('ZSCORE', K_QUEUE, waiter)
end
if dropped > 0 then
  wake()
end
touch()
return {0, rank, free, limit, hold, ticket, turn}
