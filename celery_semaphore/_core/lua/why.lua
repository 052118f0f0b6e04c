-- why: a read-only look at where one waiter or holder stands on one semaphore, for "semaphore
-- why TASK_ID". Writes nothing (lapsed entries are filtered, not purged). One round trip; the
-- work is O(log n) in the line (ZRANK, ZSCORE, ZCOUNT) plus bounded listings, whatever the
-- length of the line. The holders are scanned for the task's tokens: that costs O(holders),
-- which the limit bounds, never O(waiters).
--   KEYS    the semaphore keys KEYS[1..10] (see _lib.lua)
--   ARGV[1] waiter   the waiter id to look for
--   ARGV[2] tokens   a ZSCAN MATCH pattern of the holder tokens to look for ("<task key>:*")
--   ARGV[3] rules    the rules given in code (see rules_in_force in _lib.lua)
--   ARGV[4] most     at most this many holders and waiters ahead are listed
-- Returns {now_ms, held, place, counts, gate, hold_ms, holders, ahead}:
--   held     flat list: token, lease deadline ms, "<granted ms>|<label>" (or ""), of the tokens
--            matching ARGV[2] (extra slots of a weighted holder left out)
--   place    {} when not in line (or its place lapsed); else {rank, ticket, must-ask-by ms,
--            "<first ask ms>|<wake address>" (or ""), present (1/0), offer claim deadline ms
--            (0: no offer), its tenant as kept under a cap ("" for none), that tenant's live
--            slots}
--   counts   {live holders, live offers, live waiters, limit in force, per tenant cap (0: none)}
--   gate     {paused ms left, spacing ms left, rate ms left, rate count, rate ms, spacing ms}
--   hold_ms  the moving average of hold times, or -1
--   holders  flat list: token, lease deadline ms, "<granted ms>|<label>", the first ARGV[4] live
--            holders by lease deadline
--   ahead    flat list: waiter id, ticket, of the (at most ARGV[4]) waiters just ahead of it

local waiter, tokens, most = ARGV[1], ARGV[2], tonumber(ARGV[4])
local now = now_ms()
local above, below = string.format('(%.0f', now), string.format('(%.0f', -now)

local held = {}
local cursor = '0'
repeat
  local page = redis.call('ZSCAN', K_HOLDERS, cursor, 'MATCH', tokens, 'COUNT', 100)
  cursor = page[1]
  for i = 1, #page[2], 2 do
    local token, deadline = page[2][i], tonumber(page[2][i + 1])
    if deadline > now and not string.find(token, '%*%d+' .. EXTRA_SLOT_MARK .. '%d+$') then
      held[#held + 1] = token
      held[#held + 1] = deadline
      held[#held + 1] = redis.call('HGET', K_HOLDER_INFO, HOLDER_FIELD .. token) or ''
    end
  end
until cursor == '0'

local r = rules_in_force(ARGV[3] or '1', now)

-- a tenant's live slots under a cap, as held_count counts them, without its clean-up (read-only)
local function live_slots(tenant)
  local listed = redis.call('HGET', K_HOLDER_INFO, HELD_FIELD .. tenant)
  local live = 0
  for _, entry in ipairs(listed and cjson.decode(listed) or {}) do
    local score = tonumber(redis.call('ZSCORE', K_HOLDERS, entry))
    if score and (score > now or score < -now) then
      live = live + 1
    end
  end
  return live
end

local place = {}
local rank = redis.call('ZRANK', K_QUEUE, waiter)
local must_ask_by = tonumber(redis.call('ZSCORE', K_DEADLINES, waiter))
if rank and must_ask_by and must_ask_by > now then
  local offer = tonumber(redis.call('ZSCORE', K_HOLDERS, OFFER_MARK .. waiter))
  local tenant = r.per_tenant > 0 and tenant_of(waiter) or ''
  place = {rank, redis.call('ZSCORE', K_QUEUE, waiter), must_ask_by,
           redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or '',
           redis.call('ZSCORE', K_PRESENT, waiter) and 1 or 0,
           (offer and -offer > now) and -offer or 0, tenant, tenant ~= '' and live_slots(tenant) or 0}
end
local paused_left = r.paused_until > now and r.paused_until - now or 0
local spacing_left, rate_left = 0, 0
if r.spacing_ms > 0 then
  local last = tonumber(redis.call('LINDEX', K_STARTS, 0))
  if last and last + r.spacing_ms > now then
    spacing_left = last + r.spacing_ms - now
  end
end
if r.rate_n > 0 then
  local oldest = tonumber(redis.call('LINDEX', K_STARTS, r.rate_n - 1))
  if oldest and oldest + r.rate_ms > now then
    rate_left = oldest + r.rate_ms - now
  end
end

local holders = listed_holders(above, most)

local ahead = {}
if rank and rank > 0 and most > 0 then
  ahead = redis.call('ZRANGE', K_QUEUE, math.max(0, rank - most), rank - 1, 'WITHSCORES')
end

return {now, held, place,
        {redis.call('ZCOUNT', K_HOLDERS, above, '+inf'), redis.call('ZCOUNT', K_HOLDERS, '-inf', below),
         redis.call('ZCOUNT', K_DEADLINES, above, '+inf'), r.limit, r.per_tenant},
        {paused_left, spacing_left, rate_left, r.rate_n, r.rate_ms, r.spacing_ms},
        tonumber(redis.call('HGET', K_WAITER_INFO, HOLD_FIELD)) or -1, holders, ahead}
