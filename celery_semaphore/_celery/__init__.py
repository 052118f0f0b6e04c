"""The Celery glue: the task class and decorator, the worker's hooks, the settings, the wait
protocol of tasks that wait outside the worker (parking, wake and backstop queues).

It drives the semaphore through ``_core``; nothing in ``_core`` imports from here.
"""
