-- leave: a waiter steps out of line, so it never blocks the waiters behind it.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] waiter id
--   ARGV[2] away_ms  "" to give up the place (timeout, max wait, revoke); or how long the
--                    waiter will be away (a Celery countdown): it keeps its place and shows in
--                    status, but slots pass it by until it asks again, within away_ms
--   ARGV[3] rules    the rules to apply where no runtime override is stored (for the hand-off)
--   ARGV[4] wake     with away_ms: "" to be passed by while away; or a wake address, to stay
--                    *parked*: offered its turn like a present waiter, the offer told on that
--                    address (a Celery worker that sends the task back at once)
-- Returns 1 if the waiter was in line (or held an offer), 0 if not; followed by the waiters whose
-- wake-up nobody heard, if any ({1, to_wake...}; see notify in _lib.lua). Safe to repeat.
-- A slot offered to a waiter that gives up or steps away unparked goes on to the next present
-- waiter at once; a parked waiter keeps its offer, and is returned to wake: its caller wakes it.

local waiter = ARGV[1]
local away_ms = tonumber(ARGV[2])
local wake = ARGV[4] or ''
local in_line = redis.call('ZSCORE', K_QUEUE, waiter)
local now
if away_ms and in_line and wake ~= '' then
  now = now_ms()
  local info = redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or ''
  redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter,
             (string.match(info, '^(%d+)') or now) .. INFO_SEPARATOR .. PARKED_MARK .. stored_address(wake))
  redis.call('ZADD', K_DEADLINES, now + away_ms, waiter)
  local offered = redis.call('ZSCORE', K_HOLDERS, OFFER_MARK .. waiter)
  if offered then
    -- offered already (between its refusal and this park), told where nobody listened: the
    -- caller, the parking process itself, sends its wake copy now, in the same call (a pool
    -- process recycled after this task would not live to hear a publish). Not a delayed offer,
    -- whose start a rate, a spacing or a pause holds off (its claim window opens later): woken
    -- now it would only be refused again; a resume or a looser rule tells it (set_gate), else
    -- its copy comes when the start opens
    if -tonumber(offered) - CLAIM_MS <= now then
      to_wake[#to_wake + 1] = waiter
    end
  else
    redis.call('ZADD', K_PRESENT, in_line, waiter)
    hand_off(now, rules_in_force(ARGV[3], now), nil)
  end
  extend_line(away_ms + GRACE_MS)
  return {1, unpack(to_wake)}
end
local had_offer = redis.call('ZREM', K_HOLDERS, OFFER_MARK .. waiter)
if away_ms and in_line then
  now = now_ms()
  redis.call('ZREM', K_PRESENT, waiter)
  redis.call('ZADD', K_DEADLINES, now + away_ms, waiter)
  extend_line(away_ms + GRACE_MS)
else
  drop_waiter(waiter)
end
if had_offer == 1 then
  now = now or now_ms()
  settle(now, rules_in_force(ARGV[3], now))
end
return {(in_line or had_offer == 1) and 1 or 0, unpack(to_wake)}
