-- release: give a slot back, and hand it to the oldest present waiter if there is one.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] token
--   ARGV[2] rules  the rules to apply where no runtime override is stored (for the hand-off;
--                  see rules_in_force in _lib.lua)
--   ARGV[3] run          "" or the run id the slot was granted to (see acquire): a release
--                        marks it finished, so that a later copy of it is dropped
--   ARGV[4] remember_ms  with a run: how long the finished run is remembered
--   ARGV[5] "1": the caller takes the records of the parked waiters this release offers the
--                slot, in the same round trip (the Celery layer's follower script): their
--                parking process is told so, not asked to take them (see notify in _lib.lua)
--   ARGV[3..5] may be left out when empty; KEYS[11..12] are passed only with a run
-- Returns 1 if token held a slot and now does not; 0 if its lease was already gone (expired,
-- released before, or never granted); {1, to_wake...} when the hand-off offered the slot to a
-- waiter whose wake-up nobody heard (see notify in _lib.lua). Safe to repeat.
-- When no line exists (KEYS[6] does not) this is three calls (ZREM, EXISTS, HDEL): no TIME, no
-- PUBLISH. Otherwise the release also folds the holder's hold time (server time) into the moving
-- average that refused tries report (KEYS[6] field "hold"), and with present waiters it hands
-- the slot on. (KEYS[6] outlives its line while holders remain, so that the average is still
-- known to the next line; it goes with the last holder.)

local token = ARGV[1]
caller_takes_parked = ARGV[5] == '1'
local run, remember_ms = ARGV[3] or '', tonumber(ARGV[4])
if run ~= '' then
  -- the run finished (also when its lease had lapsed meanwhile): a later copy is told RAN
  record_run(run, '', now_ms(), remember_ms)
end
if redis.call('ZREM', K_HOLDERS, token) == 0 then
  return 0
end
if redis.call('EXISTS', K_WAITER_INFO) == 0 then
  redis.call('HDEL', K_HOLDER_INFO, HOLDER_FIELD .. token)
  return 1
end

-- @rest-of-lib
local now = now_ms()
local info = redis.call('HGET', K_HOLDER_INFO, HOLDER_FIELD .. token)
redis.call('HDEL', K_HOLDER_INFO, HOLDER_FIELD .. token)
local granted = info and tonumber(string.match(info, '^(%d+)'))
if granted then
  local held = now - granted
  local average = tonumber(redis.call('HGET', K_WAITER_INFO, HOLD_FIELD))
  if average then
    held = math.floor(average * 0.8 + held * 0.2)
  end
  -- KEYS[6] exists and has its expiry: HSET keeps it
  redis.call('HSET', K_WAITER_INFO, HOLD_FIELD, held)
end
if redis.call('ZCARD', K_QUEUE) == 0 then
  forget_line_if_empty()
  return 1
end
settle(now, rules_in_force(ARGV[2], now))
if #to_wake > 0 then
  return {1, unpack(to_wake)}
end
return 1
