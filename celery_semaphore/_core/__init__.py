"""The semaphore itself: Redis, its Lua scripts, waiting, renewal, wake-ups and clients.

Nothing here imports Celery, kombu or click (``scripts/check_architecture.py`` checks it):
``FairSemaphore`` and ``MultiSemaphore`` work in any Python process.
"""
