-- reset: forget every holder, waiter, recent start, run record, tenant clock and user tag of one
-- semaphore; the runtime overrides (limit, rate, spacing, pause, shares) stay.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV    none
-- Returns how many keys were deleted. Waiters blocked in acquire() find out at their next
-- keep-alive ask (patience / 3) and come back at their old place by their ticket.

return redis.call('DEL', K_HOLDERS, K_HOLDER_INFO, K_QUEUE, K_PRESENT, K_DEADLINES, K_WAITER_INFO, K_TICKET, K_STARTS,
                  K_RUNS, K_RUN_EXPIRY, KEYS[13], levels_key())
