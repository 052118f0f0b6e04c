-- Shared helpers. scripts.py puts this text in front of every script that changes a semaphore,
-- so each script still runs as one EVALSHA: one round trip, atomic, no lock around it.
--
-- Key schema (the same KEYS positions in every script; all keys of one semaphore share one
-- Redis Cluster hash tag, "{prefix}:{<key>}:..."):
--   KEYS[1] holders  ZSET  holder token -> lease deadline (server time, ms)
--   KEYS[2] queue    ZSET  waiter id -> ticket (first-ask server ms * 1024 + counter); rank = place in line
--   KEYS[3] seen     ZSET  waiter id -> deadline by which the waiter must ask again (ms)
--   KEYS[4] ticket   STRING the counter that orders tickets taken in the same millisecond (INCR)
--   KEYS[5] limit    STRING runtime limit override, if any
--   KEYS[6] since    HASH  "h:<token>" -> "<granted ms>|<label>", "w:<waiter>" -> "<first ask ms>",
--                         "hold" -> moving average of hold times (ms)
--   KEYS[7] present  ZSET  waiter id -> ticket, for waiters asking now (not away on a countdown):
--                         slots go to present waiters in ticket order; an away waiter keeps its
--                         place in KEYS[2] but holds up nobody until it is back
-- ARGV[1] is always the wake-up channel; PUBLISH on it tells blocked waiters to ask again.
--
-- Time is Redis server time only (TIME): client clocks never decide a deadline.

local K_HOLDERS, K_QUEUE, K_SEEN, K_TICKET, K_LIMIT, K_SINCE, K_PRESENT =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local CHANNEL = ARGV[1]
-- keys outlive the last deadline by this much, so a reader right at the deadline sees a
-- consistent set instead of half-expired keys
local GRACE_MS = 1000
-- how many members one HDEL/ZREM takes at once (Lua's unpack has a stack limit)
local CHUNK = 1000

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function remove_members(command, key, members, field_prefix)
  for first = 1, #members, CHUNK do
    local part = {}
    for i = first, math.min(first + CHUNK - 1, #members) do
      part[#part + 1] = field_prefix .. members[i]
    end
    redis.call(command, key, unpack(part))
  end
end

-- Drop holders whose lease deadline has passed and waiters that stopped asking in time.
-- Returns how many entries left, so the caller can wake waiters when slots or places opened.
local function purge(now)
  local dead = redis.call('ZRANGEBYSCORE', K_HOLDERS, '-inf', now)
  if #dead > 0 then
    redis.call('ZREMRANGEBYSCORE', K_HOLDERS, '-inf', now)
    remove_members('HDEL', K_SINCE, dead, 'h:')
  end
  local gone = redis.call('ZRANGEBYSCORE', K_SEEN, '-inf', now)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', K_SEEN, '-inf', now)
    remove_members('ZREM', K_QUEUE, gone, '')
    remove_members('ZREM', K_PRESENT, gone, '')
    remove_members('HDEL', K_SINCE, gone, 'w:')
  end
  return #dead + #gone
end

local function current_limit(default)
  local override = redis.call('GET', K_LIMIT)
  if override then
    return tonumber(override)
  end
  return default
end

local function wake()
  redis.call('PUBLISH', CHANNEL, '1')
end

-- Give every key an expiry just past the last deadline it holds, so an idle semaphore leaves
-- nothing behind; when nobody holds or waits, the counter and bookkeeping go at once.
-- (The limit override is an operator's decision and is left alone.)
local function touch()
  local last = 0
  local top = redis.call('ZRANGE', K_HOLDERS, -1, -1, 'WITHSCORES')
  if top[2] then
    last = tonumber(top[2])
  end
  top = redis.call('ZRANGE', K_SEEN, -1, -1, 'WITHSCORES')
  if top[2] and tonumber(top[2]) > last then
    last = tonumber(top[2])
  end
  if last == 0 then
    redis.call('DEL', K_TICKET, K_SINCE)
    return
  end
  local at = last + GRACE_MS
  redis.call('PEXPIREAT', K_HOLDERS, at)
  redis.call('PEXPIREAT', K_QUEUE, at)
  redis.call('PEXPIREAT', K_SEEN, at)
  redis.call('PEXPIREAT', K_TICKET, at)
  redis.call('PEXPIREAT', K_SINCE, at)
  redis.call('PEXPIREAT', K_PRESENT, at)
end

-- Take a waiter out of the line entirely.
local function drop_waiter(waiter)
  local left = redis.call('ZREM', K_QUEUE, waiter)
  redis.call('ZREM', K_SEEN, waiter)
  redis.call('ZREM', K_PRESENT, waiter)
  redis.call('HDEL', K_SINCE, 'w:' .. waiter)
  return left
end
