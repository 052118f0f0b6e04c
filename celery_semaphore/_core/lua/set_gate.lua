-- set_gate: store or clear one runtime rule of the gate (a rate, a spacing or a pause), then
-- hand on what the change allows at once: a resume or a looser rule lets the head of the line
-- start now, a pause or a tighter one moves its delayed offer to the new moment.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] kind   "r" rate, "s" spacing, "p" pause
--   ARGV[2] value  "" to clear the rule; a rate "<count>/<ms>"; a spacing "<ms>"; a pause "<ms>"
--                  (how long from now, server time; "0": until resumed)
--   ARGV[3] ttl_ms "" to keep a rate or a spacing until cleared; or its lifetime in ms
--   ARGV[4] rules  the rules given in code, which apply where no override is stored
-- Returns {limit, rate count, rate ms, spacing ms, paused ms left, to_wake...}: the rules in
-- force after the change (0 for none; -1 paused until resumed), then the waiters told here whom
-- the caller wakes (see notify in _lib.lua): a waiter whose start a pause held off parked until
-- then, and its process may be gone, so a resume must not rely on it hearing its turn.

local kind, value, ttl_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
-- until resumed: far enough that no deadline reaches it, near enough to stay an exact integer
local FOREVER_MS = 2 ^ 50

local kept, longest, forever = {}, 0, false
local stored = redis.call('GET', K_GATE)
if stored then
  for field in string.gmatch(stored, '[^;]+') do
    local field_kind, field_value, until_ms = string.match(field, '^(%a)=([%d/]+)@?(%d*)$')
    local ends = tonumber(until_ms ~= '' and until_ms or (field_kind == 'p' and field_value or ''))
    if field_kind and field_kind ~= kind and (ends == nil or ends > now) then
      kept[#kept + 1] = field
      if ends == nil then
        forever = true
      else
        longest = math.max(longest, ends)
      end
    end
  end
end
if value ~= '' then
  if kind == 'p' then
    local ends = tonumber(value) == 0 and FOREVER_MS or now + tonumber(value)
    kept[#kept + 1] = string.format('p=%.0f', ends)
    longest = math.max(longest, ends)
  elseif ttl_ms then
    kept[#kept + 1] = string.format('%s=%s@%.0f', kind, value, now + ttl_ms)
    longest = math.max(longest, now + ttl_ms)
  else
    kept[#kept + 1] = kind .. '=' .. value
    forever = true
  end
end
if #kept == 0 then
  redis.call('DEL', K_GATE)
else
  redis.call('SET', K_GATE, table.concat(kept, ';'))
  if not forever then
    redis.call('PEXPIREAT', K_GATE, string.format('%.0f', longest + GRACE_MS))
  end
end

local r = rules_in_force(ARGV[4], now)
-- an offer out was made under the old rules: under a resume or a looser rule its waiter may
-- claim at once, so it is told again (a tighter rule keeps it waiting when it asks)
local offers = redis.call('ZRANGEBYSCORE', K_HOLDERS, '-inf', string.format('(%.0f', -now))
for _, entry in ipairs(offers) do
  local waiter = string.sub(entry, 2)
  notify(wake_address(waiter), waiter)
end
settle(now, r)
local paused = 0
if r.paused_until > 0 then
  paused = r.paused_until >= FOREVER_MS and -1 or r.paused_until - now
end
return {r.limit, r.rate_n, r.rate_ms, r.spacing_ms, paused, unpack(to_wake)}
