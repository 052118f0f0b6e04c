-- beat: a worker instance says, in server time, that it is alive under its node name.
--   KEYS[1] node      HASH  instance id -> "<last beat ms>|<where>", one field per worker
--                           instance that ran under this node name and is not taken over yet
--   KEYS[2] held      HASH  the instance's index: semaphore base -> rules (see take_over)
--   ARGV[1] instance  the beating instance's id
--   ARGV[2] where     where it runs ("<boot id>/<pid namespace>/<pid>/<start time>"): a worker
--                     starting on the same host can tell from it whether the process still runs
--   ARGV[3] ttl_ms    how long both keys outlive this beat
-- Returns 1 if the instance was recorded under the name before this beat; 0 if the name was
-- recorded without it (it was taken over: another instance starting under the name found it
-- silent); 2 if the name was not recorded at all (the instance's first beat as the only one, or
-- the Redis lost its data: restarted empty, and the index with it).

local RECORDED, TAKEN_OVER, UNNAMED = 1, 0, 2  -- as _core/nodes.py names them
local now = now_ms()
local named = redis.call('EXISTS', KEYS[1])
local recorded = redis.call('HEXISTS', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], now .. INFO_SEPARATOR .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
if recorded == 1 then
  return RECORDED
end
if named == 0 then
  return UNNAMED
end
return TAKEN_OVER
