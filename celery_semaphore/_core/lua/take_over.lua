-- take_over: a worker instance starting under a node name takes over an instance recorded under
-- it that has gone silent, atomically: only if its last beat is still older than stale_ms (an
-- instance that beat meanwhile keeps its record, its index and its slots).
--   KEYS[1] node      HASH  instance id -> "<last beat ms>|<where>" (see beat)
--   KEYS[2] held      HASH  the silent instance's index: "<semaphore base>" -> "<rules>", every
--                           semaphore its processes asked for a slot of (the holders to look at)
--   ARGV[1] instance  the id of the instance to take over
--   ARGV[2] stale_ms  how long without a beat makes an instance silent
-- Returns {INSTANCE_GONE} when the name records no such instance (taken over already, or its
-- record expired); {INSTANCE_BEATING, ms since its last beat} when it beat within stale_ms;
-- {INSTANCE_TAKEN, base, rules, base, rules, ...} when it was taken over: its record and its index
-- are gone, and the caller gives back its holders on those semaphores.

local value = redis.call('HGET', KEYS[1], ARGV[1])
if not value then
  return {INSTANCE_GONE}
end
local silent_ms = now_ms() - tonumber(string.match(value, '^(%d+)'))
if silent_ms <= tonumber(ARGV[2]) then
  return {INSTANCE_BEATING, silent_ms}
end
redis.call('HDEL', KEYS[1], ARGV[1])
local held = redis.call('HGETALL', KEYS[2])
redis.call('DEL', KEYS[2])
return {INSTANCE_TAKEN, unpack(held)}
