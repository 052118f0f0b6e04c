-- leave_many: an acquire_many waiter steps out of every line it stands in, or steps away.
--   KEYS    10 per semaphore (see acquire_many)
--   ARGV[1] waiter id
--   ARGV[2] n       the number of semaphores
--   ARGV[3..2+n]    each semaphore's rules where no runtime override is stored (for the hand-off)
--   ARGV[3+n] away_ms  "" (or left out) to give up its places; or how long it will be away (a
--                   Celery countdown): it keeps its places, and must ask again within away_ms
--   ARGV[4+n] wake  with away_ms: "" to be passed by while away; or a wake address, to stay
--                   *parked*: it keeps heading the lines it heads, and is told on that address
--                   when its weight fits one of them (it then asks; see hand_off in _lib.lua)
-- Returns 1 if the waiter stood in some line, 0 if not; {1 or 0, to_wake...} when a hand-off
-- told waiters whom the caller wakes (see notify in _lib.lua). Safe to repeat.

local waiter = ARGV[1]
local n = tonumber(ARGV[2])
local away_ms = tonumber(ARGV[3 + n])
local wake = ARGV[4 + n] or ''
local was_in_line = 0
local now = now_ms()
for i = 1, n do
  use_semaphore(i)
  local ticket = redis.call('ZSCORE', K_QUEUE, waiter)
  if away_ms and ticket then
    was_in_line = 1
    redis.call('ZADD', K_DEADLINES, now + away_ms, waiter)
    if wake ~= '' then
      local info = redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or ''
      redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter,
                 (string.match(info, '^(%d+)') or now) .. INFO_SEPARATOR .. PARKED_MARK .. stored_address(wake))
      redis.call('ZADD', K_PRESENT, ticket, waiter)
    else
      redis.call('ZREM', K_PRESENT, waiter)
    end
    extend_line(away_ms + GRACE_MS)
  elseif drop_waiter(waiter) == 1 then
    was_in_line = 1
  end
  -- it may have headed this line: those behind it move up; or, parking, it is told at once if
  -- its weight fits now (a release between its refusal and this park told an address nobody
  -- listened on yet, and nothing else would tell it again before its backstop)
  if redis.call('ZCARD', K_PRESENT) > 0 then
    hand_off(now, rules_in_force(ARGV[2 + i], now), nil)
  end
end
if #to_wake > 0 then
  return {was_in_line, unpack(to_wake)}
end
return was_in_line
