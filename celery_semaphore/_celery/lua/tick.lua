-- tick: what a release would do, for a line whose waiters are all parked. A lease that lapsed
-- (its holder's worker was SIGKILLed) frees its slot only when some script purges it, and
-- parked waiters run none while they wait; a tick, once a second from one worker process of
-- the deployment (_celery/parking.py), purges one step and hands freed slots on.
--   KEYS    the semaphore keys (see _lib.lua), KEYS[1..10]
--   ARGV[1] rules  the rules to apply where no runtime override is stored (see rules_in_force)
-- Returns the waiters offered a slot whose wake-up nobody heard (see notify in _lib.lua).

local now = now_ms()
if redis.call('ZCARD', K_PRESENT) > 0 then
  settle(now, rules_in_force(ARGV[1], now))
else
  purge(now)
end
return to_wake
