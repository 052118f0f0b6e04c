-- renew: extend the leases of several holders of one semaphore in one round trip.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] wake-up channel
--   ARGV[2] lease_ms  new lease length, counted from now
--   ARGV[3] limit     the limit to apply when no runtime override is stored
--   ARGV[4] reclaim   "1": a token found missing (Redis restarted empty, or the lease ran out
--                     during a stall while the holder kept running) is registered again if a
--                     slot is free; "0": never
--   ARGV[5], ARGV[6], ... pairs of (token, label)
-- Returns one code per token, in order: 1 renewed, 2 registered again, 0 lost (no free slot).

local lease_ms = tonumber(ARGV[2])
local reclaim = ARGV[4] == '1'
local now = now_ms()
local dropped = purge(now)
local limit = current_limit(tonumber(ARGV[3]))
local codes = {}
for i = 5, #ARGV, 2 do
  local token = ARGV[i]
  if redis.call('ZSCORE', K_HOLDERS, token) then
    redis.call('ZADD', K_HOLDERS, 'GT', now + lease_ms, token)
    codes[#codes + 1] = 1
  elseif reclaim and redis.call('ZCARD', K_HOLDERS) < limit then
    redis.call('ZADD', K_HOLDERS, now + lease_ms, token)
    redis.call('HSET', K_SINCE, 'h:' .. token, now .. '|' .. ARGV[i + 1])
    codes[#codes + 1] = 2
  else
    codes[#codes + 1] = 0
  end
end
if dropped > 0 then
  wake()
end
touch()
return codes
