-- remember_wait: note which wait a Celery task's first delivery began, before its first copies
-- are sent. With acks_late, a worker killed after that refusal but before the message was acked
-- delivers the message again: a first delivery with no wait headers, which would begin a second
-- wait (a second run) of the same task. Flagged redelivered by the broker, it looks this note
-- up (HGET of ARGV[1]) and continues the first wait instead (see task.py).
--   KEYS    the semaphore keys (see _lib.lua), KEYS[11] and KEYS[12] included
--   ARGV[1] "<task id>#<retries>##<message nonce>" ("<task id>#<retries>#" for a message sent
--           without one): never a run id (no part of a run id after the task id is empty)
--   ARGV[2] the wait id
--   ARGV[3] remember_ms
-- Returns 1.

record_run(ARGV[1], ARGV[2], now_ms(), tonumber(ARGV[3]))
return 1
