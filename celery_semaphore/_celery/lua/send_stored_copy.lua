-- send_stored_copy: on the Redis broker, a parked task's wake-up sends its stored backstop copy
-- now, to the queue it goes to when due (_celery/due_copies.py): the same message, so no second
-- copy of the task waits in the semaphore's Redis. The stored copy stays where it is, due when
-- it was, as the backstop it was: withdrawn as its run starts (or, with acks_late, finishes),
-- it comes back should the woken copy be lost with a worker.
--   KEYS[1] copies  HASH  copy id -> "<target list key>\n<message>", whole or packed (see
--                   move_due_copies.lua)
--   KEYS[2] sent    HASH  copy id -> a copy moved when due, kept until a copy of its run asks
--   KEYS[3] stencils HASH stencil digest -> stencil (_celery/packing.py)
--   KEYS[4], KEYS[5] the copies and the sent copies of the store of an earlier release (whole
--                   messages), looked in after these
--   ARGV[1] copy id  the wait's run
-- Returns 1: sent from the store; 2: sent from the copies kept as moved (the backstop came due
-- and its copy was lost in flight); 0: no copy of the run is kept (granted and withdrawn, or not
-- stowed yet); -1: its stencil is not kept (nothing sent: the stored copy is still the
-- backstop). A copy sent twice is dropped by its run; each copy sent has a delivery tag of its
-- own.

local stored, how
for i, key in ipairs({KEYS[1], KEYS[2], KEYS[4], KEYS[5]}) do
  stored = redis.call('HGET', key, ARGV[1])
  if stored then
    how = 2 - i % 2
    break
  end
end
if not stored then
  return 0
end
local t = redis.call('TIME')
local target, message = stored_message(stored, KEYS[3], ARGV[1], t[1] .. '.' .. t[2])
if not message then
  return -1
end
-- A delivery tag of its own: kombu's Redis transport keys its unacknowledged messages by the tag,
-- and the stored copy, sent on when due, keeps the one it was published with. Two deliveries
-- under one tag would share one entry there: the ack of one (a copy dropped as a twin) would
-- leave the other, still running, unrestorable should its worker die.
local tag_at = string.find(message, '"delivery_tag": "', 1, true)
if tag_at then
  local from = tag_at + string.len('"delivery_tag": "')
  local to = string.find(message, '"', from, true)
  if to then
    local own = ':w' .. t[1] .. '.' .. t[2]
    message = string.sub(message, 1, to - 1) .. own .. string.sub(message, to)
  end
end
redis.call('LPUSH', target, message)
return how
