-- lines_to_tick: the lines with parked waiters that a tick should look at now, for one worker
-- process of the deployment per round (the first to ask takes the round).
--   KEYS[1] lines  ZSET  (see park.lua)
--   KEYS[2] round  STRING held by the process that ticks this round
--   ARGV[1] round_ms  how long a round lasts
--   ARGV[2] most      lines to return at once
-- Returns the lines' members (JSON [line base, limit]), or an empty list when there are none or
-- another process has this round. With no parked waiter anywhere it writes nothing (one ZCARD):
-- an idle deployment stays without keys.

if redis.call('ZCARD', KEYS[1]) == 0 then
  return {}
end
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', tonumber(ARGV[1])) then
  return {}
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
