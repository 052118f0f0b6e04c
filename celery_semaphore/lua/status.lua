-- status: a read-only snapshot of one semaphore, for the CLI and metrics. Writes nothing, so
-- expired entries are filtered here rather than purged.
--   KEYS    the semaphore keys (see _lib.lua; not prepended: this script writes nothing)
--   ARGV[1] at most this many holders and waiters are listed (counts are always exact)
-- Returns {now_ms, override or false, holder_count, waiter_count, holders, waiters, override_ttl_ms}:
--   holders  flat list: token, lease deadline ms, since value ("<granted ms>|<label>")
--   waiters  flat list: waiter id, ticket, must-ask-by ms, first-ask ms, present (1) or away (0);
--            in line order
--   override_ttl_ms  ms the override has left; -1 kept until cleared; -2 no override

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local most = tonumber(ARGV[1])
local override = redis.call('GET', KEYS[5])

local holders = {}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, most)
for i = 1, #live, 2 do
  holders[#holders + 1] = live[i]
  holders[#holders + 1] = live[i + 1]
  holders[#holders + 1] = redis.call('HGET', KEYS[6], 'h:' .. live[i]) or ''
end

local waiters = {}
local line = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
local listed = 0
local waiting = 0
for i = 1, #line, 2 do
  local seen = redis.call('ZSCORE', KEYS[3], line[i])
  if seen and tonumber(seen) > now then
    waiting = waiting + 1
    if listed < most then
      listed = listed + 1
      waiters[#waiters + 1] = line[i]
      waiters[#waiters + 1] = line[i + 1]
      waiters[#waiters + 1] = seen
      waiters[#waiters + 1] = redis.call('HGET', KEYS[6], 'w:' .. line[i]) or ''
      waiters[#waiters + 1] = redis.call('ZSCORE', KEYS[7], line[i]) and 1 or 0
    end
  end
end

return {now, override or false, redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf'), waiting, holders, waiters,
        redis.call('PTTL', KEYS[5])}
