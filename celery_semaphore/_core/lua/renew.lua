-- renew: extend the leases of several holders of one semaphore in one round trip.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] lease_ms  new lease length, counted from now
--   ARGV[2] rules     the rules to apply where no runtime override is stored (see rules_in_force)
--   ARGV[3] reclaim   "1": a token found missing (Redis restarted empty, or the lease ran out
--                     during a stall while the holder kept running) is registered again if a
--                     slot is free; "0": never
--   ARGV[4], ARGV[5], ... triples of (token, label, run): run is "" or the run id the token was
--                     granted for (see acquire); a renewed token's run record lives as long as
--                     its lease (see keep_run). KEYS[11..12] are passed only if some run is not ""
-- Returns one code per token, in order: RENEW_RENEWED, RENEW_REGISTERED_AGAIN, or RENEW_LOST (no
-- free slot); then the waiters offered a slot whose wake-up nobody heard (see notify in _lib.lua).
-- A token still in KEYS[1] counts as held even if its deadline passed and no purge removed it
-- yet: nobody else was given its slot meanwhile.

local lease_ms = tonumber(ARGV[1])
local reclaim = ARGV[3] == '1'
local now = now_ms()
purge(now)
local r = rules_in_force(ARGV[2], now)
local limit = r.limit
local was_empty = redis.call('ZCARD', K_HOLDERS) == 0
local codes = {}
local changed = false
for i = 4, #ARGV, 3 do
  local token, run = ARGV[i], ARGV[i + 2]
  local code = RENEW_LOST
  if redis.call('ZSCORE', K_HOLDERS, token) then
    redis.call('ZADD', K_HOLDERS, 'GT', now + lease_ms, token)
    code = RENEW_RENEWED
  elseif reclaim and redis.call('ZCARD', K_HOLDERS) < limit then
    redis.call('ZADD', K_HOLDERS, now + lease_ms, token)
    redis.call('HSET', K_HOLDER_INFO, HOLDER_FIELD .. token, now .. INFO_SEPARATOR .. ARGV[i + 1])
    code = RENEW_REGISTERED_AGAIN
  end
  if code ~= RENEW_LOST then
    changed = true
  end
  answer_renewal(codes, code, run, token, now, lease_ms)
end
if changed then
  extend(K_HOLDERS, lease_ms + GRACE_MS, was_empty)
  extend(K_HOLDER_INFO, lease_ms + GRACE_MS, false)
end
-- the purge above may have freed slots (a crashed holder's lease ran out): hand them on
if redis.call('ZCARD', K_PRESENT) > 0 then
  hand_off(now, r, nil)
end
for i = 1, #to_wake do
  codes[#codes + 1] = to_wake[i]
end
return codes
