-- _due_buckets: where a stored copy's due time is kept (_celery/due_copies.py). The due times
-- are split by the copy id's SHA-1 into DUE_BUCKETS small sorted sets, "<due key>:<bucket>",
-- each small enough for Redis's compact encoding (a listpack) at 100,000 stored copies, with an
-- index "<due key>-buckets": each bucket holding due times, scored no later than its first
-- (added LT, set back by whoever moves from it). The due key itself, one sorted set, is the
-- release before's: still moved from and withdrawn from, never written.
local DUE_BUCKETS = 1024  -- due_copies.DUE_BUCKETS

local function due_bucket(due_key, id)
  local bucket = tostring(tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % DUE_BUCKETS)
  return due_key .. ':' .. bucket, bucket
end

-- Keep "id" due at "at" (server ms) in its bucket; its due time in the release before's set, if
-- any, goes (a copy stored anew replaces the older).
local function set_due(due_key, at, id)
  local key, bucket = due_bucket(due_key, id)
  redis.call('ZADD', key, at, id)
  redis.call('ZADD', due_key .. '-buckets', 'LT', at, bucket)  -- LT still adds a new member
  redis.call('ZREM', due_key, id)
end

local function unset_due(due_key, id)
  redis.call('ZREM', (due_bucket(due_key, id)), id)
  redis.call('ZREM', due_key, id)
end

-- Each id due by "now", at most "most", taken from its bucket (then from the release before's
-- set) and handed to "visit"; the index set back to each bucket's next due time. Returns how
-- many were taken.
local function take_due(due_key, now, most, visit)
  local index, left = due_key .. '-buckets', most
  local function take_from(key)
    local due = redis.call('ZRANGEBYSCORE', key, '-inf', now, 'LIMIT', 0, left)
    if #due > 0 then
      redis.call('ZREM', key, unpack(due))
      for _, id in ipairs(due) do
        visit(id)
      end
    end
    left = left - #due
  end
  for _, bucket in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, most)) do
    if left <= 0 then
      break
    end
    local key = due_key .. ':' .. bucket
    take_from(key)
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if first[2] then
      redis.call('ZADD', index, first[2], bucket)
    else
      redis.call('ZREM', index, bucket)
    end
  end
  if left > 0 then
    take_from(due_key)
  end
  return most - left
end

-- The earliest due time kept (server ms; the index's, which may be early, never late), or nil.
local function first_due(due_key)
  local earliest
  for _, key in ipairs({due_key .. '-buckets', due_key}) do
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if first[2] and (not earliest or tonumber(first[2]) < earliest) then
      earliest = tonumber(first[2])
    end
  end
  return earliest
end

-- Every copy kept due now (a semaphore Redis that came back empty: nothing would wake one).
local function all_due_now(due_key)
  local index = due_key .. '-buckets'
  for _, bucket in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    local key = due_key .. ':' .. bucket
    redis.call('ZUNIONSTORE', key, 1, key, 'WEIGHTS', 0)
  end
  redis.call('ZUNIONSTORE', index, 1, index, 'WEIGHTS', 0)
  redis.call('ZUNIONSTORE', due_key, 1, due_key, 'WEIGHTS', 0)
end

