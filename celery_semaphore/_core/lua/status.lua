-- status: a read-only snapshot of one semaphore, for the CLI and metrics. Writes nothing, so
-- lapsed entries are filtered here rather than purged. Counts are exact and O(log n) (ZCOUNT
-- by deadline); listings stop at ARGV[1] entries.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] at most this many holders and waiters are listed (0: counts only)
--   ARGV[2] rules  the rules given in code (see rules_in_force in _lib.lua)
-- Returns {now_ms, override or false, override_ttl_ms, holder_count, offered_count,
--          waiter_count, holders, waiters, gate}:
--   override_ttl_ms  ms the override has left; -1 kept until cleared; -2 no override
--   holder_count     live leases (offers not included)
--   offered_count    slots offered to waiters and not claimed yet (they count as taken)
--   waiter_count     waiters whose place has not lapsed, present, away or offered
--   holders  flat list: token, lease deadline ms, "<granted ms>|<label>" (or "")
--   waiters  flat list: waiter id, ticket, must-ask-by ms, first-ask ms (or ""),
--            state (PRESENT, AWAY, or OFFERED a slot); in line order
--   gate     {rate count, rate ms, spacing ms, paused ms left (0: not paused), ms until the
--            next start is allowed (0: now), starts in the rate's current window, the gate
--            override as stored or false}

local most = tonumber(ARGV[1])
local now = now_ms()
local above, below = string.format('(%.0f', now), string.format('(%.0f', -now)

local holders = most > 0 and listed_holders(above, most) or {}

local waiters = {}
-- offers are few (at most the limit): look for one per waiter only if there is any
local any_offer = most > 0 and redis.call('ZCOUNT', K_HOLDERS, '-inf', below) > 0
if most > 0 then
  local line = redis.call('ZRANGE', K_QUEUE, 0, most - 1, 'WITHSCORES')
  for i = 1, #line, 2 do
    local waiter = line[i]
    local must_ask_by = redis.call('ZSCORE', K_DEADLINES, waiter)
    if must_ask_by and tonumber(must_ask_by) > now then
      local state = AWAY
      local offer = any_offer and redis.call('ZSCORE', K_HOLDERS, OFFER_MARK .. waiter)
      if offer and -tonumber(offer) > now then
        state = OFFERED
      elseif redis.call('ZSCORE', K_PRESENT, waiter) then
        state = PRESENT
      end
      local info = redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or ''
      waiters[#waiters + 1] = waiter
      waiters[#waiters + 1] = line[i + 1]
      waiters[#waiters + 1] = must_ask_by
      waiters[#waiters + 1] = string.match(info, '^(%d*)') or ''
      waiters[#waiters + 1] = state
    end
  end
end

local r = rules_in_force(ARGV[2] or '1', now)
local in_window = 0
if r.rate_n > 0 then
  for _, started in ipairs(redis.call('LRANGE', K_STARTS, 0, r.rate_n - 1)) do
    if tonumber(started) > now - r.rate_ms then
      in_window = in_window + 1
    end
  end
end
local gate = {r.rate_n, r.rate_ms, r.spacing_ms, r.paused_until > now and r.paused_until - now or 0,
              r.gated and gate_wait(r, now, 1) or 0, in_window, redis.call('GET', K_GATE) or false}

return {now, redis.call('GET', K_LIMIT) or false, redis.call('PTTL', K_LIMIT),
        redis.call('ZCOUNT', K_HOLDERS, above, '+inf'), redis.call('ZCOUNT', K_HOLDERS, '-inf', below),
        redis.call('ZCOUNT', K_DEADLINES, above, '+inf'), holders, waiters, gate}
