-- set_limit: store or clear the runtime limit override, and hand slots that a higher limit
-- frees to present waiters at once (one script: no MULTI with PUBLISH, which a cluster refuses).
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] override  the new limit, or "" to clear the override
--   ARGV[2] ttl_ms    "" to keep the override until cleared; or its lifetime in ms
--   ARGV[3] rules     the rules given in code, which apply where no override is stored
-- Returns the limit in force afterwards, followed by the waiters offered a slot whose wake-up
-- nobody heard, if any ({limit, to_wake...}; see notify in _lib.lua): its caller wakes them.

if ARGV[1] == '' then
  redis.call('DEL', K_LIMIT)
elseif ARGV[2] == '' then
  redis.call('SET', K_LIMIT, ARGV[1])
else
  redis.call('SET', K_LIMIT, ARGV[1], 'PX', ARGV[2])
end
local now = now_ms()
local r = rules_in_force(ARGV[3], now)
settle(now, r)
return {r.limit, unpack(to_wake)}
