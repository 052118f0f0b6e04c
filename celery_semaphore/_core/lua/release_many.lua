-- release_many: give back the slots of one acquire_many grant, on every semaphore, and hand
-- them on to the oldest present waiters.
--   KEYS    10 per semaphore (see acquire_many)
--   ARGV[1] token   as granted (its weight is written in it, see slot_members)
--   ARGV[2] n       the number of semaphores
--   ARGV[3..2+n]    each semaphore's rules where no runtime override is stored (for the hand-off)
--   ARGV[3+n] run   "" or the run id the slots were granted to: the release marks it finished
--                   (KEYS[10n+1], KEYS[10n+2]: the first semaphore's run records, see acquire_many)
--   ARGV[4+n] remember_ms  with a run: how long the finished run is remembered
-- Returns 1 if the token held slots of some semaphore and now holds none; 0 if they were
-- already gone everywhere; {1 or 0, to_wake...} when the hand-off told waiters whom the caller
-- wakes (parked, or nobody heard: see notify in _lib.lua). Safe to repeat.

local token = ARGV[1]
local n = tonumber(ARGV[2])
local members = slot_members(token)
local released = 0
local now = nil
local run, remember_ms = ARGV[3 + n] or '', tonumber(ARGV[4 + n])
if run ~= '' then
  K_RUNS, K_RUN_EXPIRY = KEYS[10 * n + 1], KEYS[10 * n + 2]
  now = now_ms()
  record_run(run, '', now, remember_ms)  -- finished: a later copy is told RAN
end
for i = 1, n do
  use_semaphore(i)
  if redis.call('ZREM', K_HOLDERS, unpack(members)) > 0 then
    released = 1
  end
  redis.call('HDEL', K_HOLDER_INFO, HOLDER_FIELD .. token)
  if redis.call('EXISTS', K_WAITER_INFO) == 0 then
    -- no line, and no bookkeeping of one: nothing to hand on or forget
  elseif redis.call('ZCARD', K_QUEUE) == 0 then
    forget_line_if_empty()
  else
    now = now or now_ms()
    settle(now, rules_in_force(ARGV[2 + i], now))
  end
end
if #to_wake > 0 then
  return {released, unpack(to_wake)}
end
return released
