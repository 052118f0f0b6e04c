-- stow_copy: on the Redis broker, keep a waiting task's due-later copy, packed by its sender
-- (_celery/packing.py), in the store move_due_copies.lua moves it from when due: one atomic
-- step, so that a sender killed at any point has stored the copy or has not sent it.
--   KEYS[1] due       ZSET  copy id -> when it is due (this server's ms), in buckets
--                     (_due_buckets.lua)
--   KEYS[2] copies    HASH  copy id -> "<target list key>\n\1<stencil digest>\0<fills>"
--   KEYS[3] finished  ZSET  run id -> until when it is remembered as finished
--   KEYS[4] moved     ZSET  copy id -> when it was moved to its queue (see move_due_copies.lua)
--   KEYS[5] sent      HASH  copy id -> what was moved
--   KEYS[6] stencils  HASH  stencil digest -> stencil
--   KEYS[7] kept      ZSET  stencil digest -> until when it is kept (this server's ms)
--   ARGV[1] id        the copy's id (its wait's run)
--   ARGV[2] due_in_ms
--   ARGV[3] target    the list it goes to
--   ARGV[4] digest, ARGV[5] stencil, ARGV[6] fills (joined by "\0")
--   ARGV[7] stencil_keep_ms how long a stencil outlives the copies that name it
--   ARGV[8] keep_ms   how long a moved copy is kept (see move_due_copies.lua)
-- A copy due now is moved to its queue at once, as move_due_copies.lua moves it.
-- Returns 1 stored, 2 moved, 0 dropped: its run finished (a copy of it ran).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local finished = redis.call('ZSCORE', KEYS[3], id)
redis.call('ZREM', KEYS[4], id)
redis.call('HDEL', KEYS[5], id)
if finished and tonumber(finished) > now then
  return 0
end
local due_at = now + math.max(0, math.floor(tonumber(ARGV[2])))
redis.call('HSETNX', KEYS[6], ARGV[4], ARGV[5])
redis.call('ZADD', KEYS[7], 'GT', due_at + tonumber(ARGV[7]), ARGV[4])  -- GT still adds a new member
local stored = ARGV[3] .. '\n\1' .. ARGV[4] .. '\0' .. ARGV[6]
local target, message
if due_at <= now then
  target, message = stored_message(stored, KEYS[6], id, t[1] .. '.' .. t[2])
end
if not message then  -- due later (or, never seen, one that does not read back: stored, as a move finds it)
  set_due(KEYS[1], due_at, id)
  redis.call('HSET', KEYS[2], id, stored)
  return 1
end
unset_due(KEYS[1], id)
redis.call('HDEL', KEYS[2], id)
redis.call('LPUSH', target, message)
if string.sub(id, 1, 1) ~= '?' then  -- a copy with no run: nothing would ever ask for it
  redis.call('ZADD', KEYS[4], now, id)
  redis.call('HSET', KEYS[5], id, stored)
  redis.call('ZADD', KEYS[7], 'GT', now + tonumber(ARGV[8]) + tonumber(ARGV[7]), ARGV[4])
end
return 2
