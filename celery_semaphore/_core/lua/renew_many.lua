-- renew_many: extend the leases of acquire_many grants on every one of their semaphores.
--   KEYS    10 per semaphore (see acquire_many)
--   ARGV[1] lease_ms  new lease length, counted from now
--   ARGV[2] reclaim   "1": a grant found missing on some semaphore (Redis restarted empty, or
--                     the lease ran out in a stall) is registered again if every semaphore has
--                     room for its weight; "0": never
--   ARGV[3] n         the number of semaphores
--   ARGV[4..3+n]      each semaphore's rules where no runtime override is stored
--   then triples of (token, label, run): run is "" or the run id the token was granted for (see
--   acquire_many); a renewed token's run record lives as long as its lease (see keep_run). Only
--   if some run is not "": KEYS[10n+1] and KEYS[10n+2], the first semaphore's run records
-- Returns one code per token, in order: RENEW_RENEWED, RENEW_REGISTERED_AGAIN or RENEW_LOST;
-- then the waiters offered a slot whose wake-up nobody heard (see notify in _lib.lua).

local lease_ms = tonumber(ARGV[1])
local reclaim = ARGV[2] == '1'
local n = tonumber(ARGV[3])
local now = now_ms()
local limits = {}
for i = 1, n do
  use_semaphore(i)
  purge(now)
  limits[i] = rules_in_force(ARGV[3 + i], now)
end
if #KEYS > 10 * n then
  K_RUNS, K_RUN_EXPIRY = KEYS[10 * n + 1], KEYS[10 * n + 2]
end
local codes = {}
for p = 4 + n, #ARGV, 3 do
  local token, label, run = ARGV[p], ARGV[p + 1], ARGV[p + 2]
  local members = slot_members(token)
  local held, room = true, true
  for i = 1, n do
    use_semaphore(i)
    if not redis.call('ZSCORE', K_HOLDERS, token) then
      held = false
      if redis.call('ZCARD', K_HOLDERS) + #members > limits[i].limit then
        room = false
      end
    end
  end
  local code = RENEW_LOST
  if held then
    code = RENEW_RENEWED
  elseif reclaim and room then
    code = RENEW_REGISTERED_AGAIN
  end
  if code ~= RENEW_LOST then
    for i = 1, n do
      use_semaphore(i)
      local entries = {}
      for k = 1, #members do
        entries[#entries + 1] = now + lease_ms
        entries[#entries + 1] = members[k]
      end
      -- GT never shortens a longer lease; a missing entry is added
      redis.call('ZADD', K_HOLDERS, 'GT', unpack(entries))
      if code == RENEW_REGISTERED_AGAIN then
        redis.call('HSET', K_HOLDER_INFO, HOLDER_FIELD .. token, now .. INFO_SEPARATOR .. label)
      end
      extend(K_HOLDERS, lease_ms + GRACE_MS, false)
      extend(K_HOLDER_INFO, lease_ms + GRACE_MS, false)
    end
  end
  answer_renewal(codes, code, run, token, now, lease_ms)
end
-- the purge above may have freed slots: hand them on
for i = 1, n do
  use_semaphore(i)
  if redis.call('ZCARD', K_PRESENT) > 0 then
    hand_off(now, limits[i], nil)
  end
end
for i = 1, #to_wake do
  codes[#codes + 1] = to_wake[i]
end
return codes
